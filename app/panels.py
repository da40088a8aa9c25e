"""Text and tables for the Data, Model (memory estimate) and Runs panels, from what the
engine returns. Plain functions, no Gradio, so tests can call them directly."""

from __future__ import annotations

import html

import pandas as pd

from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.metric_words import metrics_text
from edgetune.engine.core.units import size

GiB = 2**30


# --------------------------------------------------------------------------- data


def data_report_markdown(result: dict) -> str:
    """The validation report, or the problem with the file and every bad row by number."""
    if not result.get("ok"):
        lines = [f"### ✗ This data cannot be used yet\n\n**{result.get('error', 'unknown problem')}**"]
        bad = result.get("bad_rows") or []
        if bad:
            lines.append("\n| row | problem |\n|---:|---|")
            lines += [f"| {b['row']} | {b['problem'].replace('|', '/')} |" for b in bad]
            if len(bad) >= 20:
                lines.append("\n_(the first 20 bad rows)_")
        return "\n".join(lines)
    r = result["report"]
    unit = "chunks" if r.get("documents") else "rows"
    lines = [f"### ✓ {r['rows_kept']} of {r['rows_total']} {unit} kept · format **{r['format']}**",
             f"{r['train_rows']} train, {r['eval_rows']} eval"
             + (f" (eval from `{r['eval_file']}`)" if r.get("eval_file") else
                "" if not r["eval_rows"] else " (held out from this file)")]
    for reason, n in (r.get("dropped") or {}).items():
        lines.append(f"- dropped {n}: {reason}")
    if r.get("truncated"):
        lines.append(f"- truncated {r['truncated']} (cut to max_seq_len)")
    t = r.get("token_lengths") or {}
    if t:
        lines.append(f"- length in {r.get('length_unit', 'tokens')}: min {t['min']}, mean {t['mean']:.1f}, "
                     f"p50 {t['p50']}, p95 {t['p95']}, max {t['max']}")
    if r.get("documents"):
        lines.append(documents_markdown(r["documents"]))
    lines += [f"- {note}" for note in r.get("notes") or []]
    return "\n".join(lines)


def documents_markdown(entries: list[dict]) -> str:
    """Each file of a documents folder: what was read of it, or why nothing was."""
    lines = ["\n| file | pages | characters | chunks | tokens | split, or why not read |", "|---|---:|---:|---:|---:|---|"]
    for e in entries:
        extra = [f"{n} dropped: {why}" for why, n in (e.get("dropped") or {}).items()] + list(e.get("notes") or [])
        what = f"**{e['problem']}**" if e["problem"] else e["split"]
        what += f" ({'; '.join(extra)})" if extra else ""
        cells = [html.escape(e["file"]), str(e["pages"] or "–"), f"{e['chars']:,}", str(e["chunks"]),
                 f"{e['tokens']:,}", html.escape(what)]
        lines.append("| " + " | ".join(c.replace("|", "/") for c in cells) + " |")
    return "\n".join(lines)


def histogram_figure(result: dict):
    """The token-length histogram with its real bin edges (matplotlib Figure, no pyplot)."""
    from matplotlib.figure import Figure

    h = ((result.get("report") or {}).get("histogram")) or {}
    edges, counts = h.get("edges") or [], h.get("counts") or []
    fig = Figure(figsize=(5, 3.0), dpi=100, layout="constrained")
    ax = fig.add_subplot()
    if counts:
        ax.stairs(counts, edges, fill=True, alpha=0.8)
    else:
        ax.text(0.5, 0.5, "no data checked yet", ha="center", va="center", transform=ax.transAxes, color="gray")
    unit = (result.get("report") or {}).get("length_unit", "tokens")
    ax.set_title(f"Row length ({unit})", fontsize=11)
    ax.set_xlabel(unit)
    ax.set_ylabel("rows")
    ax.grid(alpha=0.3)
    return fig


def preview_frame(result: dict) -> pd.DataFrame:
    rows = result.get("preview") or []
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    df.insert(0, "row", range(1, len(df) + 1))
    return df


# --------------------------------------------------------------------------- memory estimate


