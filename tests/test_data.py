"""engine/data/__init__.py: formats from each file type, exact prompt masking, truncation, the
embedded sets (no eval leakage), and one-line errors for bad input."""

from __future__ import annotations

import dataclasses
import json
import os

import pytest
import torch

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine import data as D


@pytest.fixture(scope="module")
def tok():
    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

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


def rl_pairs():
    rl_train = D.read_rows("embedded:arith-rl")
    rl_eval = D.read_rows(str(D.EMBEDDED_EVAL["embedded:arith-rl"]))
    return {(r["a"], r["b"]) for r in rl_train}, {(r["a"], r["b"]) for r in rl_eval}


def test_embedded_sft_loads_from_train_pairs_only(tok):
    d = D.load_sft(DataSettings(), tok, seed=0)
    assert d.report.rows_total == 350 and d.report.rows_kept == 350
    assert len(d.eval) == 35 and len(d.train) == 315
    train_pairs, held_out = rl_pairs()
    assert len(train_pairs) == 70 and len(held_out) == 30 and not train_pairs & held_out
    # Every SFT row (train and eval) teaches one of the 70 train pairs, none of the 30.
    texts = {targets(tok, e) for e in d.train + d.eval}
    assert texts == {f"{a} + {b} = {a + b}. Answer: {a + b}<|im_end|>" for a, b in train_pairs}
    prompts = " ".join(tok.decode(e.input_ids) for e in d.train + d.eval)
    for a, b in held_out:
        assert f"What is {a} plus {b}?" not in prompts and f"Add {a} and {b}." not in prompts


def test_embedded_rl_held_out_pairs(tok):
    d = D.load_rl(DataSettings(path="embedded:arith-rl"), seed=0, tokenizer=tok)
    assert len(d.train) == 70 and len(d.eval) == 30
    train = {(r["a"], r["b"]) for r in d.train}
    held = {(r["a"], r["b"]) for r in d.eval}
    assert not train & held and len(train | held) == 100
    for r in d.train + d.eval:
        assert r["prompt"] == f"What is {r['a']} plus {r['b']}?" and r["answer"] == str(r["a"] + r["b"])
    assert d.report.length_unit == "tokens" and d.report.token_lengths["min"] > 0


# --------------------------------------------------------------------------- formats x file types

ROWS = {
    "messages": [
        {"messages": [{"role": "user", "content": f"What is {i} plus 1?"},
                      {"role": "assistant", "content": f"Answer: {i + 1}"}]}
        for i in range(4)
    ],
    "alpaca": [{"instruction": f"Add one to {i}.", "input": "" if i % 2 else "Be brief.", "output": f"{i + 1}"}
               for i in range(4)],
    "prompt_completion": [{"prompt": f"{i} + 1 =", "completion": f" {i + 1}"} for i in range(4)],
    "text": [{"text": f"Counting: {i}, {i + 1}, {i + 2}."} for i in range(4)],
    "rl": [{"prompt": f"What is {i} plus 1?", "answer": str(i + 1), "level": i} for i in range(4)],
}
EXPECTED_TARGET = {
    "messages": lambda r: r["messages"][-1]["content"] + "<|im_end|>",
    "alpaca": lambda r: r["output"] + "<|im_end|>",
    "prompt_completion": lambda r: r["completion"] + "<|im_end|>",
    "text": lambda r: r["text"] + "<|im_end|>",
    "rl": lambda r: r["answer"] + "<|im_end|>",
}


