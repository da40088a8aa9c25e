"""The SFT method end to end: exact resume, the exported adapter, and real learning."""

import json
import subprocess
import sys

import pytest
import torch
from inline_run import run_inline, sft_config

from edgetune.engine.core.events import read_events
from edgetune.engine.core.runfolder import RunDir


def _run(cfg, path, stop_after=0, resume=False):
    from edgetune.engine.methods.sft import sft

    return run_inline(sft.train, cfg, path, stop_after=stop_after, resume=resume)[2]


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e["type"] == "step"}


def test_resume_continues_with_identical_losses(tiny_model_dir, tmp_path):
    cfg = sft_config(tiny_model_dir, tmp_path)
    full = _losses(_run(cfg, tmp_path / "full"))
    assert sorted(full) == [1, 2, 3, 4, 5, 6]

    first = _run(cfg, tmp_path / "cut", stop_after=3)
    assert first[-1]["type"] == "stopped" and first[-1]["step"] == 3
    assert RunDir(tmp_path / "cut").last_checkpoint()[0] == 3
    second = _run(cfg, tmp_path / "cut", resume=True)
    assert second[-1]["type"] == "finished"
    resumed = _losses(second)
    assert resumed == full, (resumed, full)  # every step, bit for bit
    # The losses really change (a run that did nothing would also "match").
    assert len(set(full.values())) == 6


def test_a_finished_run_says_whether_its_adapter_beat_the_base(tiny_model_dir, tmp_path):
    """With held-out evaluation on, the run ends with a paired comparison of each held-out
    demonstration's loss, the adapter against the base (the adapter switched off), and the
    Runs table shows its sentence."""
    from edgetune.engine.training.grading import eval_model

    from edgetune.engine.methods.sft import sft

    from edgetune.engine.run import api

    from edgetune.engine import data as data_lib

    cfg = sft_config(tiny_model_dir, tmp_path, sft={"eval_every": 3, "lr": 1e-2})
    events = _run(cfg, tmp_path / "r")
    (c,) = [e for e in events if e["type"] == "comparison"]
    assert (c["a"], c["b"], c["metric"]) == ("the base", "the adapter", "loss") and c["n"] > 0
    final = [e for e in events if e["type"] == "eval"][-1]["eval_loss"]
    assert c["difference"] < 0 and c["low"] <= c["difference"] <= c["high"]  # it learned: a lower loss
    # the adapter's side is the final evaluation's examples, one loss each
    model, tok, _ = eval_model(cfg, str(tmp_path / "r"))
    data = data_lib.load_sft(cfg.data, tok, cfg.run.seed)
    mine, _ = sft.example_losses(model, data.eval, tok.pad_token_id, 4, "cpu")
    assert len(mine) == c["n"] and abs(sum(mine) / len(mine) - final) < 0.5
    assert api.Run(tmp_path / "r").summary()["helped"] == c["words"]
    # the base is scored once: the initial evaluation's losses are the comparison's before side
    phases = [e["phase"] for e in events if e["type"] == "phase"]
    assert "initial_eval" in phases and "final_eval" in phases and "base_eval" not in phases
    # a resumed run takes them from its checkpoint
    first = _run(cfg, tmp_path / "cut", stop_after=4)
    again = _run(cfg, tmp_path / "cut", resume=True)[len(first):]
    assert "base_eval" not in [e["phase"] for e in again if e["type"] == "phase"]
    (resumed,) = [e for e in again if e["type"] == "comparison"]
    assert resumed["difference"] == pytest.approx(c["difference"], abs=1e-5)


# A stop that comes once the last step has begun, by the event it comes after: the last step's,
# the final evaluation's first batch (of two), the adapter's write.
LATE_STOPS = {"last step": lambda type, f: type == "step" and f["step"] == 6,
              "final eval": lambda type, f: type == "phase" and f["phase"] == "final_eval" and f.get("done") == 1,
              "export": lambda type, f: type == "phase" and f["phase"] == "export"}


