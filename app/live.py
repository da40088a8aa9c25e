"""What the Train panel shows, computed from a run's events and its memory.json.

Plain functions of data on disk, no Gradio: the page calls them on every timer tick, a
reloaded page calls them once on the whole events.jsonl, and the tests call them on
hand-written events.
"""

from __future__ import annotations

import html
import time

import pandas as pd

from edgetune.engine.core import phases
from edgetune.engine.core.units import duration

from .methods import BY_KEY, Method, Plot

GiB = 2**30


def _event_key(ev: dict) -> str:
    return f"warm_start:{ev.get('event')}" if ev["type"] == "warm_start" else ev["type"]


def plot_frame(events: list[dict], plot: Plot) -> pd.DataFrame:
    """Long-form data for one plot: columns step, value, series."""
    rows = []
    for ev in events:
        key = _event_key(ev)
        for s in plot.series:
            if s.event == key and isinstance(ev.get(s.key), (int, float)) and ev.get("step") is not None:
                rows.append({"step": int(ev["step"]), "value": float(ev[s.key]), "series": s.label})
    # by step: an evaluation may be reported after later steps (F-GRPO's base, step 0, at the end)
    return pd.DataFrame(rows, columns=["step", "value", "series"]).sort_values("step", kind="stable",
                                                                            ignore_index=True)


def plot_frames(events: list[dict], method: Method) -> list[pd.DataFrame]:
    return [plot_frame(events, p) for p in method.plots]


