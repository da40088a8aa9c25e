"""Preference tuning (engine/methods/dpo/dpo.py, engine/data/pairs.py): each loss against TRL's
own code on the same log-probs, the pairs' checks row by row, and a run of the quick start
through the CLI (events, adapter, resume with the same losses)."""

import json
import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.metric_words import metrics_text
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.methods.dpo.dpo import pair_losses

trl_dpo = pytest.importorskip("trl.trainer.dpo_trainer")


class _Accel:
    device = torch.device("cpu")

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def _batch(seed, B=5, T=9):
    """Per-token log-probs of B chosen and B rejected completions of varied lengths, and
    the reference's sums."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, T, (2 * B,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).long()
    per_token = -torch.rand(2 * B, T, generator=g, dtype=torch.float64) * 2 * mask
    ref = per_token.sum(1) + (torch.rand(2 * B, generator=g, dtype=torch.float64) - 0.5) * 3
    return per_token, mask, ref


def trl_dpo_loss(loss_type, beta, per_token, mask, ref):
    """TRL's DPOTrainer._compute_loss on log-probs handed in by a stand-in model; the
    completion mask is TRL's (one column longer than the shifted log-probs)."""
    B2, T = per_token.shape
    completion_mask = torch.cat([torch.zeros(B2, 1, dtype=torch.long), mask], dim=1)
    outputs = SimpleNamespace(log_probs=per_token, entropy=torch.zeros(B2, T), mean_logits=torch.zeros(B2, T),
                              is_top1=torch.zeros(B2, T, dtype=torch.bool))
    stand_in = SimpleNamespace(
        model=SimpleNamespace(training=True), accelerator=_Accel(), aux_loss_enabled=False, ld_alpha=None,
        precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_types=[loss_type], loss_weights=[1.0],
        beta=beta, use_weighting=False, label_smoothing=0.0, _metrics={"train": defaultdict(list)},
        _total_train_tokens=0, _tp_size=1)
    b = B2 // 2
    inputs = {"input_ids": torch.ones(B2, T + 1, dtype=torch.long), "attention_mask": torch.ones(B2, T + 1),
              "completion_mask": completion_mask, "ref_chosen_logps": ref[:b], "ref_rejected_logps": ref[b:]}
    return trl_dpo.DPOTrainer._compute_loss(stand_in, lambda **kw: outputs, inputs, False)


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_dpo_and_ipo_equal_trls_loss(loss_type, seed):
    per_token, mask, ref = _batch(seed)
    sums, counts = per_token.sum(1), mask.sum(1)
    b = len(sums) // 2
    ours, _, _ = pair_losses(loss_type, 0.3, 0.0, sums[:b], sums[b:], counts[:b], counts[b:], ref[:b], ref[b:])
    assert float(ours.mean()) == pytest.approx(float(trl_dpo_loss(loss_type, 0.3, per_token, mask, ref)), rel=1e-9)


@pytest.mark.parametrize("seed", [0, 1])
def test_simpo_equals_trls_cpo_loss(seed):
    cpo = pytest.importorskip("trl.experimental.cpo")
    per_token, mask, _ = _batch(seed)
    avg = per_token.sum(1) / mask.sum(1)
    b = len(avg) // 2
    stand_in = SimpleNamespace(alpha=0.0, accelerator=_Accel(), loss_type="simpo", simpo_gamma=0.7, beta=2.0,
                               label_smoothing=0.0)
    theirs = cpo.CPOTrainer.cpo_loss(stand_in, avg[:b], avg[b:])[0]
    sums, counts = per_token.sum(1), mask.sum(1)
    ours, _, _ = pair_losses("simpo", 2.0, 0.7, sums[:b], sums[b:], counts[:b], counts[b:])
    assert torch.allclose(ours, theirs, rtol=1e-9, atol=0)


