"""engine/data.py: formats from each file type, exact prompt masking, truncation, the
embedded sets (no eval leakage), and one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from edgetune.engine import data as D
from edgetune.engine.errors import DataError
from edgetune.engine.settings import DataSettings


@pytest.fixture(scope="module")
def tok():
    from edgetune.engine.model import embedded_model_dir, load_tokenizer

    return load_tokenizer(str(embedded_model_dir()))


def targets(tok, ex: D.SFTExample) -> str:
    return tok.decode([t for t in ex.labels if t != D.IGNORE])


# --------------------------------------------------------------------------- masking


def test_chat_masking_is_exact(tok, tmp_path):
    row = {"messages": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "What is 2 plus 3?"},
        {"role": "assistant", "content": "2 + 3 = 5. Answer: 5"},
        {"role": "user", "content": "And 4 plus 4?"},
        {"role": "assistant", "content": "Answer: 8"},
    ]}
    f = tmp_path / "chat.jsonl"
    f.write_text(json.dumps(row) + "\n")
    d = D.load_sft(DataSettings(path=str(f), eval_fraction=0.0), tok, seed=0)
    ex = d.train[0]
    assert ex.input_ids == tok.apply_chat_template(row["messages"], tokenize=True)["input_ids"]
    assert targets(tok, ex) == "2 + 3 = 5. Answer: 5<|im_end|>Answer: 8<|im_end|>"
    # Each target span ends exactly at an end-of-turn token; the "\n" after it is masked.
    ends = [i for i, t in enumerate(ex.labels) if t == tok.eos_token_id]
    assert len(ends) == 2 and all(ex.labels[i + 1] == D.IGNORE for i in ends)
    assert ex.labels[-1] == D.IGNORE and ex.input_ids[-1] != tok.eos_token_id


def test_collate_pads_right_and_masks_padding(tok):
    d = D.load_sft(DataSettings(max_rows=8), tok, seed=0)
    exs = d.train[:4]
    b = D.collate(exs, tok.pad_token_id)
    width = max(len(e.input_ids) for e in exs)
    assert b["input_ids"].shape == b["labels"].shape == b["attention_mask"].shape == (4, width)
    for i, e in enumerate(exs):
        n = len(e.input_ids)
        assert b["input_ids"][i, :n].tolist() == e.input_ids
        assert b["labels"][i, :n].tolist() == e.labels
        assert b["attention_mask"][i].sum().item() == n
        assert (b["labels"][i, n:] == D.IGNORE).all() and (b["input_ids"][i, n:] == tok.pad_token_id).all()
    assert b["input_ids"].dtype == torch.long


# --------------------------------------------------------------------------- embedded


def test_embedded_sft_loads_from_train_pairs_only(tok):
    d = D.load_sft(DataSettings(), tok, seed=0)
    assert d.report.rows_total == 350 and d.report.rows_kept == 350
    assert len(d.eval) == 35 and len(d.train) == 315
    train_pairs, held_out = D_pairs()
    texts = {targets(tok, e) for e in d.train + d.eval}
    for a, b in held_out:
        assert f"{a} + {b} = {a + b}. Answer" not in " ".join(texts)
    assert len(texts) == 70  # one answer text per train pair


def D_pairs():
    rl_train = D.read_rows("embedded:arith-rl")
    rl_eval = [json.loads(l) for l in open(D.EMBEDDED_EVAL["embedded:arith-rl"])]
    return {(r["a"], r["b"]) for r in rl_train}, {(r["a"], r["b"]) for r in rl_eval}


def test_embedded_rl_held_out_pairs(tok):
    d = D.load_rl(DataSettings(path="embedded:arith-rl"), seed=0, tokenizer=tok)
    assert len(d.train) == 70 and len(d.eval) == 30
    train = {(r["a"], r["b"]) for r in d.train}
    held = {(r["a"], r["b"]) for r in d.eval}
    assert not train & held and len(train | held) == 100
    for r in d.train + d.eval:
        assert r["prompt"] == f"What is {r['a']} plus {r['b']}?" and r["answer"] == str(r["a"] + r["b"])
    assert d.report.length_unit == "tokens" and d.report.token_lengths["min"] > 0
