"""How long a run will take, before it starts, and again once its first steps are timed.

Work is counted as the matmuls of the base's linear layers, 2 FLOPs per weight per token
through a forward. A LoRA step over a frozen base adds one backward through the
activations only (another 2 per weight per token), and a recomputed forward where the
layers are checkpointed; DPO adds the reference's forward, F-GRPO its rollouts (one
decode step per new token, every row of a batch together) and its policy update.

The machine's speed is measured, not looked up: a matmul of the model's own layer shape
(hidden x intermediate) in the dtype the run computes in (fp32 on the CPU, bf16 on a GPU),
on this process's CPU threads or GPU, at the number of rows each phase multiplies at a
time (the tokens of a micro-batch; the rows of a decode batch, where a small matmul runs
far below the machine's peak). Attention, norms, optimizer and data loading are left out:
the estimate is a floor that the first steps correct (`refine`).

    est = estimate(cfg, data)        # data: the Data tab's report (rows, mean tokens), or None
    est["phases"] -> {"initial_eval": s, "training": s, "final_eval": s}, est["total_s"]
    refine(est, steps_done=3, seconds_per_step=4.2)   # the measured step time, evaluations scaled alike
"""

from __future__ import annotations

import sys
import time

from edgetune.engine.core.arch import Arch, arch_from_config, read_model_config
from edgetune.engine.core.errors import RunError
from edgetune.engine.core.methods import METHODS
from edgetune.engine.core.settings import DPO_REFERENCE_FREE

_RATES: dict = {}  # (device, rows, hidden, intermediate) -> FLOP/s measured for this process


def matmul_rate(device: str, rows: int, hidden: int, intermediate: int, seconds: float = 0.2) -> float:
    """FLOP/s of [rows, hidden] x [hidden, intermediate] on `device` ("cpu" or "cuda") in the
    dtype a run computes in there, timed for about `seconds` once per process. A process
    that has not loaded torch (the app's) has it timed in a child process, once, and keeps
    the figure: it never loads torch itself."""
    # measured at a bounded shape: a 7B layer over a long row would take minutes to time on a
    # CPU, and a larger product runs at least as many FLOP/s (so the estimate errs long). The
    # rows rounded up to a power of two: estimates that differ a little in their rows' lengths
    # share one measurement, so that they compare as their token counts do, not as two timings' noise.
    rows = min(1 << max(0, rows - 1).bit_length(), 512)
    hidden, intermediate = min(hidden, 2048), min(intermediate, 8192)
    key = (device, rows, hidden, intermediate)
    if key not in _RATES:
        _RATES[key] = _time_matmul(*key, seconds) if "torch" in sys.modules else _time_matmul_apart(*key, seconds)
    return _RATES[key]


def _time_matmul_apart(device: str, rows: int, hidden: int, intermediate: int, seconds: float) -> float:
    import subprocess

    from edgetune.engine.core.threads import worker_env

    cmd = [sys.executable, "-m", "edgetune.engine.planning.timing", device, str(rows), str(hidden),
           str(intermediate), str(seconds)]
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=worker_env(),
                             stdin=subprocess.DEVNULL)
    except (OSError, subprocess.SubprocessError) as e:
        raise RunError(f"this machine's matmul rate could not be timed: {e}") from None
    try:
        return float(out.stdout.split()[-1])
    except (ValueError, IndexError):
        why = (out.stderr.strip().splitlines() or ["no figure printed"])[-1]
        raise RunError(f"this machine's matmul rate could not be timed: {why}") from None


def _time_matmul(device: str, rows: int, hidden: int, intermediate: int, seconds: float) -> float:
    import torch

    dtype = torch.float32 if device == "cpu" else torch.bfloat16
    x = torch.randn(rows, hidden, dtype=dtype, device=device)
    w = torch.randn(intermediate, hidden, dtype=dtype, device=device)
    torch.nn.functional.linear(x, w)  # warm-up
    n, t0 = 0, time.perf_counter()
    while True:
        torch.nn.functional.linear(x, w)
        n += 1
        if device != "cpu":
            torch.cuda.synchronize()
        if time.perf_counter() - t0 >= seconds:
            break
    return 2 * rows * hidden * intermediate * n / (time.perf_counter() - t0)


def linear_weights(a: Arch) -> int:
    """Weights of the decoder's linear layers, the output head counted apart."""
    attn = a.hidden * (a.q_dim + 2 * a.kv_dim) + a.q_dim * a.hidden
    mlp = 3 * a.hidden * a.intermediate * max(1, a.experts_per_token)
    return a.layers * (attn + mlp)


def _forward_flops(a: Arch, tokens: float, head_tokens: float) -> float:
    return 2 * linear_weights(a) * tokens + 2 * a.hidden * a.vocab * head_tokens


def _has_gpu() -> bool:
    """A CUDA GPU here: torch's answer where torch is loaded, nvidia-smi's elsewhere (the app)."""
    if "torch" in sys.modules:
        return sys.modules["torch"].cuda.is_available()
    from edgetune.engine.planning.planner import gpu_memory

    return gpu_memory() is not None