@pytest.mark.parametrize("seed", [0, 1])
def test_orpo_equals_trls_odds_ratio_loss_plus_the_chosen_nll(seed):
    orpo = pytest.importorskip("trl.experimental.orpo")
    per_token, mask, _ = _batch(seed)
    per_token = per_token.float()  # TRL's odds ratio is computed in float32
    sums, counts = per_token.sum(1), mask.sum(1)
    b = len(sums) // 2
    avg = sums / counts
    stand_in = SimpleNamespace(beta=0.25, accelerator=_Accel())
    ratio_losses = orpo.ORPOTrainer.odds_ratio_loss(stand_in, avg[:b], avg[b:])[0]
    nll = -per_token[:b][mask[:b].bool()].mean()  # TRL: cross-entropy over every chosen token of the batch
    theirs = nll - ratio_losses.mean()
    ours, _, _ = pair_losses("orpo", 0.25, 0.0, sums[:b], sums[b:], counts[:b], counts[b:])
    ours_total = ours.mean() - sums[:b].sum() / counts[:b].sum()
    assert float(ours_total) == pytest.approx(float(theirs), rel=1e-6)


def test_orpo_is_finite_where_a_reply_is_almost_certain():
    sums = torch.tensor([-1e-9, -30.0], dtype=torch.float64)
    loss, _, _ = pair_losses("orpo", 0.1, 0.0, sums[:1], sums[1:], torch.tensor([3]), torch.tensor([3]))
    assert torch.isfinite(loss).all()


# --------------------------------------------------------------------------- data


@pytest.fixture(scope="module")
def tok():
    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    return load_tokenizer(str(embedded_model_dir()))


def _write(tmp_path, rows, name="pairs.jsonl"):
    p = tmp_path / name
    p.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(p)


def test_a_pair_is_two_labelled_rows_that_share_their_prompt(tmp_path, tok):
    from edgetune.engine.data import IGNORE, load_pairs

    rows = [{"prompt": f"What is {i} plus 1?", "chosen": f"{i + 1}", "rejected": f"{i + 2}"} for i in range(10)]
    rows.append({"messages": [{"role": "user", "content": "Hi"}], "chosen": [{"role": "assistant", "content": "Hello."}],
                 "rejected": {"role": "assistant", "content": "Go away."}})
    data = load_pairs(DataSettings(path=_write(tmp_path, rows), eval_fraction=0.0, max_seq_len=256), tok, 0)
    assert data.report.format == "pairs" and data.report.rows_kept == 11 and len(data.train) == 11
    for p in data.train:
        c, r = p.chosen, p.rejected
        start_c = next(i for i, y in enumerate(c.labels) if y != IGNORE)
        start_r = next(i for i, y in enumerate(r.labels) if y != IGNORE)
        assert start_c == start_r and c.input_ids[:start_c] == r.input_ids[:start_r]  # the same prompt
        assert c.input_ids != r.input_ids


@pytest.mark.parametrize("row, problem", [
    ({"prompt": "Q", "chosen": "A", "rejected": "A"}, "'chosen' and 'rejected' are the same reply"),
    ({"prompt": "Q", "chosen": "A"}, "no 'rejected' reply"),
    ({"prompt": "Q", "chosen": " ", "rejected": "B"}, "'chosen' is empty"),
    ({"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}], "chosen": "B",
      "rejected": "C"}, "must end with the user's turn"),
    ({"prompt": "Q", "chosen": [{"role": "user", "content": "B"}], "rejected": "C"}, "assistant messages"),
    ({"chosen": "B", "rejected": "C"}, "no 'prompt' or 'messages' column"),
])
def test_a_bad_pair_is_named_by_its_row(tmp_path, tok, row, problem):
    from edgetune.engine.data import load_pairs

    good = {"prompt": "What is 1 plus 1?", "chosen": "2", "rejected": "3"}
    path = _write(tmp_path, [good, good, row])
    with pytest.raises(DataError) as e:
        load_pairs(DataSettings(path=path, eval_fraction=0.0, max_seq_len=256), tok, 0)
    assert e.value.row == 3 and problem in e.value.problem


def test_a_pair_longer_than_max_seq_len_is_dropped_whole_and_counted(tmp_path, tok):
    from edgetune.engine.data import load_pairs

    rows = [{"prompt": "Q", "chosen": "short", "rejected": "also short"},
            {"prompt": "Q", "chosen": "short", "rejected": "word " * 400}]
    data = load_pairs(DataSettings(path=_write(tmp_path, rows), eval_fraction=0.0, max_seq_len=64), tok, 0)
    assert len(data.train) == 1 and data.report.dropped == {"longer than data.max_seq_len": 1}


def test_sft_rows_are_refused_for_pairs_in_one_line(tmp_path, tok):
    from edgetune.engine.data import load_pairs

    path = _write(tmp_path, [{"messages": [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]}])
    with pytest.raises(DataError, match="preference tuning needs pairs"):
        load_pairs(DataSettings(path=path, max_seq_len=64), tok, 0)