def write(rows: list[dict], path):
    import datasets

    name = str(path)
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    elif name.endswith(".json"):
        path.write_text(json.dumps(rows, indent=1))
    elif name.endswith(".csv"):
        datasets.Dataset.from_list(rows).to_csv(name, index=False)
    elif name.endswith(".parquet"):
        datasets.Dataset.from_list(rows).to_parquet(name)
    else:
        datasets.Dataset.from_list(rows).save_to_disk(name)
    return name


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv", "parquet", "saved"])
@pytest.mark.parametrize("fmt", list(ROWS))
def test_format_round_trips(tok, tmp_path, kind, fmt):
    if kind == "csv" and fmt == "messages":
        pytest.skip("a CSV cell cannot hold a list of messages")
    rows = ROWS[fmt]
    path = write(rows, tmp_path / (f"d.{kind}" if kind != "saved" else "saved"))
    assert D.read_rows(path) == [
        {k: str(v) if kind == "csv" else v for k, v in r.items()} for r in rows
    ]
    assert D.detect_format(D.read_rows(path), path) == fmt
    d = D.load_sft(DataSettings(path=path, eval_fraction=0.0), tok, seed=0)
    assert d.report.format == fmt and d.report.rows_kept == 4 and not d.eval
    assert [targets(tok, e) for e in d.train] == [EXPECTED_TARGET[fmt](r) for r in rows]
    if fmt == "text":
        assert all(e.labels == e.input_ids for e in d.train)
    else:  # the prompt's text is in the input but not in the targets
        assert all(e.labels[0] == D.IGNORE for e in d.train)
    if fmt == "rl":
        r = D.load_rl(DataSettings(path=path, eval_fraction=0.0), seed=0)
        level = (lambda v: str(v)) if kind == "csv" else (lambda v: v)
        assert r.train == [{**x, "level": level(x["level"])} for x in rows]


def test_alpaca_input_joins_the_instruction(tok, tmp_path):
    path = write(ROWS["alpaca"][:1], tmp_path / "a.jsonl")
    ex = D.load_sft(DataSettings(path=path, eval_fraction=0.0), tok, seed=0).train[0]
    assert "Add one to 0.\n\nBe brief.<|im_end|>" in tok.decode(ex.input_ids)


def test_system_prompt_replaces_the_template_default(tok, tmp_path):
    path = write(ROWS["messages"][:1], tmp_path / "m.jsonl")
    ex = D.load_sft(DataSettings(path=path, eval_fraction=0.0, system_prompt="Only digits."), tok, 0).train[0]
    text = tok.decode(ex.input_ids)
    assert text.startswith("<|im_start|>system\nOnly digits.<|im_end|>") and "SmolLM" not in text
    assert targets(tok, ex) == "Answer: 1<|im_end|>"


def test_rl_prompt_lengths_match_what_rollouts_render(tok):
    from edgetune.engine.generation.rollouts import render_prompts

    for system in ("", "Only digits."):
        r = D.load_rl(DataSettings(path="embedded:arith-rl", system_prompt=system), seed=0, tokenizer=tok)
        assert r.train[0]["prompt"] == "What is 0 plus 0?"  # as written; rollouts add the system turn
        lengths = [len(ids) for ids in render_prompts(tok, [x["prompt"] for x in r.train + r.eval], system)]
        assert r.report.token_lengths["min"] == min(lengths) and r.report.token_lengths["max"] == max(lengths)
        assert sum(r.report.histogram["counts"]) == 100
    assert r.report.token_lengths["max"] < 30  # the short system turn replaced SmolLM's default one


def test_tokenizer_without_chat_template_masks_the_prompt(tok, tmp_path):
    import copy

    plain = copy.deepcopy(tok)
    plain.chat_template = None
    path = write(ROWS["prompt_completion"], tmp_path / "p.jsonl")
    d = D.load_sft(DataSettings(path=path, eval_fraction=0.0), plain, seed=0)
    for e, r in zip(d.train, ROWS["prompt_completion"]):
        prompt = plain(r["prompt"], add_special_tokens=False)["input_ids"]
        completion = plain(r["completion"], add_special_tokens=False)["input_ids"]
        assert e.input_ids == prompt + completion + [plain.eos_token_id]
        assert e.labels[: len(prompt)] == [D.IGNORE] * len(prompt)
        assert e.input_ids[-1] == plain.eos_token_id
        assert targets(plain, e) == r["completion"] + "<|im_end|>"


