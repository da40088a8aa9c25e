"""Run a method's `train(ctx)` in the test process on a run folder, the way the worker
does, with an optional stop request once step `stop_after` has been reported."""

from edgetune.engine.events import EventWriter, read_events
from edgetune.engine.loop import RunContext
from edgetune.engine.runfolder import RunDir


def run_inline(train, cfg, path, stop_after=0, resume=False):
    """(RunDir, metrics, events). `resume=True` continues from the last checkpoint."""
    run = RunDir(path)
    run.path.mkdir(parents=True, exist_ok=True)
    writer = EventWriter(run.events_path)
    ckpt = run.last_checkpoint()[1] if resume else None
    ctx = RunContext(cfg=cfg, run=run, emit=writer, resume=ckpt)

    def emit(type, **fields):
        ev = writer(type, **fields)
        if stop_after and type == "step" and fields["step"] == stop_after:
            ctx.stop_flag[0] = True
        return ev

    ctx.emit = emit
    try:
        metrics = train(ctx)
    finally:
        writer.close()
    return run, metrics, read_events(run.events_path)