def test_the_embedded_pairs_prefer_the_right_sum():
    from edgetune.engine.core.settings import EMBEDDED_PAIRS_DATA

    from edgetune.engine.data.files import EMBEDDED, EMBEDDED_EVAL

    for path in (EMBEDDED[EMBEDDED_PAIRS_DATA], EMBEDDED_EVAL[EMBEDDED_PAIRS_DATA]):
        for line in path.read_text().splitlines():
            row = json.loads(line)
            a, b = (int(x) for x in row["chosen"].split(" = ")[0].split(" + "))
            assert row["chosen"].endswith(f"Answer: {a + b}") and not row["rejected"].endswith(f"Answer: {a + b}")
    train = {json.loads(x)["chosen"] for x in EMBEDDED[EMBEDDED_PAIRS_DATA].read_text().splitlines()}
    held = {json.loads(x)["chosen"] for x in EMBEDDED_EVAL[EMBEDDED_PAIRS_DATA].read_text().splitlines()}
    assert not train & held  # no held-out question is trained on


# --------------------------------------------------------------------------- a run


def _events(run):
    return [json.loads(x) for x in (run / "events.jsonl").read_text().splitlines()]


def dpo_config(model_dir, runs_dir, **over):
    from edgetune.engine.core import settings

    base = {
        "method": "dpo",
        "model": {"name": str(model_dir), "quant": "nf4", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"path": "embedded:arith-pairs", "max_rows": 32, "max_seq_len": 64},
        "run": {"runs_dir": str(runs_dir), "seed": 3, "checkpoint_every": 2, "report_to": "none"},
        "dpo": {"lr": 1e-3, "steps": 4, "batch_size": 2, "grad_accum": 2, "warmup_steps": 1, "eval_every": 2,
                "samples": 0},
    }
    for k, v in over.items():
        base[k].update(v)
    return settings.from_dict(base)


def _run(cfg, path, stop_after=0, resume=False):
    from inline_run import run_inline

    from edgetune.engine.methods.dpo import dpo

    return run_inline(dpo.train, cfg, path, stop_after=stop_after, resume=resume)[2]


@pytest.mark.parametrize("loss_type", ["sigmoid", "orpo"])
def test_a_run_evaluates_and_resumes_with_identical_losses(tiny_model_dir, tmp_path, loss_type):
    cfg = dpo_config(tiny_model_dir, tmp_path, dpo={"loss_type": loss_type})
    full = _run(cfg, tmp_path / "full")
    steps = {e["step"]: e for e in full if e["type"] == "step"}
    evals = [e for e in full if e["type"] == "eval"]
    assert sorted(steps) == [1, 2, 3, 4] and [e["step"] for e in evals] == [0, 2, 4]
    if loss_type == "sigmoid":  # the adapter starts as the identity: every reward 0, loss log 2
        assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-4) and evals[0]["eval_accuracy"] == 0.0
    for key in ("margin", "accuracy", "logps_chosen", "logps_rejected", "grad_norm"):
        assert math.isfinite(steps[1][key])
    assert 0.0 <= evals[-1]["eval_prefers_chosen"] <= 1.0
    assert len({e["loss"] for e in steps.values()}) == 4  # it trains
    # before training: the base's own preference; the reward figures only with no reference
    before = {k for k in full[-1]["metrics"] if k.endswith("_start")}
    assert before == {"eval_loss_start", "eval_prefers_chosen_start"} | (
        {"eval_accuracy_start", "eval_margin_start"} if loss_type == "orpo" else set())
    assert metrics_text({"eval_accuracy_start": 0.5, "eval_prefers_chosen_start": 0.25}) == \
        "eval reward accuracy before 0.5, eval chosen likelier before 0.25"

    cut = _run(cfg, tmp_path / "cut", stop_after=2)
    assert cut[-1]["type"] == "stopped" and cut[-1]["step"] == 2
    again = _run(cfg, tmp_path / "cut", resume=True)
    assert again[-1]["type"] == "finished"
    resumed = {e["step"]: e["loss"] for e in again if e["type"] == "step"}  # the file holds both attempts
    assert resumed == {k: e["loss"] for k, e in steps.items()}  # every step, bit for bit
    assert (tmp_path / "cut" / "adapter" / "adapter_model.safetensors").is_file()