def test_template_breaking_the_prefix_property_is_an_error(tok, tmp_path):
    import copy

    odd = copy.deepcopy(tok)
    # Marks the last message: a prefix renders its last turn differently from the whole.
    odd.chat_template = ("{% for m in messages %}{% if loop.last %}LAST:{% endif %}{{ m['content'] }}\n"
                         "{% endfor %}{% if add_generation_prompt %}GO:{% endif %}")
    path = write(ROWS["messages"], tmp_path / "m.jsonl")
    with pytest.raises(DataError, match=r"row 1: .*prefix"):
        D.load_sft(DataSettings(path=path), odd, seed=0)


# --------------------------------------------------------------------------- length, split, report


def test_truncate_and_drop_are_counted(tok, tmp_path):
    rows = [
        {"prompt": "Hi.", "completion": "Short."},
        {"prompt": "Hi.", "completion": " ".join(["word"] * 60)},  # long target: truncate keeps part
        {"prompt": " ".join(["word"] * 60), "completion": "Short."},  # long prompt: nothing left
    ]
    path = write(rows, tmp_path / "p.jsonl")
    full = D.load_sft(DataSettings(path=path, eval_fraction=0.0, max_seq_len=4096), tok, 0).train
    n = [len(e.input_ids) for e in full]
    limit = n[0] + 5
    assert n[1] > limit and n[2] > limit

    cut = D.load_sft(DataSettings(path=path, eval_fraction=0.0, max_seq_len=limit), tok, 0)
    assert cut.report.truncated == 1
    assert cut.report.dropped == {D.DROP_NO_TARGET: 1}
    assert cut.report.rows_total == 3 and cut.report.rows_kept == 2
    assert [len(e.input_ids) for e in cut.train] == [n[0], limit]
    assert cut.train[1].input_ids == full[1].input_ids[:limit]

    drop = D.load_sft(DataSettings(path=path, eval_fraction=0.0, max_seq_len=limit, overlong="drop"), tok, 0)
    assert drop.report.truncated == 0 and drop.report.dropped == {D.DROP_LONG: 2}
    assert [e.input_ids for e in drop.train] == [full[0].input_ids]
    assert "dropped 2: longer than max_seq_len" in drop.report.summary()


def test_rl_drops_prompts_longer_than_max_seq_len(tok, tmp_path):
    rows = [{"prompt": "1 + 1?", "answer": "2"}, {"prompt": " ".join(["word"] * 100), "answer": "3"}]
    path = write(rows, tmp_path / "r.jsonl")
    r = D.load_rl(DataSettings(path=path, eval_fraction=0.0, max_seq_len=64), seed=0, tokenizer=tok)
    assert [x["answer"] for x in r.train] == ["2"] and r.report.dropped == {D.DROP_LONG_PROMPT: 1}


def test_split_is_seeded_and_keeps_one_eval_row(tok, tmp_path):
    path = write(ROWS["rl"] * 5, tmp_path / "r.jsonl")  # 20 rows
    a = D.load_rl(DataSettings(path=path, eval_fraction=0.25), seed=1)
    b = D.load_rl(DataSettings(path=path, eval_fraction=0.25), seed=1)
    assert (len(a.train), len(a.eval)) == (15, 5) and a.eval == b.eval
    assert len(D.load_rl(DataSettings(path=path, eval_fraction=0.01), seed=0).eval) == 1
    one = write(ROWS["rl"][:1], tmp_path / "one.jsonl")
    assert len(D.load_rl(DataSettings(path=one, eval_fraction=0.5), seed=0).eval) == 0
    # eval_path replaces the fractional split
    ev = write(ROWS["rl"][:2], tmp_path / "ev.jsonl")
    c = D.load_rl(DataSettings(path=path, eval_fraction=0.25, eval_path=ev), seed=0)
    assert len(c.train) == 20 and c.eval == D.load_rl(DataSettings(path=ev, eval_fraction=0), 0).train


