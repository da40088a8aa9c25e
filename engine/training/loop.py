"""Pieces every training method shares: the run context, step events with ETA and memory,
optimizer and schedule, checkpoints that resume exactly, and the final adapter.

A checkpoint holds the adapter weights (PEFT safetensors) and `training_state.pt`
(optimizer, scheduler, RNG states, step, and whatever the method adds). Restoring all of
them is what makes a resumed run produce the same loss values as an uninterrupted one.
The state holds only tensors, numbers and containers and is read with
`torch.load(weights_only=True)`: a checkpoint copied from elsewhere cannot run code.
"""

from __future__ import annotations

import io
import math
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import memory
from edgetune.engine.core.errors import CheckpointError, ConfigError, RunError, reason_line
from edgetune.engine.core.events import EventWriter, read_events
from edgetune.engine.core.runfolder import RunDir, atomic_dir
from edgetune.engine.core.settings import SEED, Config

from edgetune.engine.planning.effective import optimizer_name


@dataclass
class RunContext:
    cfg: Config
    run: RunDir
    emit: EventWriter
    resume: Path | None = None  # checkpoint folder to continue from
    # Steps the learning-rate schedule decays over when the run was trained further
    # (engine/run/api.more_steps); None = the method's steps.
    schedule_steps: int | None = None
    final_checkpoint: bool = True  # a checkpoint of the last step when the run finishes
    stop_flag: list = field(default_factory=lambda: [False])  # set by the worker's SIGTERM handler

    def should_stop(self) -> bool:
        """A stop asked for (STOP file, SIGTERM); on several ranks, asked on any rank, so
        every rank stops after the same step (a collective: every rank calls it alike)."""
        return dist.any_rank(self.stop_flag[0] or self.run.stop_requested())


# The largest run.seed, as its declaration in engine/core/settings/ allows (every consumer
# takes it); checked here too for callers that pass a seed without resolving settings.
MAX_SEED = int(SEED.high)


def check_seed(seed) -> int:
    """run.seed, or a one-line ConfigError when torch / numpy cannot take it."""
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed <= MAX_SEED:
        raise ConfigError(f"run.seed={seed}: out of range (a seed is a whole number from 0 to {MAX_SEED})")
    return seed


def seed_everything(seed: int) -> None:
    check_seed(seed)
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np

        np.random.seed(seed)
    except ImportError:
        pass


def micro_batch_indices(n: int, batch_size: int, k: int, seed: int) -> list[int]:
    """Example indices of micro-batch k: epochs of seeded permutations, laid end to end."""
    out = []
    pos = k * batch_size
    while len(out) < batch_size:
        epoch, offset = divmod(pos, n)
        g = torch.Generator().manual_seed(seed * 100_003 + epoch)
        perm = torch.randperm(n, generator=g).tolist()
        take = perm[offset : offset + batch_size - len(out)]
        out += take
        pos += len(take)
    return out


# --------------------------------------------------------------------------- progress


class Progress:
    """Elapsed time and ETA from the steps done in *this* process (a resumed run's
    earlier steps do not count towards its speed), timed from the first step on: set-up
    (loading, the initial evaluation) is reported as its phases, never as training time.
    Every method makes it with `start_training`, so their clocks agree."""

    def __init__(self, total: int, start_step: int = 0):
        self.total, self.start_step, self.t0 = total, start_step, time.time()
        self.last = self.t0

    def fields(self, step: int) -> dict:
        elapsed = time.time() - self.t0
        done = step - self.start_step
        eta = elapsed / done * (self.total - step) if done > 0 else None
        out = {"step": step, "total": self.total, "elapsed": round(elapsed, 2),
               "eta": round(eta, 1) if eta is not None else None, **memory.snapshot()}
        if dist.enabled():  # each rank's memory and time (a collective: every rank logs the same steps)
            now = time.time()
            mine = {"rank": dist.rank(), "gpu": out["gpu"], "host_rss": out["host_rss"],
                    "step_s": round(now - self.last, 3)}
            out["ranks"] = dist.all_gather_object(mine)
            self.last = now
        return out


