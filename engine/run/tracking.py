"""The run's numbers in the tracker its user already has: `run.report_to`.

events.jsonl stays the record; this mirrors the numeric fields of its `step` and `eval`
events (and of ESSA's warm-start run) into one backend, through that project's own library:

- tensorboard (the default): event files in `<run>/tensorboard/`, so `tensorboard --logdir
  runs` shows every run as its own curve
- mlflow: a local file store, `<run>/mlruns/` (`mlflow ui --backend-store-uri <run>/mlruns`)
- wandb: offline mode, under `<run>/wandb/` (`wandb sync` uploads it later)
- none: nothing

Only the worker imports this module (rank 0 alone). A backend that fails while the run
trains (a full disk, a library error) becomes one `warning` event and tracking stops
there: the run itself goes on. A resumed run appends: TensorBoard reads a new event file
in the same folder, and the steps continue where the checkpoint left them.
"""

from __future__ import annotations

import hashlib
import re
import time

from edgetune.engine.core.errors import reason_line

from edgetune.engine.run.api import check_report_to

# Event types whose numbers are curves, and the tag section each goes under.
SECTIONS = {"step": "train", "eval": "eval"}
# Fields of those events that are bookkeeping rather than a measurement.
NOT_METRICS = {"i", "time", "type", "step", "total", "elapsed", "eta", "prompts"}


def scalars(event: dict, prefix: str = "") -> list[tuple[str, float, int]]:
    """(tag, value, step) for each number of a `step` or `eval` event: `train/<field>`,
    `eval/<field>`, a dict field as `train/gpu/peak`; ESSA's warm-start SFT events under
    `warm_start/` with their own steps. Strings, booleans and lists are left out."""
    if event.get("type") == "warm_start":
        inner = {**event, "type": event.get("event")}
        inner.pop("event", None)
        return scalars(inner, "warm_start/")
    section, step = SECTIONS.get(event.get("type")), event.get("step")
    if section is None or not isinstance(step, int):
        return []
    out = []
    for key, value in event.items():
        if key in NOT_METRICS:
            continue
        items = [(f"{key}/{k}", v) for k, v in value.items()] if isinstance(value, dict) else [(key, value)]
        for name, v in items:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out.append((f"{prefix}{section}/{name}", float(v), step))
    return out


# --------------------------------------------------------------------------- backends


class TensorBoard:
    def __init__(self, run):
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(run.path / "tensorboard"))

    def add(self, tag: str, value: float, step: int, walltime: float) -> None:
        self.writer.add_scalar(tag, value, global_step=step, walltime=walltime)

    def flush(self) -> None:
        self.writer.flush()

    def close(self, status: str) -> None:
        self.writer.close()


class MLflow:
    """One MLflow run in the run folder's own file store; a resumed run logs into it again."""

    def __init__(self, run):
        from mlflow.tracking import MlflowClient

        self.client = MlflowClient(tracking_uri=f"file:{run.path.resolve() / 'mlruns'}")
        exp = self.client.get_experiment_by_name("edgetune")
        exp_id = exp.experiment_id if exp is not None else self.client.create_experiment("edgetune")
        earlier = self.client.search_runs([exp_id], max_results=1)  # this store holds this run only
        self.run_id = earlier[0].info.run_id if earlier else \
            self.client.create_run(exp_id, run_name=run.name).info.run_id
        if earlier:
            self.client.update_run(self.run_id, status="RUNNING")

    def add(self, tag: str, value: float, step: int, walltime: float) -> None:
        # MLflow keys allow letters, digits, _ - . / and spaces: "eval/pass@1" -> "eval/pass_1"
        self.client.log_metric(self.run_id, re.sub(r"[^\w\-./ ]", "_", tag), value,
                               timestamp=int(walltime * 1000), step=step)

    def flush(self) -> None:
        pass  # the file store writes each metric as it is logged

    def close(self, status: str) -> None:
        ended = {"finished": "FINISHED", "error": "FAILED"}.get(status, "KILLED")  # KILLED: stopped, resumable
        self.client.set_terminated(self.run_id, status=ended)


class WandB:
    """An offline W&B run under the run folder; its id follows the folder, so a resumed
    run continues the same W&B run once synced."""

    def __init__(self, run):
        import wandb

        ident = f"{run.name[:40]}-{hashlib.sha1(str(run.path.resolve()).encode()).hexdigest()[:8]}"
        self.run = wandb.init(mode="offline", dir=str(run.path), project="edgetune", name=run.name,
                              id=re.sub(r"[^\w\-.]", "-", ident), resume="allow")
        # Each section against its own step: the warm-start run's steps restart at 1.
        self.run.define_metric("step")
        self.run.define_metric("warm_start/step")
        for section in ("train", "eval"):
            self.run.define_metric(f"{section}/*", step_metric="step")
            self.run.define_metric(f"warm_start/{section}/*", step_metric="warm_start/step")
        self.pending: dict = {}

    def add(self, tag: str, value: float, step: int, walltime: float) -> None:
        self.pending[tag] = value
        self.pending["warm_start/step" if tag.startswith("warm_start/") else "step"] = step

    def flush(self) -> None:  # one log call an event: its numbers share one row
        if self.pending:
            self.run.log(self.pending)
            self.pending = {}

    def close(self, status: str) -> None:
        self.flush()
        self.run.finish(exit_code=0 if status == "finished" else 1)


BACKENDS = {"tensorboard": TensorBoard, "mlflow": MLflow, "wandb": WandB}


class Tracker:
    """The worker's event writer with the numbers mirrored into `cfg.run.report_to`:
    called like the writer, it writes the event first, then reports it. A library that
    is missing is refused at the start (ConfigError); any other failure of the backend,
    at the start or later, is one `warning` event, and tracking stops."""

    def __init__(self, emit, cfg, run):
        self.emit, self.backend, self.reporter = emit, cfg.run.report_to, None
        if self.backend not in BACKENDS:
            return
        check_report_to(self.backend)  # a resume where the library is gone: refused in one line
        self._guard(lambda: setattr(self, "reporter", BACKENDS[self.backend](run)))

    def __call__(self, type: str, **fields) -> dict:
        if type in ("finished", "stopped", "error"):
            self.close(type)  # before the run's last word, so a warning about it comes first
        event = self.emit(type, **fields)
        if self.reporter is not None:
            self._guard(lambda: self._report(event))
        return event

    def _report(self, event: dict) -> None:
        points = scalars(event)
        for tag, value, step in points:
            self.reporter.add(tag, value, step, event.get("time", time.time()))
        if points and (self.backend == "wandb" or event["type"] == "eval"):
            self.reporter.flush()

    def _guard(self, action, warn: bool = True) -> None:
        try:
            action()
        except Exception as e:
            reporter, self.reporter = self.reporter, None
            if reporter is not None:
                try:
                    reporter.close("error")
                except Exception:
                    pass
            if warn:
                first = reason_line(str(e))
                self.emit("warning", message=f"run.report_to {self.backend}: {type(e).__name__}: {first}; "
                                             "tracking stopped, training goes on (events.jsonl has every number)")

    def close(self, status: str = "error", warn: bool = True) -> None:
        """Flush and close the backend: at the run's terminal event, or (quietly) when the
        worker ends without one passing through here."""
        reporter, self.reporter = self.reporter, None
        if reporter is not None:
            self._guard(lambda: reporter.close(status), warn)
