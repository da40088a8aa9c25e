"""The phases of a run, their words, and the `phase` event that announces each one.

A worker emits `phase` when it enters a phase and again as a long phase advances
(`done`/`total` in `unit`); the page, the CLI's progress bar and a reader of
events.jsonl all print the same line from it with `describe`. No torch here: the app
imports this module.
"""

from __future__ import annotations

LABELS = {
    "loading": "loading the model",
    "data_check": "checking the data",
    "initial_eval": "initial eval",
    "warm_start": "warm start (SFT)",
    "training": "training",
    "final_eval": "final eval",
    "base_eval": "base model eval (the before-training figures)",
    "export": "saving the adapter",
}


def emit(emit_fn, phase: str, done: int | None = None, total: int | None = None, unit: str = "") -> None:
    """Announce `phase` (one of LABELS), with progress when it is long."""
    fields = {"phase": phase}
    if total is not None:
        fields.update(done=int(done or 0), total=int(total), unit=unit)
    emit_fn("phase", **fields)


def data_progress(emit_fn):
    """The callback engine/data/__init__.py's loaders report a long file's progress to: `data_check`
    with the MiB read of the file's MiB."""

    def report(rows: int, read: int, total: int) -> None:
        if total:
            emit(emit_fn, "data_check", read >> 20, max(1, total >> 20), "MiB")

    return report


def describe(ev: dict) -> str:
    """'initial eval 12/30 prompts' from a `phase` event."""
    text = LABELS.get(ev.get("phase"), str(ev.get("phase")))
    if ev.get("total"):
        text += f" {ev.get('done', 0)}/{ev['total']}" + (f" {ev['unit']}" if ev.get("unit") else "")
    return text


def counter(emit_fn, phase: str, total: int, unit: str, should_stop=lambda: False):
    """A callback for a batched loop: `tick(done)` reports progress and returns True when
    the run was asked to stop (the loop then ends between batches)."""
    emit(emit_fn, phase, 0, total, unit)

    def tick(done: int) -> bool:
        emit(emit_fn, phase, min(done, total), total, unit)
        return should_stop()

    return tick


def resume_words(name: str, last_checkpoint) -> str:
    """What a resume will really do, from the run's last checkpoint ((step, path) or None)."""
    if last_checkpoint:
        return f"Resumed {name} from its step-{last_checkpoint[0]} checkpoint."
    return (f"Resumed {name}: it has no checkpoint, so training starts again from step 0 "
            "(an ESSA run keeps a finished warm start).")
