"""Training on several GPUs (or, for tests, several CPU processes) with torch.distributed.

A run on N GPUs is N copies of the worker started by `torchrun` (one process a GPU, NCCL
between GPUs, gloo between CPU processes). Every rank holds the whole 4-bit base and the
same LoRA adapter; what each method exchanges per step:

- SFT: the step's rows are split across ranks; the label-token count of the whole step
  (one all_reduce of a number), then one all_reduce of the LoRA gradients (flattened into
  one buffer) after the backward. The update equals the one-process update of the same
  global batch.
- F-GRPO: each rank samples whole groups for its share of the step's prompts; the rewards
  and success flags (one all_gather of a few numbers per completion), the token and row
  counts the loss is normalised by, then the LoRA gradients (all_reduce) per optimizer step.
- ESSA: every rank holds the same CMA-ES state and asks the same population; each scores
  its share of the candidates; one all_gather of (index, fitness) per generation.

With `model.shard: fsdp` (SFT, F-GRPO) the base and the adapter are sharded instead: engine/models/fsdp.py.

Only rank 0 writes the run folder (events, checkpoints, adapter); the others read what
they need from rank 0 over the process group (`share_folder`), so on several machines
only the first one needs the runs folder. The model and data paths must exist on every
machine.

Started by `edgetune train --gpus N` (engine/run/api.py: a launcher process runs torchrun and
names a rank that died) or by hand: `torchrun --nproc-per-node N -m edgetune.engine.cli
train --config X.yaml`.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import Any

_STATE: dict = {"on": False, "rank": 0, "world": 1, "local_rank": 0}


def launched() -> bool:
    """True inside a process that torchrun started with more than one rank."""
    return int(os.environ.get("WORLD_SIZE", "1")) > 1


def init() -> bool:
    """Join the process group described by torchrun's environment (RANK, WORLD_SIZE,
    LOCAL_RANK, MASTER_ADDR/PORT): NCCL with one GPU a rank when CUDA is there, gloo on
    the CPU. Returns whether the process is one of several. Safe to call twice."""
    if _STATE["on"] or not launched():
        return _STATE["on"]
    import torch
    import torch.distributed as dist

    _die_with_parent()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        if local >= torch.cuda.device_count():
            from edgetune.engine.core.errors import ConfigError

            raise ConfigError(f"rank {rank}: local rank {local} but only {torch.cuda.device_count()} GPUs visible "
                              "(--gpus / --nproc-per-node is more than this machine has)")
        torch.cuda.set_device(local)
        # gloo next to NCCL: small Python objects (all_gather_object) stay off the GPU.
        dist.init_process_group("cuda:nccl,cpu:gloo", device_id=torch.device("cuda", local))
    else:
        dist.init_process_group("gloo")
    _STATE.update(on=True, rank=rank, world=world, local_rank=local)
    return True


def _die_with_parent() -> None:
    """torchrun starts ranks in their own sessions: if torchrun itself is killed (a
    second Ctrl-C, Run.kill()), the ranks must not live on. Linux: prctl PDEATHSIG."""
    try:
        import ctypes
        import signal

        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
        if os.getppid() == 1:  # the parent died before prctl
            os._exit(1)
    except OSError:
        pass


def shutdown() -> None:
    if _STATE["on"]:
        import torch.distributed as dist

        try:
            dist.destroy_process_group()
        except Exception:
            pass
        _STATE.update(on=False, rank=0, world=1, local_rank=0)


def enabled() -> bool:
    return _STATE["on"]


def rank() -> int:
    return _STATE["rank"]


def world() -> int:
    return _STATE["world"]


def is_main() -> bool:
    return _STATE["rank"] == 0


def device(default: str) -> str:
    """This rank's device: cuda:<local rank> when several ranks share a CUDA machine."""
    if _STATE["on"] and default.startswith("cuda"):
        return f"cuda:{_STATE['local_rank']}"
    return default


def shard(n: int, r: int | None = None, w: int | None = None) -> range:
    """Indices of rank r's share of n items: contiguous, sizes differ by at most one
    (the first n % w ranks take one more)."""
    r = rank() if r is None else r
    w = world() if w is None else w
    base, extra = divmod(n, w)
    start = r * base + min(r, extra)
    return range(start, start + base + (1 if r < extra else 0))


# --------------------------------------------------------------------------- collectives


def all_reduce_sum(value: float) -> float:
    if not _STATE["on"]:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t)
    return float(t.item())


def all_reduce_max(value: float) -> float:
    if not _STATE["on"]:
        return value
    import torch
    import torch.distributed as dist

    t = torch.tensor([float(value)], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def any_rank(flag: bool) -> bool:
    """True on every rank when it is true on one (a stop asked for on rank 0's machine)."""
    if not _STATE["on"]:
        return bool(flag)
    import torch
    import torch.distributed as dist

    t = torch.tensor([1 if flag else 0], dtype=torch.int32)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return bool(t.item())


def all_gather_object(obj: Any) -> list:
    """[rank 0's obj, rank 1's obj, ...] on every rank (pickled: small objects only)."""
    if not _STATE["on"]:
        return [obj]
    import torch.distributed as dist

    out: list = [None] * world()
    dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj: Any = None) -> Any:
    """Rank 0's obj on every rank."""
    if not _STATE["on"]:
        return obj
    import torch.distributed as dist

    box = [obj if is_main() else None]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def barrier() -> None:
    if _STATE["on"]:
        import torch.distributed as dist

        dist.barrier()


def all_reduce_grads(params) -> None:
    """Sum the gradients of `params` over the ranks, in one flattened buffer (LoRA
    parameters are few; a parameter without a gradient on this rank counts as zeros)."""
    if not _STATE["on"]:
        return
    import torch
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    if not params:
        return
    flat = torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1).to(torch.float32)
                      for p in params])
    dist.all_reduce(flat)
    off = 0
    for p in params:
        n = p.numel()
        if p.grad is None:
            p.grad = torch.empty_like(p)
        p.grad.copy_(flat[off:off + n].view_as(p))  # in place: no second set of gradients
        off += n


def broadcast_params(params) -> None:
    """Rank 0's values of `params` on every rank (the adapter starts identical)."""
    if not _STATE["on"]:
        return
    import torch
    import torch.distributed as dist

    params = [p for p in params if p.requires_grad]
    if not params:
        return
    with torch.no_grad():
        flat = torch.cat([p.detach().reshape(-1).to(torch.float32) for p in params])
        dist.broadcast(flat, src=0)
        off = 0
        for p in params:
            n = p.numel()
            p.copy_(flat[off:off + n].view_as(p))
            off += n


def share_folder(path: str | os.PathLike | None) -> Path | None:
    """Rank 0's folder (a checkpoint, a warm-start adapter) on every rank: rank 0 gets
    its own path back, the others a copy in a temporary folder, sent over the process
    group (ranks on other machines have no access to rank 0's runs folder)."""
    if not _STATE["on"]:
        return Path(path) if path is not None else None
    files = None
    if is_main():
        files = None if path is None else {str(p.relative_to(path)): p.read_bytes()
                                            for p in sorted(Path(path).rglob("*")) if p.is_file()}
    files = broadcast_object(files)
    if is_main() or files is None:
        return Path(path) if path is not None else None
    out = Path(tempfile.mkdtemp(prefix=f"edgetune-rank{rank()}-"))
    for rel, data in files.items():
        (out / rel).parent.mkdir(parents=True, exist_ok=True)
        (out / rel).write_bytes(data)
    return out