def test_report_is_json_and_consistent(tok):
    d = D.load_sft(DataSettings(max_rows=100, eval_fraction=0.2), tok, seed=0)
    rep = json.loads(json.dumps(dataclasses.asdict(d.report)))
    assert rep["rows_total"] == 100 and rep["rows_kept"] == 100 and rep["train_rows"] == 80
    assert sum(rep["histogram"]["counts"]) == 100
    assert len(rep["histogram"]["edges"]) == len(rep["histogram"]["counts"]) + 1
    lengths = sorted(len(e.input_ids) for e in d.train + d.eval)
    t = rep["token_lengths"]
    assert (t["min"], t["max"]) == (lengths[0], lengths[-1])
    assert t["mean"] == pytest.approx(sum(lengths) / 100)
    assert t["min"] <= t["p50"] <= t["p95"] <= t["max"]
    s = d.report.summary()
    assert "100 of 100 rows kept" in s and "80 train, 20 eval" in s


def test_preview(tmp_path):
    path = write(ROWS["alpaca"], tmp_path / "a.jsonl")
    rows, fmt = D.preview(path, n=2)
    assert rows == ROWS["alpaca"][:2] and fmt == "alpaca"
    assert D.preview(path, fmt="text", n=1)[1] == "text"


# --------------------------------------------------------------------------- bad input


def bad(match: str, fn, *args, row: int | None = None):
    with pytest.raises(DataError, match=match) as e:
        fn(*args)
    assert "\n" not in str(e.value), "errors are one line"
    assert e.value.row == row
    return str(e.value)


def sft(tok, path, **kw):
    return lambda: D.load_sft(DataSettings(path=str(path), **kw), tok, 0)


def test_missing_and_unreadable_files(tok, tmp_path):
    assert str(tmp_path / "nope.jsonl") in bad("file not found", sft(tok, tmp_path / "nope.jsonl"))
    bad("unknown embedded dataset 'embedded:nope'", D.resolve_data_path, "embedded:nope")
    (tmp_path / "folder").mkdir()
    bad("saved with Dataset.save_to_disk", D.read_rows, str(tmp_path / "folder"))
    (tmp_path / "x.parquet").write_bytes(b"this is not parquet")
    bad(r"x\.parquet: cannot read as parquet", D.read_rows, str(tmp_path / "x.parquet"))
    (tmp_path / "latin.jsonl").write_bytes('{"text": "caf\xe9"}\n'.encode("latin-1"))
    bad("row 1: not UTF-8", D.read_rows, str(tmp_path / "latin.jsonl"), row=1)  # read line by line: named
    (tmp_path / "notes.txt").write_text("hello")
    bad("unknown file type", D.read_rows, str(tmp_path / "notes.txt"))
    bad("eval.jsonl: file not found", sft(tok, "embedded:arith-sft", eval_path=str(tmp_path / "eval.jsonl")))


def test_empty_datasets(tmp_path):
    (tmp_path / "zero.jsonl").write_text("")
    bad("empty", D.read_rows, str(tmp_path / "zero.jsonl"))
    (tmp_path / "blank.jsonl").write_text("\n\n")
    bad("empty", D.read_rows, str(tmp_path / "blank.jsonl"))
    (tmp_path / "header.csv").write_text("prompt,answer\n")
    bad("empty", D.read_rows, str(tmp_path / "header.csv"))
    (tmp_path / "list.json").write_text("[]")
    bad("empty", D.read_rows, str(tmp_path / "list.json"))