def test_a_stop_in_the_final_evaluation_ends_the_run_stopped_and_its_resume_evaluates(tiny_model_dir, tmp_path):
    """Stop pressed in the final evaluation ends the run `stopped` after the batch it came
    in (it used to end `finished` without the evaluation's figures); the resume evaluates
    and finishes."""
    from inline_run import run_inline

    from edgetune.engine.methods.dpo import dpo

    cfg = dpo_config(tiny_model_dir, tmp_path)
    path = tmp_path / "r"
    events = run_inline(dpo.train, cfg, path, stop_when=lambda type, f: type == "phase"
                        and f["phase"] == "final_eval" and f.get("done") == 1)[2]
    assert (events[-1]["type"], events[-1]["step"]) == ("stopped", 4), events[-1]
    final = [e for e in events if e["type"] == "phase" and e["phase"] == "final_eval"]
    assert final[-1]["done"] == 1 < final[-1]["total"]
    assert [e["step"] for e in events if e["type"] == "eval"] == [0, 2]
    again = _run(cfg, path, resume=True)[len(events):]
    assert not any(e["type"] == "step" for e in again)  # nothing left to train
    assert [e["step"] for e in again if e["type"] == "eval"] == [4]
    assert (again[-1]["type"], again[-1]["step"]) == ("finished", 4)


def test_a_run_from_a_starting_adapter_compares_with_that_adapter(tiny_model_dir, tmp_path):
    """With lora.init_from the reference is the starting adapter, not the bare base: before
    the first update every reward is 0 (loss log 2, margin 0), although the starting adapter
    itself moves the log-probs away from the base's; a resumed run keeps that reference."""
    first = _run(dpo_config(tiny_model_dir, tmp_path, dpo={"steps": 2, "lr": 5e-2, "eval_every": 0}), tmp_path / "a")
    assert first[-1]["type"] == "finished"
    start = tmp_path / "a" / "adapter"
    cfg = dpo_config(tiny_model_dir, tmp_path, lora={"init_from": str(start)}, dpo={"loss_type": "sigmoid"})
    full = _run(cfg, tmp_path / "b")
    steps = {e["step"]: e for e in full if e["type"] == "step"}
    evals = [e for e in full if e["type"] == "eval"]
    assert steps[1]["loss"] == pytest.approx(math.log(2), abs=1e-5) and steps[1]["margin"] == pytest.approx(0, abs=1e-6)
    assert evals[0]["eval_margin"] == pytest.approx(0, abs=1e-6) and evals[0]["eval_accuracy"] == 0.0
    fresh = [e for e in _run(dpo_config(tiny_model_dir, tmp_path), tmp_path / "c") if e["type"] == "eval"]
    # the starting adapter changed what the model prefers: its own log-probs are not the base's
    assert evals[0]["eval_prefers_chosen"] != fresh[0]["eval_prefers_chosen"] or \
        steps[1]["logps_chosen"] != pytest.approx(
            next(e for e in _events(tmp_path / "c") if e["type"] == "step")["logps_chosen"], abs=1e-4)
    _run(cfg, tmp_path / "d", stop_after=2)
    again = _run(cfg, tmp_path / "d", resume=True)
    assert {e["step"]: e["loss"] for e in again if e["type"] == "step"} == {k: e["loss"] for k, e in steps.items()}