def step_rows(n: int, batch_size: int, grad_accum: int, step: int, seed: int) -> list[list[int]]:
    """This rank's micro-batches of optimizer step `step`: the step's rows (grad_accum
    micro-batches of batch_size, as one process takes them) split evenly across ranks,
    then cut into micro-batches of at most batch_size. One process gets the original
    micro-batches back."""
    rows = [i for j in range(grad_accum) for i in micro_batch_indices(n, batch_size, step * grad_accum + j, seed)]
    mine = [rows[i] for i in dist.shard(len(rows))]
    return [mine[i:i + batch_size] for i in range(0, len(mine), batch_size)]


def start_training(ctx: RunContext, total: int, start_step: int = 0) -> Progress:
    """Announce the `training` phase and start the clock of its steps' elapsed time and ETA."""
    from edgetune.engine.core import phases

    phases.emit(ctx.emit, "training")
    return Progress(total, start_step)


# --------------------------------------------------------------------------- optimisation


def make_optimizer(params, name: str, lr: float, weight_decay: float, device: str):
    """auto = adamw: torch's AdamW, fused into one kernel on CUDA. LoRA parameters are few
    (40 M for a 7B model at r=16 on every projection), so its 8 bytes of fp32 state per
    parameter cost 0.3 GB there; the 8-bit optimizers keep 2 bytes but add a noticeable
    share to every step in their per-tensor kernels (bench/README.md).
    `paged_adamw_8bit` is the choice when the adapter is large and memory is short."""
    params = [p for p in params if p.requires_grad]
    name = optimizer_name(name)
    if name == "paged_adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw_8bit":
        import bitsandbytes as bnb

        return bnb.optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    if name == "adamw":
        fused = device.startswith("cuda") and all(p.is_cuda and p.is_floating_point() for p in params)
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=fused or None)
    from edgetune.engine.core.errors import ConfigError

    raise ConfigError(f"unknown optimizer '{name}' (auto, adamw, adamw_8bit, paged_adamw_8bit)")


def make_scheduler(optimizer, warmup_steps: int, total_steps: int, min_ratio: float = 0.1):
    """Linear warmup, then cosine decay to `min_ratio` of the peak learning rate over
    `total_steps`; past them the rate stays where the schedule ended. A run trained further
    (`edgetune resume --more-steps`, schedule_steps) keeps its schedule's length, so its added
    steps train at that final, low rate: the adapter has settled at it, and a rate
    climbing back up would first undo some of what the decay had gained."""

    def factor(step: int) -> float:
        step = min(step, total_steps)
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


# --------------------------------------------------------------------------- checkpoints