def test_malformed_json_names_the_line(tmp_path):
    f = tmp_path / "m.jsonl"
    f.write_text('{"text": "a"}\n{"text": "b"}\n{"text": "c",,}\n{"text": "d"}\n')
    msg = bad("malformed JSON on line 3", D.read_rows, str(f), row=3)
    assert msg.startswith(str(f))
    (tmp_path / "arr.json").write_text('[\n{"text": "a"},\n{"text": }\n]')
    bad("malformed JSON at line 3", D.read_rows, str(tmp_path / "arr.json"), row=3)
    (tmp_path / "s.jsonl").write_text('{"text": "a"}\n"just a string"\n')
    bad("expected a JSON object per row, got str", D.read_rows, str(tmp_path / "s.jsonl"), row=2)
    assert "column" in msg  # a fault inside the line: where in it


@pytest.mark.parametrize("cut", ['{"prompt": "3+3?", "completion": ', '{"prompt": "3+3?", "completion": "6"',
                                 '{"prompt": "3+3?", "completion": "6'])
def test_a_line_cut_short_is_said_so(tmp_path, cut):
    f = tmp_path / "cut.jsonl"
    f.write_text('{"prompt": "1+1?", "completion": "2"}\n' + cut + "\n")
    msg = bad("malformed JSON on line 2: the line ends before its JSON object does", D.read_rows, str(f), row=2)
    assert "delimiter" not in msg and "Expecting" not in msg
    # the streamed reader (the training data's) says the same
    from edgetune.engine.data.files import iter_rows

    with pytest.raises(DataError, match="ends before its JSON object does"):
        list(iter_rows(str(f)))


def test_unknown_columns_lists_found_and_expected(tok, tmp_path):
    path = write([{"question": "1+1?", "reply": "2"}], tmp_path / "q.jsonl")
    msg = bad("unknown columns", sft(tok, path))
    assert "['question', 'reply']" in msg and "instruction, input (optional), output" in msg
    assert "prompt, answer" in msg and "messages" in msg


def test_empty_target_names_the_row(tok, tmp_path):
    rows = ROWS["alpaca"][:2] + [{"instruction": "Say nothing.", "output": ""}]
    bad("target .* is empty", sft(tok, write(rows, tmp_path / "a.jsonl")), row=3)
    chat = ROWS["messages"][:1] + [{"messages": [{"role": "user", "content": "hi"},
                                                 {"role": "assistant", "content": "  "}]}]
    bad("target .* is empty", sft(tok, write(chat, tmp_path / "c.jsonl")), row=2)
    only_user = [{"messages": [{"role": "user", "content": "hi"}]}]
    bad("no assistant turn", sft(tok, write(only_user, tmp_path / "u.jsonl")), row=1)
    pc = [{"prompt": "hi", "completion": ""}]
    bad("target .* is empty", sft(tok, write(pc, tmp_path / "p.jsonl")), row=1)


def test_wrong_types_name_the_row(tok, tmp_path):
    rows = ROWS["messages"][:1] + [{"messages": "user: hi / assistant: hello"}]
    bad("'messages' must be a list of {role, content}, got str", sft(tok, write(rows, tmp_path / "m.jsonl")), row=2)
    rows = [{"messages": [{"role": "user", "content": ["hi"]}, {"role": "assistant", "content": "x"}]}]
    bad("'messages' item 1 must be", sft(tok, write(rows, tmp_path / "c.jsonl")), row=1)
    rows = ROWS["alpaca"][:1] + [{"instruction": ["a", "b"], "output": "x"}]
    bad("'instruction' must be a string, got list", sft(tok, write(rows, tmp_path / "a.jsonl")), row=2)
    rows = [{"prompt": {"text": "hi"}, "answer": "1"}]
    path = write(rows, tmp_path / "r.jsonl")
    bad("'prompt' must be a string, got dict", lambda: D.load_rl(DataSettings(path=path), 0), row=1)