@pytest.mark.parametrize("when", LATE_STOPS)
def test_a_stop_after_the_last_step_began_ends_the_run_stopped_and_its_resume_evaluates(tiny_model_dir, tmp_path,
                                                                                      when):
    """Stop pressed while the run trains its last step, in its final evaluation or while its
    adapter is written ends the run `stopped` there, as between steps, with its adapter and
    the last step's checkpoint (it used to end `finished`, the final evaluation cut short and
    its figures the previous evaluation's); the resume does the final evaluation and the
    comparison with the base, and finishes."""
    from edgetune.engine.methods.sft import sft

    cfg = sft_config(tiny_model_dir, tmp_path, sft={"eval_every": 3})
    path = tmp_path / "r"
    events = run_inline(sft.train, cfg, path, stop_when=LATE_STOPS[when])[2]
    assert (events[-1]["type"], events[-1]["step"]) == ("stopped", 6), events[-1]
    assert (path / "adapter" / "adapter_config.json").is_file() and RunDir(path).last_checkpoint()[0] == 6
    final = [e for e in events if e["type"] == "phase" and e["phase"] == "final_eval"]
    if when == "last step":
        assert not final  # the evaluation did not begin
    if when == "final eval":
        assert final[-1]["done"] == 1 < final[-1]["total"]  # it ended after the batch the stop came in
    if when != "export":
        assert not any(e["type"] == "comparison" or e["type"] == "eval" and e["step"] == 6 for e in events)

    again = _run(cfg, path, resume=True)[len(events):]
    assert not any(e["type"] == "step" for e in again)  # from the step-6 checkpoint: nothing left to train
    assert [e["step"] for e in again if e["type"] == "eval"] == [6]
    assert [e["step"] for e in again if e["type"] == "comparison"] == [6]
    assert (again[-1]["type"], again[-1]["step"]) == ("finished", 6)


def test_exported_adapter_gives_the_in_memory_logits(tiny_model_dir, tmp_path):
    from peft import PeftModel

    from edgetune.engine.models import model as model_lib
    from edgetune.engine.models.export import write_adapter

    cfg = sft_config(tiny_model_dir, tmp_path)
    model, tok, base_path = model_lib.load(cfg)
    torch.manual_seed(0)
    # Move the adapter away from its zero-initialised B so the test can fail.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    model.eval()
    ids = torch.tensor([tok.encode("What is 3 plus 4? Answer: 7")])
    with torch.no_grad():
        ours = model(input_ids=ids).logits
    out = write_adapter(tmp_path / "adapter", model, tok, cfg, base_path, {"loss": 1.0})
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()
    assert (out / "README.md").read_text().count("LoRA adapter") == 1

    base, _, _ = model_lib.load_base(cfg.model)
    loaded = PeftModel.from_pretrained(base, str(out)).eval()
    with torch.no_grad():
        theirs = loaded(input_ids=ids).logits
    with torch.no_grad(), loaded.disable_adapter():
        plain = loaded(input_ids=ids).logits
    assert torch.allclose(ours, theirs, atol=1e-5, rtol=0)
    assert (ours - plain).abs().max() > 1e-3  # the adapter does something


def test_loss_ignores_prompt_and_padding_exactly(tiny_model_dir, tmp_path):
    """Our sparse-head loss equals transformers' own loss on the same batch."""
    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.lm_loss import causal_lm_loss

    cfg = sft_config(tiny_model_dir, tmp_path)
    model, tok, _ = model_lib.load(cfg)
    ids = torch.randint(3, 1000, (3, 20))
    mask = torch.ones_like(ids)
    mask[0, 15:] = 0
    labels = ids.clone()
    labels[:, :7] = -100
    labels[mask == 0] = -100
    batch = {"input_ids": ids, "attention_mask": mask, "labels": labels}
    ours, n = causal_lm_loss(model, batch, sparse_head=True)
    ref, m = causal_lm_loss(model, batch, sparse_head=False)
    assert n == m == int((labels[:, 1:] != -100).sum())
    assert torch.allclose(ours, ref, rtol=1e-5)
    g1 = torch.autograd.grad(ours, [p for p in model.parameters() if p.requires_grad])
    g2 = torch.autograd.grad(ref, [p for p in model.parameters() if p.requires_grad])
    for a, b in zip(g1, g2):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-7)


