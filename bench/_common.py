"""Pieces the GPU benchmarks share (sft_speed, big72b, planner_check): the reference
baseline imported from `bench/reference/`, the engine's own training step with per-phase timing,
LoRA re-initialisation so every variant starts from the same weights, and the planner's
prediction for a measured shape.

The baseline script (`bench/reference/baseline.py`, the plain Hugging Face QLoRA stack
every ratio is taken against) is imported from there at run time. It reads `--tiny` from the command line itself (parse_known_args), so the scripts that
import it must be started with the same `--tiny`.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _importable_edgetune() -> None:
    """edgetune.* from this checkout without installing it. Not by putting the checkout
    itself on sys.path: its `kernels/` folder would then pass for the PyPI package
    `kernels` that transformers and bitsandbytes probe for (see pyproject.toml)."""
    try:
        import edgetune  # noqa: F401  (installed, e.g. the dev venv)
        return
    except ImportError:
        pass
    d = Path(tempfile.mkdtemp(prefix="edgetune-path-"))
    (d / "edgetune").symlink_to(ROOT / "edgetune")
    sys.path.insert(0, str(d))


_importable_edgetune()

import torch  # noqa: E402

GiB = 1024**3
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def load_baseline(ref_dir: str | os.PathLike = ROOT / "bench" / "reference"):
    """The reference baseline module (builds models layer by layer, HF QLoRA step)."""
    ref = Path(ref_dir)
    if not (ref / "baseline.py").is_file():
        raise SystemExit(f"{ref}/baseline.py missing")
    sys.path.insert(0, str(ref))
    import baseline  # noqa: PLC0415

    return baseline


def device() -> str:
    return "cuda" if torch.cuda.is_available() and "--tiny" not in sys.argv else "cpu"


def sync() -> None:
    if device() == "cuda":
        torch.cuda.synchronize()


def reset_peak() -> None:
    import gc

    gc.collect()
    if device() == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def peak() -> int | None:
    return torch.cuda.max_memory_allocated() if device() == "cuda" else None


def gib(x) -> float | None:
    return None if x is None else round(x / GiB, 2)


def write_json(path: Path, obj: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(obj, indent=1, default=str))
    tmp.replace(path)


# --------------------------------------------------------------------------- engine step


def reinit_lora(model, seed: int = 0) -> None:
    """PEFT's own init again (kaiming A, zero B): the adapter is the identity, so every
    variant's first loss is the base model's loss and all variants train the same path."""
    torch.manual_seed(seed)
    for m in model.modules():
        if hasattr(m, "reset_lora_parameters") and hasattr(m, "lora_A"):
            for name in list(m.lora_A.keys()):
                m.reset_lora_parameters(name, True)


def bf16_frozen_params(model) -> None:
    """Undo PEFT's fp32 upcast of the frozen unquantised parameters (embeddings, norms,
    lm_head, biases): the residual stream then stays bf16 as in the HF/Unsloth stacks."""
    for p in model.parameters():
        if not p.requires_grad and p.dtype == torch.float32 and type(p).__name__ == "Parameter":
            p.data = p.data.to(torch.bfloat16)


# The engine's step as it was before bf16 autocast, fused AdamW and 512-row loss chunks
# became its defaults: its rows in sft_speed.py / big72b.py measure what those are worth together.
STEP_BEFORE = dict(amp=False, chunk_rows=2048, optimizer="paged_adamw_8bit")


def engine_step(model, opt, batch: dict, handle=None, max_grad_norm: float = 1.0, amp: bool = True,
                chunk_rows: int = 512) -> tuple[float, dict]:
    """engine/methods/sft/sft.py's inner step for one micro-batch: SEBP rows, sparse-head loss under
    the engine's autocast, backward, clip, optimizer step. `amp=False` / `chunk_rows=2048`
    give the step as it was before those became the engine's defaults (for lever shares).
    Returns (loss, seconds per phase)."""
    import contextlib

    from edgetune.engine.models.model import autocast

    from edgetune.engine.training.lm_loss import causal_lm_loss

    t = [time.perf_counter()]
    wait = 0.0  # seconds the host spent waiting for the GPU at the phase ends: ~0 = host-bound

    def waited() -> float:
        t0 = time.perf_counter()
        sync()
        return time.perf_counter() - t0

    if handle is not None:
        from edgetune.kernels import sebp

        sebp.set_active_rows(handle, batch["attention_mask"].bool())
    with autocast(model) if amp else contextlib.nullcontext():
        loss, _ = causal_lm_loss(model, batch, chunk_rows=chunk_rows)
    wait += waited()
    t.append(time.perf_counter())
    loss.backward()
    wait += waited()
    t.append(time.perf_counter())
    torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], max_grad_norm)
    opt.step()
    opt.zero_grad(set_to_none=True)
    wait += waited()
    t.append(time.perf_counter())
    return float(loss.detach()), {"fwd": t[1] - t[0], "bwd": t[2] - t[1], "opt": t[3] - t[2], "sync_wait": wait}


def time_steps(step, n_warm: int, n_meas: int, log=print) -> dict:
    """Run `step()` (-> (loss, phases)) n_warm + n_meas times; medians of the timed ones,
    every loss, and the peak allocated since the last reset_peak()."""
    rec: dict = {"total": [], "fwd": [], "bwd": [], "opt": []}
    losses = []
    for it in range(n_warm + n_meas):
        sync()
        t0 = time.perf_counter()
        loss, ph = step()
        total = time.perf_counter() - t0
        losses.append(loss)
        log(f"  step {it}: {total:.3f}s fwd {ph['fwd']:.3f} bwd {ph['bwd']:.3f} opt {ph['opt']:.4f} loss {loss:.4f}")
        if it >= n_warm:
            rec["total"].append(total)
            for k in ph:
                rec.setdefault(k, []).append(ph[k])
    assert all(x == x for x in losses), "NaN loss"
    out = {k: statistics.median(v) for k, v in rec.items() if v}
    out["all_totals"] = [round(x, 4) for x in rec["total"]]
    out["losses"] = [round(x, 5) for x in losses]
    out["first_loss"] = losses[0]
    out["peak_alloc"] = peak()
    out["peak_alloc_GiB"] = gib(out["peak_alloc"])
    return out


# --------------------------------------------------------------------------- planner


def arch_folder(arch: dict, model_type: str = "qwen2") -> str:
    """A folder holding only config.json for `arch`: what the planner reads."""
    d = Path(tempfile.mkdtemp(prefix="arch-"))
    (d / "config.json").write_text(json.dumps({"model_type": model_type, **arch}))
    return str(d)


def planner_prediction(folder: str, method: str, sets: list[str]) -> dict:
    """The planner's estimate for the engine path (NF4, LoRA r16/a32 on all 7 projections,
    checkpointing) of a measured shape."""
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning import planner

    cfg = resolve(overrides=[f"method={method}", f"model.name={folder}", "model.quant=nf4", "lora.r=16",
                             "lora.alpha=32", "model.gradient_checkpointing=true", *sets])
    return planner.estimate(cfg, device="cuda", detect_gpu=False)


def sft_row_settings(bench: str, row: str, cfg: dict) -> list[str] | None:
    """The engine settings that a measured SFT row of sft_speed.py / big72b.py is, for the
    planner (None: the row is not an engine configuration, e.g. the step before autocast
    became the default). One table for the benches at run time and for planner_check.py's
    re-planning of their JSON, so a planner change is checked against every stored row."""
    if bench == "sft_speed":
        padded = ["sft.batch_size=8", f"data.max_seq_len={cfg['seq']}"]
        packed = ["sft.batch_size=1", f"data.max_seq_len={cfg['real_tokens']}", "sft.packing=true"]
        return {"+sebp": padded + ["model.liger=off"], "+packing": packed + ["model.liger=off"],
                "+liger": packed, "+flex": packed,
                "+ckpt_auto_12": packed + ["model.gradient_checkpointing=auto", "model.memory_budget_gib=12"],
                "+ckpt_auto_24": packed + ["model.gradient_checkpointing=auto", "model.memory_budget_gib=24"],
                "+no_ckpt": packed + ["model.gradient_checkpointing=false"]}.get(row)
    if bench == "big72b":
        short = ["sft.batch_size=1", f"data.max_seq_len={cfg['short']}"]
        long = ["sft.batch_size=1", f"data.max_seq_len={cfg['long']}", "model.offload_activations=true"]
        return {"ours_2048": short + ["model.liger=off"], "ours_2048_liger": short,
                "ours_2048_no_ckpt": short + ["model.gradient_checkpointing=false"],
                "ours_32k": long, "ours_32k_second": long}.get(row)
    raise ValueError(bench)


def compare(name: str, plan: dict, measured: int | None, key: str = "allocated_peak") -> dict:
    pred = plan[key]
    row = {"name": name, "predicted": pred, "predicted_GiB": gib(pred), "measured": measured,
           "measured_GiB": gib(measured), "shape": plan.get("shape"),
           "parts_GiB": {k: gib(plan[k]) for k in plan["parts"]}}
    if measured:
        row["error"] = round(pred / measured - 1, 3)
    return row


class Budget:
    """A bench's wall-clock budget and its results file. A section runs only when the
    time it needs is left; a failing section is recorded under R["errors"]; the JSON is
    rewritten after every section, so a time limit or a crash never loses earlier rows."""

    def __init__(self, tag: str, time_limit: float, path: Path, results: dict, t0: float):
        self.tag, self.time_limit, self.path, self.R, self.t0 = tag, time_limit, path, results, t0

    def left(self) -> float:
        return self.time_limit - (time.perf_counter() - self.t0)

    def log(self, *a) -> None:
        print(f"[{self.tag} {time.perf_counter() - self.t0:6.1f}s]", *a, flush=True)

    def dump(self) -> None:
        write_json(self.path, self.R)

    def section(self, name, fn, need_s: float = 0.0):
        if self.left() < need_s:
            self.R["notes"].append(f"{name} skipped: {self.left():.0f}s left, needs ~{need_s:.0f}s")
            self.log(f"SKIP {name}")
            return None
        self.log(f"=== {name} ===")
        try:
            return fn()
        except Exception as e:  # noqa: BLE001 - one failing row must not lose the others
            import traceback

            self.R["errors"][name] = f"{type(e).__name__}: {e}"[:1500]
            traceback.print_exc()
            return None
        finally:
            self.dump()