def test_rl_rows_without_answer(tmp_path):
    rows = ROWS["rl"][:1] + [{"prompt": "What is 2 plus 2?"}]
    bad("missing 'answer'", lambda: D.load_rl(DataSettings(path=write(rows, tmp_path / "r.jsonl")), 0), row=2)
    no_col = [{"prompt": "What is 2 plus 2?", "completion": "4"}]
    msg = bad("RL needs rows with 'prompt' and 'answer'",
              lambda: D.load_rl(DataSettings(path=write(no_col, tmp_path / "p.jsonl")), 0))
    assert "['completion', 'prompt']" in msg
    empty = [{"prompt": "What is 2 plus 2?", "answer": ""}]
    bad("'answer' is empty", lambda: D.load_rl(DataSettings(path=write(empty, tmp_path / "e.jsonl")), 0), row=1)


def test_values_are_kept_as_written(tmp_path):
    # Arrow/pandas type inference would turn these into 5.0, 7 and a missing value.
    (tmp_path / "r.jsonl").write_text('{"prompt": "a", "answer": 5}\n{"prompt": "b", "answer": 5.5}\n')
    r = D.load_rl(DataSettings(path=str(tmp_path / "r.jsonl"), eval_fraction=0), 0)
    assert [x["answer"] for x in r.train] == ["5", "5.5"]
    (tmp_path / "r.csv").write_text('prompt,answer\n"Pad 7 to 3 digits, please",007\nUnknown?,NA\n')
    rows = D.read_rows(str(tmp_path / "r.csv"))
    assert rows == [{"prompt": "Pad 7 to 3 digits, please", "answer": "007"}, {"prompt": "Unknown?", "answer": "NA"}]


def test_gzip_columnar_json_and_max_rows(tmp_path):
    import gzip

    with gzip.open(tmp_path / "t.jsonl.gz", "wt") as f:
        f.write("".join(json.dumps(r) + "\n" for r in ROWS["text"]))
    assert D.read_rows(str(tmp_path / "t.jsonl.gz")) == ROWS["text"]
    (tmp_path / "cols.json").write_text(json.dumps({"prompt": ["1+1?", "2+2?"], "answer": ["2", "4"]}))
    assert D.read_rows(str(tmp_path / "cols.json")) == [{"prompt": "1+1?", "answer": "2"},
                                                          {"prompt": "2+2?", "answer": "4"}]
    (tmp_path / "wrapped.json").write_text(json.dumps({"data": ROWS["rl"]}))
    assert D.read_rows(str(tmp_path / "wrapped.json"), max_rows=3) == ROWS["rl"][:3]
    assert len(D.read_rows("embedded:arith-sft", max_rows=7)) == 7


def test_nothing_left_after_length_limits_is_an_error(tok, tmp_path):
    path = write(ROWS["prompt_completion"], tmp_path / "p.jsonl")
    bad(r"no rows left to train on after checking 4 \(4 longer than max_seq_len\)",
        sft(tok, path, max_seq_len=8, overlong="drop"))
    bad(r"no rows left to train on after checking 4 \(4 no target tokens left after truncation\)",
        sft(tok, path, max_seq_len=8))
    rl = write(ROWS["rl"], tmp_path / "r.jsonl")
    bad("no prompts left to train on",
        lambda: D.load_rl(DataSettings(path=rl, max_seq_len=8), seed=0, tokenizer=tok))


def test_a_line_over_the_limit_is_refused_naming_file_row_and_limit(tmp_path, monkeypatch):
    """A JSONL file is read line by line, and a line beyond MAX_LINE_BYTES stops the read
    before it is held whole (a file that is not rows: a dump, a binary)."""
    from edgetune.engine.data import files as data_files

    monkeypatch.setattr(data_files, "MAX_LINE_BYTES", 2**20)
    f = tmp_path / "rows.jsonl"
    f.write_text('{"text": "fine"}\n' + '{"text": "' + "x" * (2**20 + 10) + '"}\n')
    msg = bad(r"row 2: the line is longer than 1 MiB, the limit for one row", D.read_rows, str(f), row=2)
    assert msg.startswith(f"{f}, row 2:")
    assert D.read_rows(str(f), max_rows=1) == [{"text": "fine"}]  # a preview stops before it