def rng_state() -> dict:
    """Every generator's state as tensors and plain numbers, so it loads without pickle."""
    py = random.getstate()
    state = {"python": [py[0], torch.tensor(py[1], dtype=torch.int64), py[2]], "torch": torch.get_rng_state()}
    try:
        import numpy as np

        name, keys, pos, has_gauss, cached = np.random.get_state()
        state["numpy"] = [name, torch.from_numpy(keys.astype(np.int64)), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    py = state["python"]
    random.setstate((py[0], tuple(int(v) for v in py[1].tolist()), py[2]))
    torch.set_rng_state(state["torch"])
    if "numpy" in state:
        import numpy as np

        name, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((name, keys.numpy().astype(np.uint32), pos, has_gauss, cached))
    if "cuda" in state and torch.cuda.is_available():
        # one state per GPU of the machine that saved it: a resume on fewer GPUs (another
        # machine, or CUDA_VISIBLE_DEVICES) restores those it has
        for i, s in enumerate(state["cuda"][: torch.cuda.device_count()]):
            torch.cuda.set_rng_state(s, i)


STATE_FILE = "training_state.pt"


def save_checkpoint(ctx: RunContext, step: int, model, optimizer=None, scheduler=None, **extra) -> Path:
    """Rank 0 writes (the ranks hold the same adapter and optimizer state); the others
    return at once. A sharded base's adapter and optimizer state are gathered whole
    first (every rank takes part), so the checkpoint is the one a single process writes."""
    from edgetune.engine.models import fsdp
    from edgetune.engine.models.export import name_the_base
    from edgetune.engine.models.model import resolve_model_path

    path = ctx.run.checkpoint(step)
    weights = fsdp.adapter_state(model)  # None unless sharded
    opt_state = None if optimizer is None else (
        optimizer.state_dict() if weights is None else fsdp.optimizer_state(optimizer))
    if not dist.is_main():
        return path
    with atomic_dir(path) as tmp:
        model.save_pretrained(tmp, state_dict=weights)
        # Named like the final adapter's base, so a checkpoint folder loads elsewhere too.
        name_the_base(tmp, ctx.cfg, resolve_model_path(ctx.cfg.model.name), step=step)
        state = {"step": step, "rng": rng_state(), **extra}
        if opt_state is not None:
            state["optimizer"] = opt_state
        if scheduler is not None:
            state["scheduler"] = scheduler.state_dict()
        buf = io.BytesIO()  # written by Python, so a full disk is an OSError(ENOSPC), not torch's own message
        torch.save(state, buf)
        (tmp / STATE_FILE).write_bytes(buf.getbuffer())
    ctx.run.prune_checkpoints(ctx.cfg.run.keep_checkpoints)
    ctx.emit("checkpoint", step=step, path=str(path))
    return path


def save_last_checkpoint(ctx: RunContext, stopped: bool, start_step: int, step: int, model, optimizer=None,
                         scheduler=None, **extra) -> None:
    """Checkpoint the step the loop ended at (unless that step already has one): a graceful
    stop keeps every finished step, so resume continues from exactly there, and a finished
    run keeps its optimizer state, so `edgetune resume --more-steps` can train it further
    (not for ESSA's warm-start SFT: ctx.final_checkpoint)."""
    last = ctx.run.last_checkpoint()
    if (stopped or ctx.final_checkpoint) and step > start_step and (last is None or last[0] != step):
        save_checkpoint(ctx, step, model, optimizer, scheduler, **extra)


def read_state(path: Path) -> dict:
    """A checkpoint's training state. Tensors, numbers and containers only
    (`weights_only`): a file that needs anything else is refused, never unpickled."""
    f = Path(path) / STATE_FILE
    try:
        return torch.load(f, weights_only=True, map_location="cpu")
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing") from None
    except Exception as e:  # truncated, damaged, or not made of plain tensors and numbers
        first = reason_line(str(e), 160) or type(e).__name__
        raise CheckpointError(f"{f}: unreadable or unsafe ({first})") from None


def check_checkpoint(path: Path) -> None:
    """Raise CheckpointError unless the adapter weights and the training state read whole."""
    from safetensors.torch import load_file

    read_state(path)
    f = Path(path) / "adapter_model.safetensors"
    try:
        load_file(str(f))
    except FileNotFoundError:
        raise CheckpointError(f"{f}: missing") from None
    except Exception as e:
        raise CheckpointError(f"{f}: unreadable ({reason_line(str(e), 160) or type(e).__name__})") \
            from None


def pick_checkpoint(run: RunDir, warn: Callable[[str], None]) -> tuple[int, Path] | None:
    """The newest intact checkpoint; each damaged one newer than it is named in a warning.
    None when the run has no checkpoint; an error when it has some and none is intact
    (training again from step 0 would silently throw the run away)."""
    cps = run.list_checkpoints()
    problems = []
    for step, path in reversed(cps):
        try:
            check_checkpoint(path)
        except CheckpointError as e:
            problems.append(str(e))
            warn(f"checkpoint {path} is damaged, skipped: {e}")
            continue
        if problems:
            warn(f"resuming from the previous intact checkpoint, step {step}")
        return step, path
    if problems:
        raise CheckpointError(f"no intact checkpoint in {run.checkpoints}: {problems[0]}")
    return None


def load_checkpoint(path: Path, model, optimizer=None, scheduler=None) -> dict:
    """Restore adapter weights, optimizer, scheduler and RNG; return the saved state.
    A sharded base (engine/models/fsdp.py) takes its shard of each whole tensor."""
    from peft.utils import set_peft_model_state_dict
    from safetensors.torch import load_file

    from edgetune.engine.models import fsdp

    sharded = fsdp.is_sharded(model)
    weights = load_file(str(Path(path) / "adapter_model.safetensors"))
    if sharded:
        fsdp.load_adapter(model, weights)
    else:
        set_peft_model_state_dict(model, weights)
    state = read_state(path)
    if optimizer is not None and "optimizer" in state:
        if sharded:
            fsdp.load_optimizer_state(optimizer, state["optimizer"])
        else:
            optimizer.load_state_dict(state["optimizer"])
    if scheduler is not None and "scheduler" in state:
        scheduler.load_state_dict(state["scheduler"])
    set_rng_state(state["rng"])
    return state


def finish(ctx: RunContext, model, tokenizer, base_path: str, step: int, metrics: dict,
           stopped: bool, t0: float) -> dict:
    """Write the final adapter, then the terminal event (`stopped` or `finished`). A resumed
    run's metrics keep what its earlier attempts measured (the figures before training, the
    latest evaluation) where this attempt did not measure them again.
    A stop asked for at any point of this attempt ends it `stopped`, also one that came
    after the last step (in the final evaluation, which it cut short, the comparison or the
    adapter's write): whoever pressed Stop is told the run stopped, and its resume does
    what was left."""
    from edgetune.engine.models import fsdp
    from edgetune.engine.models.export import write_adapter

    if ctx.resume is not None:
        metrics = {**earlier_metrics(ctx.run), **metrics}
    weights = fsdp.adapter_state(model)  # a sharded base's adapter, gathered whole (every rank)
    if dist.is_main():
        write_adapter(ctx.run.adapter, model, tokenizer, ctx.cfg, base_path, metrics, state_dict=weights)
    # (the STOP file of an earlier attempt is removed before this one's worker starts: api._spawn)
    stopped = ctx.should_stop() or stopped  # a collective: every rank calls finish
    fields = dict(step=step, adapter=str(ctx.run.adapter), metrics=metrics, elapsed=round(time.time() - t0, 2))
    ctx.emit("stopped" if stopped else "finished", **fields)
    return metrics


def earlier_metrics(run: RunDir) -> dict:
    """The metrics of the run's last `stopped` or `finished` event (its earlier attempts'),
    or {}."""
    ended = [e for e in read_events(run.events_path) if e["type"] in ("stopped", "finished")]
    return dict(ended[-1].get("metrics") or {}) if ended else {}


def check_finite(step: int, values: dict[str, float], advice: str, unit: str = "step") -> None:
    """Fail the run at the first step whose loss (or gradient norm, fitness) is NaN or
    infinite: the adapter after it is garbage, so the run must not finish and save it.
    `values` are numbers on the host: the loss the step already read, and (SFT) the
    gradient norm, one more read per step."""
    for name, v in values.items():
        if not math.isfinite(v):
            raise RunError(f"{unit} {step}: {name} is {v}; {advice}; no adapter was saved")


# Each text of a `samples` event is cut to this many characters: the events stay small.
SAMPLE_CHARS = 1000


def emit_samples(ctx: RunContext, step: int, prompts: list[str], completions: list[str],
                 references: list[str]) -> None:
    """One `samples` event: held-out prompts, the model's greedy completion of each, and
    the reference answer (the Train tab and the CLI show the latest)."""
    if not prompts:
        return
    ctx.emit("samples", step=step, samples=[
        {"prompt": p[:SAMPLE_CHARS], "completion": c[:SAMPLE_CHARS], "reference": r[:SAMPLE_CHARS]}
        for p, c, r in zip(prompts, completions, references)])


def every(n: int, step: int) -> bool:
    return n > 0 and step % n == 0
