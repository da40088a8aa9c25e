"""Following a run from the terminal: a progress bar that shows the phase, the events
worth a line, and Ctrl-C as a graceful stop, then a kill."""

from __future__ import annotations

import signal
import sys

from tqdm import tqdm

from edgetune.engine.core import phases
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.metric_words import metrics_text
from edgetune.engine.core.units import duration, size

from edgetune.engine.cli.tables import one_line


def _step_total(ev: dict) -> int | None:
    """Steps (ESSA: generations) of a run, from its `started` event's config."""
    method = RECORDS.get(ev.get("method") or "")
    return method.total(ev.get("config") or {}) if method else None


def resumed_line(run, ev: dict) -> str:
    """What a resume did, from its `started` event: the checkpoint the worker really
    continued from (it skips a damaged newest one), or that it starts over."""
    step = ev.get("resumed_from")
    return phases.resume_words(run.name, (step, None) if step is not None else None)


def samples_text(ev: dict) -> str:
    """A `samples` event as a few lines: prompt (its end), the model's greedy completion
    and the reference answer."""
    lines = [f"samples at step {ev.get('step')} (prompt → model | reference):"]
    for x in ev.get("samples") or []:
        lines.append(f"  {one_line(x.get('prompt', ''), 60, tail=True)} → {one_line(x.get('completion', ''), 80)!r}"
                     f" | {one_line(x.get('reference', ''), 80)!r}")
    return "\n".join(lines)


def more_steps_text(ev: dict) -> str:
    return (f"more steps: {ev.get('setting')} {ev.get('from')} → {ev.get('to')}; the learning rate keeps the "
            f"schedule of {ev.get('schedule')} steps, then stays at its final value")