def test_a_device_or_pipe_is_refused(tmp_path):
    msg = bad("not a regular file", D.read_rows, "/dev/zero")
    assert msg == "/dev/zero: not a regular file (a device, pipe or socket); give a data file or folder"
    os.mkfifo(tmp_path / "pipe.jsonl")
    bad("not a regular file", D.read_rows, str(tmp_path / "pipe.jsonl"))


def test_a_long_file_reports_progress(tok, tmp_path, monkeypatch):
    from edgetune.engine.data import files as data_files
    from edgetune.engine.data import sft as data_sft

    monkeypatch.setattr(data_files, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(data_files, "CHUNK_ROWS", 4)
    monkeypatch.setattr(data_sft, "CHUNK_ROWS", 4)
    f = tmp_path / "pc.jsonl"
    f.write_text("".join(json.dumps({"prompt": f"Add {i}", "completion": str(i + 1)}) + "\n" for i in range(10)))
    heard = []
    d = D.load_sft(DataSettings(path=str(f)), tok, 0, lambda *a: heard.append(a))
    assert len(d.train) + len(d.eval) == 10
    size = f.stat().st_size
    assert [h[0] for h in heard] == [4, 8, 10]
    assert heard[-1] == (10, size, size) and all(0 < h[1] <= size for h in heard)


def test_a_gz_of_blank_lines_says_how_far_the_check_got(tmp_path, monkeypatch, capsys):
    import gzip

    from edgetune.engine.data import files as data_files

    from edgetune.engine import cli

    monkeypatch.setattr(data_files, "PROGRESS_EVERY_S", 0.0)
    f = tmp_path / "blank.jsonl.gz"
    with gzip.open(f, "wb") as out:
        out.write(b"\n" * 3000)
    assert cli.main(["data", str(f)]) == 2
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith(f"checking {f}: 0 rows (") and len(err) > 100  # heard while it reads, not at the end
    assert err[-1] == f"error: {f}: the dataset is empty (no rows)"


@pytest.mark.parametrize("rows", [
    lambda i: {"prompt": f"Add {i} and {i}, then say why in a sentence.", "completion": f"{2 * i} because it is."},
    lambda i: {"prompt": f"Add {i} and {i}.", "chosen": f"{2 * i}", "rejected": f"{2 * i + 1}"},
    lambda i: {"prompt": f"Add {i} and {i}.", "answer": f"{2 * i}"},
], ids=["sft", "pairs", "rl"])
def test_the_data_check_reports_as_training_does_and_keeps_no_rows(tok, tmp_path, monkeypatch, rows):
    """`edgetune data`'s check (lengths_only) reports what the training's load reports, and
    keeps one number a row instead of the rows' tokens: its memory is a fraction of it (the
    file read in chunks of 100 rows, as a long file is in chunks of CHUNK_ROWS)."""
    import tracemalloc

    from edgetune.engine.data import files as data_files
    from edgetune.engine.data import rl as data_rl
    from edgetune.engine.data import sft as data_sft

    for module in (data_files, data_sft, data_rl):
        monkeypatch.setattr(module, "CHUNK_ROWS", 100, raising=False)

    f = tmp_path / "rows.jsonl"
    f.write_text("".join(json.dumps(rows(i)) + "\n" for i in range(3000)))
    ds = DataSettings(path=str(f))
    fmt = D.preview(str(f))[1]

    def load(lengths_only):
        tracemalloc.start()
        if fmt == "rl":
            data = D.load_rl(ds, 0, tok, lengths_only=lengths_only)
        else:
            data = (D.load_pairs if fmt == "pairs" else D.load_sft)(ds, tok, 0, lengths_only=lengths_only)
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
        return data, peak

    full, full_peak = load(False)
    check, check_peak = load(True)
    assert check.report == full.report
    assert all(not isinstance(x, (dict, D.SFTExample, D.PairExample)) for x in check.train + check.eval)
    assert check_peak < full_peak / 2, (check_peak, full_peak)