def plot_figure(frame: pd.DataFrame, plot: Plot, stepped: bool = False):
    """A small matplotlib figure: one line with markers per series (a lone eval point
    still shows). Figure objects, not pyplot: handlers run in several threads. `stepped`:
    the run has reported steps (an empty plot then says why, not "no data yet")."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(7, 3.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    for s, style in zip(plot.series, ("-", "--", ":")):  # equal values stay visible as two lines
        part = frame[frame["series"] == s.label]
        if len(part):
            ax.plot(part["step"], part["value"], style, marker="o", markersize=3.5, linewidth=1.6, label=s.label)
    ax.set_title(plot.title, fontsize=11)
    ax.set_xlabel(plot.x_title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps and generations are whole numbers
    ax.set_ylabel(plot.y_title)
    ax.grid(alpha=0.3)
    if len(frame):
        ax.legend(fontsize=8, loc="best")
    else:
        ax.text(0.5, 0.5, plot.none_after_steps if stepped else "no data yet", ha="center", va="center",
                transform=ax.transAxes, color="gray")
    return fig


def compare_figure(runs: list[tuple[str, list[dict]]], label: str):
    """One of the methods' series (COMPARABLE's `label`) for several runs, a line each,
    against their step: the Runs tab's comparison. A run without that series is named in
    the legend as having none."""
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    from .methods import COMPARABLE

    series, plot = COMPARABLE[label]
    one = Plot(plot.title, plot.y_title, (series,), plot.x_title)
    fig = Figure(figsize=(8, 3.4), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    drawn, curves = 0, {}
    styles = [("-", "o"), ("--", "s"), (":", "^"), ("-.", "D")]
    for k, (name, events) in enumerate(runs):
        frame = plot_frame(events, one)
        if len(frame):
            # a line style and marker a run, so that equal curves drawn on top of each other
            # stay visible as two; the legend names the run whose curve this one repeats
            key = (tuple(frame["step"]), tuple(frame["value"]))
            same = curves.setdefault(key, name)
            line, mark = styles[k % len(styles)]
            ax.plot(frame["step"], frame["value"], line, marker=mark, markersize=3 + 1.5 * (k % 3), linewidth=1.5,
                    fillstyle="none" if k % 2 else "full",
                    label=name if same == name else f"{name} (the same curve as {same})")
            drawn += 1
        else:
            ax.plot([], [], " ", label=f"{name}: no {label}")
    ax.set_title(f"{label}, {len(runs)} run{'s' if len(runs) != 1 else ''}", fontsize=11)
    ax.set_xlabel(plot.x_title)
    ax.set_ylabel(plot.y_title)
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.grid(alpha=0.3)
    if runs:
        ax.legend(fontsize=8, loc="best")
    if not drawn:
        ax.text(0.5, 0.5, "pick runs that have this curve", ha="center", va="center", transform=ax.transAxes,
                color="gray")
    return fig


def _elapsed(events: list[dict], started: dict | None, now: float | None) -> float | None:
    """Wall time of this attempt: from its `started` event to its end, or to `now` while it
    has none (a live clock: it moves during set-up and evaluations too, between steps)."""
    if started is None:
        return None
    end = next((e for e in reversed(events) if e["type"] in ("finished", "stopped", "error")
                and e["i"] > started["i"]), None)
    if end is None and now is None:  # a run that ended without a word: its last event
        end = events[-1]
    stop = end["time"] if end is not None else now
    return max(0.0, stop - started["time"]) if isinstance(started.get("time"), (int, float)) else None


def progress(events: list[dict], now: float | None = None) -> dict:
    """Where a run stands: step, total, elapsed (this attempt's wall time, live with `now`),
    eta (from the training steps' pace, set-up excluded), phase text, last headline values."""
    started = next((e for e in reversed(events) if e["type"] == "started"), None)
    method = BY_KEY.get((started or {}).get("method", ""), None)
    last_step = next((e for e in reversed(events) if e["type"] == "step"), None)
    total = (last_step or {}).get("total")
    if total is None and started and method:
        total = method.total(started.get("config", {}))
    out = {"step": (last_step or {}).get("step", 0), "total": total, "elapsed": _elapsed(events, started, now),
           "eta": (last_step or {}).get("eta"), "phase": "", "values": {},
           "unit": method.unit if method else "step"}
    if last_step and method:
        out["values"] = {k: last_step[k] for k in method.headline if isinstance(last_step.get(k), (int, float))}
    out["phase_done"] = out["phase_total"] = None
    if not events:
        out["phase"] = "starting the worker"
    elif events[-1]["type"] in ("finished", "stopped", "error"):
        last = events[-1]
        out["phase"] = ("adapter saved" if last.get("adapter") else "stopped before an adapter existed") \
            if last["type"] != "error" else last.get("message", "")
    else:
        _phase_of(events, started, out)
    return out


def _phase_of(events: list[dict], started: dict | None, out: dict) -> None:
    """The current phase line from this attempt's `phase` events (ESSA's warm start
    forwards its SFT's own phases and steps as `warm_start` events)."""
    since = started["i"] if started else -1
    mine = [e for e in events if e["i"] > since and e["type"] == "phase"]
    if not mine:  # a run from before phase events, or a worker still importing
        has_step = any(e["type"] == "step" and e["i"] > since for e in events)
        out["phase"] = "training" if has_step else "starting" if started else "starting the worker"
        return
    cur = mine[-1]
    if cur["phase"] == "warm_start":
        inner = [e for e in events if e["i"] > cur["i"] and e["type"] == "warm_start"]
        inner_phase = next((e for e in reversed(inner) if e.get("event") == "phase"), None)
        text = phases.LABELS["warm_start"]
        if inner_phase is not None and inner_phase["phase"] == "training":
            ws = [e for e in inner if e.get("event") == "step" and e["i"] > inner_phase["i"]]
            text += f" · step {ws[-1]['step']}/{ws[-1].get('total')}" if ws else " · training"
            if ws and ws[-1].get("total"):
                out["phase_done"], out["phase_total"] = ws[-1]["step"], ws[-1]["total"]
        elif inner_phase is not None:
            text += " · " + phases.describe(inner_phase)
            if inner_phase.get("total"):
                out["phase_done"], out["phase_total"] = inner_phase.get("done", 0), inner_phase["total"]
        out["phase"] = text
        return
    out["phase"] = phases.describe(cur)
    if cur["phase"] != "training" and cur.get("total"):
        out["phase_done"], out["phase_total"] = cur.get("done", 0), cur["total"]
    if cur["phase"] == "training" and out["step"] == 0:
        out["phase"] = "training · first step"



def progress_html(events: list[dict], status: str, death: str = "", now: float | None = None) -> str:
    """The progress bar and its lines; `death`: why a crashed run's worker ended (api.Run.death);
    `now`: the clock of a run still active (its elapsed time moves on every tick)."""
    p = progress(events, now if status in ("running", "starting") else None)
    if status == "crashed":
        p["phase"] = f"{death or 'the worker ended without a final event (see worker.log in the run folder)'}; " \
                     "Resume continues"
    if status == "none":
        p["phase"] = "no run yet: pick a preset on the Method tab, then Start here"
    total = p["total"] or 0
    frac = min(1.0, p["step"] / total) if total else 0.0
    phase_key = ""
    if p.get("phase_total") and status in ("running", "starting"):
        # a long phase before (or after) the steps: its own progress on the bar
        frac = min(1.0, p["phase_done"] / p["phase_total"])
        phase_key = "phase"
    values = " · ".join(f"{k} {v:.4g}" for k, v in p["values"].items())
    text = (f"{p['unit']} {p['step']} / {total or '?'} · {duration(p['elapsed'])} elapsed · "
            f"ETA {duration(p['eta']) if status in ('running', 'starting') else '–'}")
    return (
        f'<div class="et-progress" data-step="{p["step"]}" data-total="{total}" data-status="{status}" '
        f'data-phase="{html.escape(p["phase"])}" data-bar="{phase_key or "steps"}">'
        f'<div class="et-progress-head"><b>{html.escape(status)}</b> · {html.escape(p["phase"])}'
        f'<span class="et-progress-values">{html.escape(values)}</span></div>'
        f'<div class="et-bar"><div class="et-bar-fill et-{status}" style="width:{frac * 100:.1f}%"></div></div>'
        f'<div class="et-progress-text">{html.escape(text)}</div></div>'
    )


def _fmt_event(ev: dict) -> str:
    t = time.strftime("%H:%M:%S", time.localtime(ev.get("time", 0)))
    kind = ev["type"]
    if kind == "warm_start":
        inner = {k: v for k, v in ev.items() if k not in ("event",)}
        inner["type"] = ev.get("event", "?")
        return f"{t} warm-start {_fmt_event(inner)[9:]}"
    skip = {"i", "time", "type", "config", "gpu", "report", "host_rss", "total"}
    if kind == "data":
        r = ev.get("report", {})
        return (f"{t} data: {r.get('rows_kept')}/{r.get('rows_total')} rows kept ({r.get('format')}), "
                f"{r.get('train_rows')} train, {r.get('eval_rows')} eval")
    if kind == "started":
        resumed = f", resumed from its step-{ev['resumed_from']} checkpoint" if ev.get("resumed_from") else ""
        threads = ev.get("cpu_threads")
        on = f"{ev.get('device')}" + (f" ({threads} CPU thread{'s' if threads != 1 else ''})"
                                      if ev.get("device") == "cpu" and threads else "")
        return f"{t} started {ev.get('method')} on {on}{resumed}"
    if kind == "phase":
        return f"{t} phase: {phases.describe(ev)}"
    if kind in ("warning", "error"):
        return f"{t} {kind}: {ev.get('message')}"
    if kind == "samples":  # the table beside the plots shows them
        return f"{t} samples at step {ev.get('step')}: {len(ev.get('samples') or [])} held-out completions"
    if kind == "comparison":  # the run's adapter against the base, in words
        return f"{t} held-out {ev.get('metric')}: {ev.get('words')}"
    if kind == "more_steps":
        return (f"{t} more steps: {ev.get('setting')} {ev.get('from')} → {ev.get('to')} (learning rate flat past "
                f"step {ev.get('schedule')})")
    if kind in ("finished", "stopped"):
        m = ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in ev.get("metrics", {}).items())
        return f"{t} {kind} at step {ev.get('step')}: {m}"
    if kind == "step":  # elapsed and ETA are on the progress bar
        skip |= {"step", "elapsed", "eta"}
        head = f"{t} step {ev.get('step')}/{ev.get('total', '?')}"
    else:
        head = f"{t} {kind}"
    parts = [f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
             for k, v in ev.items() if k not in skip and v is not None]
    return f"{head}: " + ", ".join(parts)


def _is_phase(ev: dict) -> bool:
    return ev["type"] == "phase" or (ev["type"] == "warm_start" and ev.get("event") == "phase")


def log_lines(events: list[dict], n: int = 40) -> str:
    """The newest `n` events, newest first, so the latest is in view without scrolling. A
    phase's progress events collapse into its latest one; ESSA's per-candidate events are
    left out."""
    shown = []
    for e in events:
        if e["type"] == "candidate":
            continue
        if _is_phase(e) and shown and _is_phase(shown[-1]) and shown[-1].get("phase") == e.get("phase"):
            shown[-1] = e
        else:
            shown.append(e)
    return "\n".join(_fmt_event(e) for e in reversed(shown[-n:]))


def samples_markdown(events: list[dict], n: int = 4) -> str:
    samples = [e for e in events if e["type"] == "sample"][-n:]
    if not samples:
        return "_No sample completions yet (F-GRPO writes one every `sample_every` steps)._"
    out = []
    for e in reversed(samples):
        reward = f" · reward {e['reward']:.3g}" if isinstance(e.get("reward"), (int, float)) else ""
        answer = f" · answer `{e['answer']}`" if e.get("answer") else ""
        out.append(f"**step {e.get('step')}**{reward}{answer}\n\n> {html.escape(str(e.get('prompt', '')))[:300]}\n\n"
                   f"```\n{str(e.get('completion', ''))[:600]}\n```")
    return "\n\n".join(out)


def _cell(text, n: int, tail: bool = False) -> str:
    """Text for one markdown table cell: escaped, lines joined, at most `n` characters
    (its end when `tail`: a prompt's end is its question)."""
    text = " ".join(str(text).split())
    if len(text) > n:
        text = "…" + text[-(n - 1):] if tail else text[: n - 1] + "…"
    return html.escape(text).replace("|", "\\|") or "–"


def eval_samples_markdown(events: list[dict]) -> str:
    """The latest `samples` event as a table: held-out prompt, the model's greedy
    completion, the reference answer. "" before the first evaluation."""
    ev = next((e for e in reversed(events) if e["type"] == "samples"), None)
    if ev is None or not ev.get("samples"):
        return ""
    rows = [f"| {_cell(x.get('prompt', ''), 200, tail=True)} | {_cell(x.get('completion', ''), 300)} | "
            f"{_cell(x.get('reference', ''), 300)} |" for x in ev["samples"]]
    return (f"**Held-out samples at step {ev.get('step')}** (greedy)\n\n| prompt | model | reference |\n"
            "|---|---|---|\n" + "\n".join(rows))


def _bar(label: str, used: float, total: float, extra: str = "") -> str:
    frac = min(1.0, used / total) if total else 0.0
    return (f'<div class="et-mem-row"><span class="et-mem-label">{label}</span>'
            f'<div class="et-bar"><div class="et-bar-fill" style="width:{frac * 100:.1f}%"></div></div>'
            f'<span class="et-mem-num">{used / GiB:.2f} / {total / GiB:.1f} GiB{extra}</span></div>')


def memory_html(mem: dict | None, host_total: int, alive: bool, now: float | None = None) -> str:
    """GPU allocated / reserved / peak against the card's total, and the worker's RSS
    against the machine's RAM; `mem` is the run's memory.json (None before the first)."""
    if not mem:
        return ('<div class="et-memory" data-time="0"><div class="et-mem-note">No memory readings yet: '
                'they start when a run\'s worker starts.</div></div>')
    now = now or time.time()
    age = now - mem.get("time", now)
    gpu = mem.get("gpu", {})
    rows = []
    if gpu.get("total"):
        rows.append(_bar("GPU allocated", gpu.get("allocated", 0), gpu["total"]))
        rows.append(_bar("GPU reserved", gpu.get("reserved", 0), gpu["total"]))
        rows.append(_bar("GPU peak", gpu.get("peak", 0), gpu["total"]))
    else:
        rows.append('<div class="et-mem-note">No CUDA GPU in the worker: training on the CPU.</div>')
    rows.append(_bar("Host RAM (worker)", mem.get("host_rss", 0), host_total))
    stamp = time.strftime("%H:%M:%S", time.localtime(mem.get("time", 0)))
    # no seconds-ago counter: the panel changes only when the worker writes a reading
    state = (f"updated {stamp}" if alive and age < 10
             else f"last reading {stamp}" + ("" if alive else " (worker not running)"))
    return (f'<div class="et-memory" data-time="{mem.get("time", 0)}">{"".join(rows)}'
            f'<div class="et-mem-note">{state}</div></div>')