def watch(run, start: int = 0, quiet: bool = False, resuming: bool = False) -> int:
    """Follow a run's events from index `start` with a progress bar that shows the phase
    at once. Ctrl-C (or SIGTERM, a plain `kill`) asks for a graceful stop and keeps
    following this attempt to its end; a second one kills the worker and returns (the
    worker runs in its own session, so it would otherwise train on without its parent).
    `resuming`: the first line says from which checkpoint the worker continues."""

    def interrupt(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        return _watch(run, start, quiet, resuming)
    finally:
        signal.signal(signal.SIGTERM, before)


def _watch(run, start: int, quiet: bool, resuming: bool) -> int:
    # Elapsed and ETA come from the worker's events: tqdm's own rate would count the
    # replayed or resumed steps as if done in the first instant.
    bar = tqdm(total=None, disable=quiet, unit="step", dynamic_ncols=True, desc="starting the worker",
               bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}|{postfix}")
    seen = {"i": start, "status": 1, "step": 0}

    def show_phase(text: str) -> None:
        bar.set_description_str(text, refresh=True)

    def on_event(ev: dict) -> None:
        t = ev["type"]
        if t == "started":
            seen["t0"] = ev.get("time")  # elapsed: this attempt's wall time, as the page shows it
            bar.total = _step_total(ev)
            if resuming:
                tqdm.write(resumed_line(run, ev))
            if not quiet:
                threads = ev.get("cpu_threads") if ev.get("device") == "cpu" else None
                tqdm.write(f"run {run.name}: {ev['method']} on {ev['device']}"
                           + (f" ({threads} CPU thread{'s' if threads != 1 else ''})" if threads else "")
                           + (f", resumed from step {ev['resumed_from']}" if ev.get("resumed_from") and not resuming
                              else ""))
        elif t == "phase":
            if seen.get("post") and seen.get("t0") and ev.get("time"):  # the clock runs on through the evaluations
                bar.set_postfix({**seen["post"], "elapsed": duration(ev["time"] - seen["t0"])}, refresh=False)
            show_phase(phases.describe(ev) if ev["phase"] != "training" or seen["step"] else "training · first step")
        elif t == "data" and not quiet:
            r = ev["report"]
            dropped = "; ".join(f"dropped {n}: {why}" for why, n in (r.get("dropped") or {}).items())
            tqdm.write(f"data: {r.get('rows_kept')}/{r.get('rows_total')} rows kept ({r.get('format')})"
                       + (f"; {dropped}" if dropped else "")
                       + (f"; truncated {r['truncated']} to max_seq_len" if r.get("truncated") else ""))
        elif t == "step":
            seen["step"] = ev["step"]
            bar.total = ev.get("total") or bar.total
            bar.n = ev["step"]
            post = {k: f"{ev[k]:.4g}" for k in ("loss", "reward_mean", "success_rate", "best", "mean")
                    if isinstance(ev.get(k), (int, float))}
            if ev.get("gpu", {}).get("total"):
                post["gpu"] = size(ev["gpu"]["peak"] or 0)
            post["elapsed"] = duration(ev["time"] - seen["t0"] if seen.get("t0") and ev.get("time") else None)
            post["eta"] = duration(ev.get("eta"))
            seen["post"] = post
            bar.set_postfix(post, refresh=False)
            bar.set_description_str("training", refresh=False)
            bar.refresh()
        elif t == "eval" and not quiet:
            tqdm.write("eval: " + metrics_text({k: v for k, v in ev.items() if k not in ("i", "time", "type")}))
        elif t == "comparison" and not quiet:
            tqdm.write(f"held-out {ev.get('metric')}: {ev.get('words')}")
        elif t == "warm_start":
            inner = ev.get("event")
            if inner == "phase":
                show_phase(f"warm start (SFT) · {phases.describe(ev)}")
            elif inner == "step":
                show_phase(f"warm start (SFT) · step {ev.get('step')}/{ev.get('total')}")
                if not quiet and (ev.get("step") == ev.get("total") or ev.get("step") == 1):
                    tqdm.write(f"warm start (SFT) step {ev.get('step')}/{ev.get('total')}: "
                               f"loss {ev.get('loss', 0):.4g}")
            elif inner == "eval" and not quiet:
                tqdm.write(f"warm start (SFT) eval loss {ev.get('eval_loss', 0):.4g}")
            elif inner == "finished" and not quiet:
                tqdm.write("warm start (SFT) finished")
        elif t == "warning" and not quiet:
            tqdm.write(f"warning: {ev['message']}")
        elif t == "sample" and not quiet:
            tqdm.write(f"sample (step {ev.get('step')}): {ev.get('completion', '')[:200]!r}")
        elif t == "samples" and not quiet:
            tqdm.write(samples_text(ev))
        elif t == "more_steps" and not quiet:
            tqdm.write(more_steps_text(ev))
        elif t == "error":
            tqdm.write(f"error: {ev['message']}", file=sys.stderr)
            seen["status"] = 2 if ev.get("kind") == "input" else 1
        elif t in ("finished", "stopped"):
            bar.close()
            where = f"adapter in {ev['adapter']}" if ev.get("adapter") else "no adapter yet"
            tqdm.write(f"{t}: {where}; {metrics_text(ev.get('metrics', {}))}")
            seen["status"] = 0

    def kill() -> int:
        bar.close()
        ended = run.status()
        if ended in ("finished", "stopped", "failed"):  # it ended as the Ctrl-C came: nothing to kill
            print(f"\nthe run had {ended} already; nothing was killed", file=sys.stderr)
            return seen["status"]
        print("\nkilling the worker...", file=sys.stderr)
        run.kill()
        last = run.dir.last_checkpoint()
        print(f"killed; `edgetune resume {run.name}` continues from its step-{last[0]} checkpoint"
              if last else "killed before any checkpoint: a resume starts over from step 0", file=sys.stderr)
        return 130

    stopping = False
    try:
        while True:
            try:
                for ev in run.events(seen["i"], follow_live=True):
                    seen["i"] = ev["i"] + 1
                    on_event(ev)
                break
            except KeyboardInterrupt:
                if stopping:
                    return kill()
                stopping = True
                try:
                    tqdm.write("stopping after the current step or evaluation batch (Ctrl-C again to kill)...",
                               file=sys.stderr)
                    run.stop()
                    show_phase("stopping")
                except KeyboardInterrupt:  # the second Ctrl-C came while the first was being handled
                    return kill()
    finally:
        bar.close()
    try:
        run.wait(30)  # the worker writes its last event a moment before it exits: return when it is gone
    except KeyboardInterrupt:  # a Ctrl-C while the worker winds down still means "kill it now"
        return kill()
    if run.status() == "crashed":
        print(f"error: {run.death()}", file=sys.stderr)
        return 1
    return seen["status"]