def estimate_markdown(result: dict) -> str:
    """engine/planning/planner.py's estimate: the verdict ("fits" / "does not fit — try ..."),
    bytes by part, the batch shape and the GPU's free memory; "estimate unavailable"
    while the planner is missing or fails."""
    if not result.get("ok"):
        return f"**Estimate unavailable.** {html.escape(result.get('error', ''))}"
    est = result["estimate"]
    mark = {True: "✓ ", False: "✗ "}.get(est.get("fits"), "")
    lines = [f"### {mark}{est.get('verdict', '')}"]
    if est.get("gpu_total"):
        lines.append(f"GPU: {size(est.get('gpu_free'))} free of {size(est['gpu_total'])}.")
    else:
        lines.append("No GPU visible here: the verdict needs one; the parts below are for a CUDA card. "
                     "A run on this CPU differs from them: it computes in fp32 rather than bf16, has no "
                     "CUDA context (0.5 GiB) and no CUDA allocator slack, and what it uses is the worker's "
                     "RAM, shown live on the Train tab.")
    if est.get("shape"):
        lines.append(f"Peak step shape: {est['shape']}" + (f" ({est['phase']})" if est.get("phase") else "") + ".")
    lines += ["", "| part | predicted |", "|---|---:|"]
    lines += [f"| {k.replace('_', ' ')} | {size(est.get(k))} |" for k in est.get("parts", [])]
    lines.append(f"| **total** | **{size(est.get('total'))}** |")
    lines += [f"- {note}" for note in est.get("notes") or []]
    if est.get("effective"):
        lines += ["", effective_markdown(est["effective"], layers=(est.get("model") or {}).get("layers"),
                                         method=est.get("method"))]
    return "\n".join(lines)


def effective_markdown(eff: dict, title: str = "Decided for this run", layers: int | None = None,
                       method: str | None = None) -> str:
    """What the run will decide for its `auto` settings (engine/planning/effective.py), one line,
    the settings `method` uses (all when None); `layers`: the model's decoder layers, for
    the gradient checkpointing split."""
    on = {True: "on", False: "off"}
    opt = eff["optimizer"] + (" (fused)" if eff.get("fused_optimizer") else "")
    ck = eff.get("checkpointed_layers")
    if ck == 0:
        checkpointing = "off"
    elif ck is None or ck == layers:
        checkpointing = f"all {layers} layers" if layers else "all layers"
    else:
        checkpointing = f"first {ck} of {layers or '?'} layers"
    parts = [f"device {eff['device']}", f"dtype {eff['dtype']}", f"attention {eff['attn_implementation']}",
             f"gradient checkpointing {checkpointing}"]
    rec = RECORDS.get(method)  # None: every line
    if rec is None or rec.gradients:
        parts += [f"optimizer {opt}", f"SEBP {on[eff['sebp']]}", f"Liger {on[eff['liger']]}"]
    if rec is None or rec.packing:
        parts.append(f"packing {on[eff['packing']]}")
    if rec is None or rec.population:
        parts.append(f"candidates per batch {eff['candidates_per_batch']}")
    return f"**{title}:** " + " · ".join(parts)


# --------------------------------------------------------------------------- runs


RUN_COLUMNS = ["run", "status", "method", "step", "metrics", "held-out, against the base", "created"]


def runs_frame(summaries: list[dict]) -> pd.DataFrame:
    import time

    # A damaged run folder's row names its file and the problem where the metrics would be.
    rows = [{"run": s["name"], "status": s["status"], "method": s.get("method") or "",
             "step": f"{s.get('step', 0)}/{s.get('total') or '?'}",
             "metrics": s.get("message") or "" if s["status"] == "damaged" else metrics_text(s.get("metrics") or {}),
             "held-out, against the base": s.get("helped") or "",
             "created": time.strftime("%Y-%m-%d %H:%M", time.localtime(s["created"])) if s.get("created") else ""}
            for s in summaries]
    return pd.DataFrame(rows, columns=RUN_COLUMNS)


# --------------------------------------------------------------------------- try it


def chat_text(content) -> str:
    """The text of one chat message as the Chatbot hands it back: Gradio 6 gives a list of
    parts ({"type": "text", "text": ...}), older code a plain string."""
    if isinstance(content, str):
        return content
    if isinstance(content, dict):
        return str(content.get("text") or "")
    if isinstance(content, (list, tuple)):
        return "".join(chat_text(part) for part in content)
    return "" if content is None else str(content)


def chat_messages(history) -> list[dict]:
    """A Chatbot's history as plain {"role", "content": str} turns for the chat worker."""
    return [{"role": m["role"], "content": chat_text(m.get("content"))} for m in history or []
            if m.get("role") in ("user", "assistant", "system")]
