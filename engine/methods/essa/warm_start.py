"""ESSA's warm start: the adapter its search starts from, `essa.warm_start` or a short run of
the method its record's `warm_start` names (SFT: its record's loop module) in the ESSA run's
own `warm_start/` folder, kept when the run resumes."""

from __future__ import annotations

import gc
import importlib
from pathlib import Path

import torch

from edgetune.engine.core import distributed as dist
from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.methods import METHODS
from edgetune.engine.core.runfolder import RunDir, atomic_write_text
from edgetune.engine.core.settings import warm_start_config

from edgetune.engine.training.loop import RunContext, pick_checkpoint


class _WarmStartDir(RunDir):
    """The warm-start SFT's own folder inside the ESSA run; a STOP of the ESSA run stops it."""

    def __init__(self, path, parent: RunDir):
        super().__init__(path)
        self.parent = parent

    def stop_requested(self) -> bool:
        return self.parent.stop_requested()


def warm_start(ctx: RunContext) -> Path | None:
    """The adapter folder ESSA starts from: `essa.warm_start`, or a short SFT run in
    `<run>/warm_start/` (its events go to the ESSA run's stream as `warm_start` events,
    with the SFT event type in `event`). None when a stop was asked for during the SFT."""
    s = ctx.cfg.essa
    if s.warm_start:
        p = Path(s.warm_start).expanduser()
        if not (p / "adapter_config.json").is_file():
            raise ConfigError(f"essa.warm_start: no adapter_config.json in {s.warm_start}")
        return p
    sub = _WarmStartDir(ctx.run.path / "warm_start", ctx.run)
    done = sub.path / "COMPLETE"
    # Rank 0 decides from its run folder; the other ranks get its answer and a copy of
    # the folders they read (engine/core/distributed.py).
    if dist.broadcast_object(done.is_file() and (sub.adapter / "adapter_config.json").is_file()):
        return dist.share_folder(sub.adapter)  # a resumed ESSA run keeps its warm start
    cfg = warm_start_config(ctx.cfg)
    if dist.is_main():
        sub.path.mkdir(parents=True, exist_ok=True)
        atomic_write_text(sub.config_path, cfg.to_yaml())

    last_type = []

    def forward(type: str, **fields):
        last_type[:] = [type]
        return ctx.emit("warm_start", event=type, **fields)

    loop = importlib.import_module(METHODS[cfg.method].module)  # the warm start's own method (SFT)
    last = dist.broadcast_object(pick_checkpoint(sub, lambda m: ctx.emit("warning", message=m))
                                 if dist.is_main() else None)
    loop.train(RunContext(cfg=cfg, run=sub, emit=forward, resume=dist.share_folder(last[1]) if last else None,
                          stop_flag=ctx.stop_flag, final_checkpoint=False))
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    if last_type != ["finished"]:
        return None
    if dist.is_main():
        atomic_write_text(done, f"{cfg.method} finished\n")
    return dist.share_folder(sub.adapter)