def estimate(cfg, data: dict | None = None, device: str | None = None) -> dict:
    """Seconds of each phase of `cfg`'s run on this machine, before it starts.

    data: the data check's report (engine/run/api.check_data's "report": train_rows,
    eval_rows, token_lengths.mean); without it the rows are data.max_rows (else 1,000 with
    data.eval_fraction held out) and each row data.max_seq_len tokens long, an upper bound.
    Returns {"phases": {phase: seconds or None}, "total_s", "assumed": [what was assumed],
    "per_step_s"}; a phase the model does not cover is None (ESSA's search)."""
    device = device or (cfg.model.device if cfg.model.device != "auto" else "cuda" if _has_gpu() else "cpu")
    device = "cuda" if str(device).startswith("cuda") else "cpu"
    if device == "cuda" and not _has_gpu():
        return {"phases": {"initial_eval": None, "training": None, "final_eval": None}, "total_s": None,
                "per_step_s": None, "assumed": ["no GPU here to time"], "device": device}
    a = arch_from_config(read_model_config(cfg.model.name))
    assumed: list[str] = []
    report = data or {}
    mean = (report.get("token_lengths") or {}).get("mean")
    if not mean:
        mean = cfg.data.max_seq_len
        assumed.append(f"rows of data.max_seq_len ({mean}) tokens")
    total_rows = cfg.data.max_rows or 1000
    eval_rows = report.get("eval_rows")
    if eval_rows is None:
        eval_rows = 0 if cfg.data.eval_path else round(total_rows * cfg.data.eval_fraction)
        assumed.append(f"{eval_rows} held-out rows")
    ckpt = 2 if cfg.model.gradient_checkpointing else 0
    method = METHODS[cfg.method]

    def seconds(flops: float, rows: int) -> float:
        return flops / matmul_rate(device, max(1, int(rows)), a.hidden, a.intermediate)

    phases: dict = {"initial_eval": 0.0, "training": None, "final_eval": 0.0}
    per_step = None
    s = getattr(cfg, method.name)
    if method.data in ("demonstrations", "pairs"):
        pair = 2 if method.data == "pairs" else 1  # a pair is two rows
        micro = s.batch_size * pair * mean
        reference = pair == 2 and s.loss_type not in DPO_REFERENCE_FREE  # the reference's forward
        passes = 2 + ckpt + (1 if reference else 0)
        per_step = seconds(_forward_flops(a, micro, micro) * passes / 2 * s.grad_accum, micro)
        phases["training"] = per_step * s.steps
        held = eval_rows * pair
        if getattr(s, "eval_batches", 0):
            held = min(held, s.eval_batches * s.batch_size)
        one_eval = seconds(_forward_flops(a, held * mean, held * mean), micro) if s.eval_every and held else 0.0
        phases["initial_eval"] = phases["final_eval"] = one_eval
        between = max(0, (s.steps - 1) // s.eval_every) if s.eval_every else 0
        phases["training"] += between * one_eval
    elif method.rollouts and not method.population:
        rows = s.prompts_per_step * s.num_generations
        prompt = mean
        new = s.max_new_tokens

        def rollouts(n_rows: int) -> float:
            prefill = seconds(_forward_flops(a, n_rows * prompt, n_rows), n_rows * prompt)
            return prefill + new * seconds(_forward_flops(a, n_rows, n_rows), n_rows)

        update = seconds(_forward_flops(a, rows * (prompt + new), rows * new) * (2 + ckpt) / 2
                         * s.num_iterations, rows * (prompt + new))
        per_step = rollouts(rows) + update
        phases["training"] = per_step * s.steps
        held = (s.eval_prompts or eval_rows) if eval_rows else 0
        passes = 1 + (1 if s.eval_k > 0 else 0)
        one_eval = rollouts(min(held, rows)) * max(1, -(-held // max(rows, 1))) * passes if held else 0.0
        phases["final_eval"] = one_eval
        phases["initial_eval"] = one_eval  # the base's figures, measured after training with the adapter off
    else:
        phases = {"initial_eval": None, "training": None, "final_eval": None}
        assumed.append(f"{method.label}'s search is not modelled")
    known = [v for v in phases.values() if v is not None]
    return {"phases": {k: (round(v, 1) if v is not None else None) for k, v in phases.items()},
            "total_s": round(sum(known), 1) if len(known) == len(phases) else None,
            "per_step_s": round(per_step, 3) if per_step is not None else None, "assumed": assumed,
            "device": device}


def refine(est: dict, steps_done: int, seconds_per_step: float, steps_total: int | None = None) -> dict:
    """The estimate once steps are timed: training from the measured seconds per step, the
    evaluations scaled by the measured step time over the predicted one (the same
    machine's same matmuls). `est`: estimate()'s result."""
    predicted = est.get("per_step_s")
    if not predicted or steps_done <= 0:
        return est
    scale = seconds_per_step / predicted
    phases = {k: (round(v * scale, 1) if v is not None else None) for k, v in est["phases"].items()}
    if steps_total:
        phases["training"] = round(seconds_per_step * steps_total, 1)
    known = [v for v in phases.values() if v is not None]
    return {**est, "phases": phases, "per_step_s": round(seconds_per_step, 3),
            "total_s": round(sum(known), 1) if len(known) == len(phases) else None, "refined_after": steps_done}


def words(est: dict) -> str:
    """One line: 'time on this machine: about 9m 40s (initial eval 30s, training 8m 40s,
    final eval 30s)', with what was assumed."""
    from edgetune.engine.core.units import duration

    names = {"initial_eval": "initial eval", "training": "training", "final_eval": "final eval"}
    if est.get("total_s") is None:
        return "time on this machine: not estimated (" + "; ".join(est.get("assumed") or []) + ")"
    parts = ", ".join(f"{names[k]} {duration(v)}" for k, v in est["phases"].items() if v)
    assumed = f"; assumed {', '.join(est['assumed'])}" if est.get("assumed") else ""
    return f"time on this machine: about {duration(est['total_s'])} ({parts}{assumed}; the first steps correct it)"


if __name__ == "__main__":  # the figure for a process without torch: DEVICE ROWS HIDDEN INTERMEDIATE SECONDS
    print(_time_matmul(sys.argv[1], *(int(x) for x in sys.argv[2:5]), float(sys.argv[5])))