@pytest.mark.slow
def test_quickstart_learns_to_prefer_the_right_sum(tmp_path):
    """The DPO quick start through the CLI on the embedded SmolLM2-135M: held-out preference
    accuracy (the chosen reply's reward above the rejected one's) from 0 at the start (every
    reward is 0 before the first step) to at least 0.8; greedy success on the held-out
    arithmetic questions (the same 30 sums the pairs' held-out split asks) does not fall
    against the base in a paired test; and the adapter exports."""
    import subprocess
    import sys

    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "edgetune.engine.cli", "train", "--preset", "dpo-quickstart", "--set", "dpo.samples=0",
           "--runs-dir", str(runs), "--name", "qs"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    evals = [e for e in _events(runs / "qs") if e["type"] == "eval"]
    assert evals[0]["step"] == 0 and evals[0]["eval_accuracy"] == 0.0
    assert evals[-1]["eval_accuracy"] >= 0.8 and evals[-1]["eval_loss"] < evals[0]["eval_loss"], evals
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "eval", "--preset", "fgrpo-quickstart",
                        "--set", "fgrpo.eval_k=0", "--base", "--adapter", str(runs / "qs"), "--json"],
                       capture_output=True, text=True, timeout=1200)
    assert p.returncode == 0, p.stderr[-3000:]
    (held_out,) = json.loads(p.stdout)["tasks"]
    (c,) = [c for c in held_out["comparisons"] if c["metric"] == "success_rate"]
    assert not (c["difference"] < 0 and c["p_value"] < 0.05), c["words"]  # no detectable fall
    out = tmp_path / "exported"
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "export", str(runs / "qs"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    assert json.loads((out / "adapter_config.json").read_text())["peft_type"] == "LORA"


def test_the_planners_activations_match_what_a_pair_step_saves(tmp_path, embedded_dir):
    """A DPO micro-batch of 2 pairs (4 rows of 48 tokens) through forward_pairs on a tiny NF4
    Qwen2 (bf16, no checkpointing): the bytes autograd saves in the whole forward, against
    the planner's DPO activations for the same shape (the reference's no-grad forward saves
    nothing)."""
    from layer_probe import tiny_nf4_qwen2

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning import planner

    from edgetune.engine.data.pairs import PairExample
    from edgetune.engine.data.sft import SFTExample

    from edgetune.engine.methods.dpo.dpo import forward_pairs

    model, c = tiny_nf4_qwen2(tmp_path, embedded_dir)
    seq, prompt = 48, 6
    g = torch.Generator().manual_seed(1)

    def row():
        ids = torch.randint(0, 512, (seq,), generator=g).tolist()
        return SFTExample(ids, [-100] * prompt + ids[prompt:])

    pairs = [PairExample(row(), row()) for _ in range(2)]
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved = {}

    def pack(t):
        if t.untyped_storage().data_ptr() not in params:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    s = SimpleNamespace(loss_type="sigmoid")
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = forward_pairs(model, pairs, 0, "cpu", s)
    assert out["pc"].requires_grad and not out["rc"].requires_grad
    measured = sum(saved.values())
    cfg = resolve(overrides=[f"model.name={c.model.name}", "method=dpo", "model.quant=nf4", "model.device=cpu",
                             "model.dtype=bf16", "model.gradient_checkpointing=false", "lora.r=16",
                             "dpo.batch_size=2", f"data.max_seq_len={seq}"])
    predicted = planner.estimate(cfg, device="cpu", detect_gpu=False)["activations"]
    assert abs(predicted - measured) / measured < 0.15, (predicted, measured)


def test_the_held_out_reference_is_computed_once_a_run(tiny_model_dir, tmp_path, monkeypatch):
    """At the start the policy is the reference: one forward per held-out batch gives both,
    with the figures of two; later evaluations reuse those reference log-probs (one forward
    per batch) and give the figures of an evaluation that computes them again."""
    from edgetune.engine.models import model as model_lib

    from edgetune.engine.methods.dpo import dpo

    from edgetune.engine import data as data_lib

    cfg = dpo_config(tiny_model_dir, tmp_path)
    model, tok, _ = model_lib.load(cfg)
    pairs = data_lib.load_pairs(cfg.data, tok, cfg.run.seed).eval
    batches = -(-len(pairs) // cfg.dpo.batch_size)
    assert batches >= 2
    forwards = []
    real = dpo.labelled_logprobs
    monkeypatch.setattr(dpo, "labelled_logprobs", lambda *a, **k: forwards.append(1) or real(*a, **k))

    def evaluate(**kw):
        forwards.clear()
        out = dpo.evaluate(model, pairs, tok.pad_token_id, "cpu", cfg.dpo, **kw)
        return out, len(forwards)

    (start, refs), n = evaluate(at_reference=True)
    assert n == batches and len(refs) == batches
    (again, refs_again), n = evaluate()
    assert n == 2 * batches and start == again and all(torch.equal(a, b) for a, b in zip(refs, refs_again))
    with torch.no_grad():  # the adapter moves: the policy is no longer the reference
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)
    (later, _), n = evaluate(ref_logps=refs)
    assert n == batches
    (fresh, _), n = evaluate()
    assert n == 2 * batches and later == fresh and later["eval_margin"] != 0