def test_gradient_accumulation_weighs_every_label_token_the_same(tiny_model_dir, tmp_path):
    """batch 8 == 4 x grad_accum 2 == 2 x grad_accum 4, on rows of very different lengths."""
    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.lm_loss import causal_lm_loss

    from edgetune.engine.methods.sft.sft import accumulate

    from edgetune.engine import data as data_lib

    cfg = sft_config(tiny_model_dir, tmp_path, model={"quant": "none"})
    model, tok, _ = model_lib.load(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # B starts at zero: a non-zero B gives A a gradient too
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    g = torch.Generator().manual_seed(1)
    rows = []
    for length in (4, 60, 7, 41, 5, 90, 12, 3):
        ids = torch.randint(3, 1000, (length,), generator=g).tolist()
        rows.append(data_lib.SFTExample(ids, [-100] * (length // 3) + ids[length // 3:]))
    params = [p for p in model.parameters() if p.requires_grad]

    def step(split):
        model.zero_grad(set_to_none=True)
        batches = [data_lib.collate(rows[i : i + split], tok.pad_token_id) for i in range(0, 8, split)]
        loss, n = accumulate(model, batches)
        return loss, n, [p.grad.clone() for p in params]

    loss8, n8, grads8 = step(8)
    assert n8 == sum(len(r.labels) - 1 - r.labels[1:].count(-100) for r in rows)
    for split in (4, 2):
        loss, n, grads = step(split)
        assert n == n8 and loss == pytest.approx(loss8, rel=1e-6)
        for a, b in zip(grads, grads8):
            assert torch.allclose(a, b, atol=1e-5, rtol=0)
    # what it replaces, each micro-batch's mean / grad_accum, is another update on these rows
    model.zero_grad(set_to_none=True)
    for i in range(0, 8, 2):
        loss, _ = causal_lm_loss(model, data_lib.collate(rows[i : i + 2], tok.pad_token_id))
        (loss / 4).backward()
    assert max(float((p.grad - b).abs().max()) for p, b in zip(params, grads8)) > 1e-4


@pytest.mark.slow
def test_quickstart_learns_and_exports(tmp_path):
    """The README's quick start through the CLI, on the embedded SmolLM2-135M."""
    runs = tmp_path / "runs"
    cmd = [sys.executable, "-m", "edgetune.engine.cli", "train", "--preset", "sft-quickstart",
           "--runs-dir", str(runs), "--name", "qs"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=1800)
    assert p.returncode == 0, p.stderr[-3000:]
    events = read_events(runs / "qs" / "events.jsonl")
    evals = [e["eval_loss"] for e in events if e["type"] == "eval"]
    assert len(evals) >= 2 and evals[-1] < evals[0] * 0.8, evals
    assert events[-1]["type"] == "finished"

    out = tmp_path / "exported"
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "export", str(runs / "qs"), "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    cfg = json.loads((out / "adapter_config.json").read_text())
    assert cfg["r"] == 16 and cfg["peft_type"] == "LORA"
    assert (out / "tokenizer_config.json").is_file()


def test_chunked_head_loss_equals_unchunked():
    """Checkpointed chunks of the lm_head give the same loss and gradients as one pass."""
    from edgetune.kernels.sebp import sparse_lm_head_loss

    g = torch.Generator().manual_seed(1)
    h = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    labels = torch.randint(0, 50, (3, 11), generator=g)
    labels[0, :4] = -100
    labels[2, 7:] = -100
    whole = sparse_lm_head_loss(h, w, labels)
    gh, gw = torch.autograd.grad(whole, [h, w])
    chunked = sparse_lm_head_loss(h, w, labels, chunk_rows=4)
    ch, cw = torch.autograd.grad(chunked, [h, w])
    assert torch.allclose(whole, chunked, rtol=1e-6)
    assert torch.allclose(gh, ch, rtol=1e-5, atol=1e-7) and torch.allclose(gw, cw, rtol=1e-5, atol=1e-7)
    assert gh[0, :3].abs().sum() == 0  # rows with no target get exactly zero gradient


def test_fused_lora_and_sebp_runs_give_the_plain_losses(tiny_model_dir, tmp_path, monkeypatch):
    """sft.fused_lora and SEBP's runs backward (sft.sebp_kernel=runs) in a real run: every
    step's loss is the plain run's, and both levers really ran."""
    from edgetune.kernels import lora_fused, sebp

    used = {"fused": 0, "runs": 0}
    real_apply, real_runs = lora_fused.FusedLoraFn.apply, sebp._sparse_backward_runs
    monkeypatch.setattr(lora_fused.FusedLoraFn, "apply", lambda *a: used.update(fused=used["fused"] + 1) or real_apply(*a))
    monkeypatch.setattr(sebp, "_sparse_backward_runs", lambda *a: used.update(runs=used["runs"] + 1) or real_runs(*a))
    plain = _losses(_run(sft_config(tiny_model_dir, tmp_path), tmp_path / "plain"))
    assert used == {"fused": 0, "runs": 0}
    cfg = sft_config(tiny_model_dir, tmp_path, sft={"fused_lora": True, "sebp": "on", "sebp_kernel": "runs"})
    levers = _losses(_run(cfg, tmp_path / "levers"))
    assert used["fused"] > 0 and used["runs"] > 0
    assert sorted(levers) == sorted(plain) and len(set(plain.values())) > 1
    for k in plain:
        assert abs(levers[k] - plain[k]) <= 1e-4 * abs(plain[k]), (k, levers[k], plain[k])
