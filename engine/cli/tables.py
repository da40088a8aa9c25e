"""The commands' text: one-line cells, the queue's job lines, `edgetune estimate`'s and
`edgetune eval`'s tables."""

from __future__ import annotations

from datetime import datetime

from edgetune.engine.core.methods import METHODS as RECORDS

from edgetune.engine.training.stats import TESTS, p_text


def one_line(text, n: int, tail: bool = False) -> str:
    """`text` on one line, at most `n` characters: its first, or its last with `tail` (a
    prompt's end is its question)."""
    text = " / ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1):] if tail else text[: n - 1] + "…"


def job_line(j: dict, place: int | None = None) -> str:
    """A queued job (with its place) or an ended one, on one line."""
    what = f"{j.get('method') or ''} {j.get('steps') or '?'} steps".strip() if j["kind"] == "train" else j["kind"]
    if place is None:  # an ended job
        when = datetime.fromtimestamp(j["ended"]).strftime("%Y-%m-%d %H:%M")
        return f"  job {j['id']:<4} {j['status']:9s} {j['folder']:32s} {when}" + \
            (f"  {one_line(j['message'], 100)}" if j.get("message") and j["status"] != "finished" else "")
    return f"{place:>3}. job {j['id']:<4} {j.get('state', 'queued'):9s} {j['folder']:32s} {what}"


def decided_rows(est: dict) -> list[tuple[str, str]]:
    """What the run will do for every `auto` setting (engine/planning/effective.py), in words."""
    eff = est.get("effective") or {}
    if not eff:
        return []
    on = {True: "on", False: "off"}
    layers = (est.get("model") or {}).get("layers")
    ck = eff.get("checkpointed_layers")
    checkpointing = (f"all {layers} decoder layers" if ck is None or ck == layers else
                     "off" if ck == 0 else f"the first {ck} of {layers} decoder layers")
    rows = [("device", eff["device"]),
            ("dtype", eff["dtype"] + (" (autocast)" if eff["autocast"] else "")),
            ("attention", eff["attn_implementation"]),
            ("gradient checkpointing", checkpointing)]
    if not RECORDS[est["method"]].gradients:
        rows.append(("candidates per batch", str(eff["candidates_per_batch"])))
    else:
        rows += [("optimizer", eff["optimizer"] + (" (fused)" if eff["fused_optimizer"] else "")),
                 ("sebp", on[eff["sebp"]]), ("liger", on[eff["liger"]])]
        if RECORDS[est["method"]].packing:
            rows.append(("packing", on[eff["packing"]]))
    rows.append(("loss chunk", f"{eff['loss_chunk_rows']} rows"))
    return rows


def estimate_table(est: dict) -> str:
    """The planner's parts in GiB, as the page shows them, then the decided settings."""
    rows = [(k.replace("_", " "), est.get(k) or 0) for k in est.get("parts", [])] + [("total", est.get("total") or 0)]
    width = max(len(k) for k, _ in rows)
    lines = [est.get("verdict", ""), ""]
    if est.get("shape"):
        lines[1:1] = [f"peak step shape: {est['shape']}"]
    lines.append(f"{'part':{width}s}  {'GiB':>7s}")
    lines += [f"{k:{width}s}  {v / 2**30:7.2f}" for k, v in rows]
    if not est.get("gpu_total"):
        lines.append("(no GPU visible here: the parts are those of a CUDA card; a CPU run computes in fp32 "
                     "without a CUDA context, so its memory differs)")
    decided = decided_rows(est)
    if decided:
        w = max(len(k) for k, _ in decided)
        lines += ["", "decided (every auto setting, as the run will do it):"]
        lines += [f"  {k:{w}s}  {v}" for k, v in decided]
    lines += [f"note: {n}" for n in est.get("notes") or []]
    return "\n".join(lines)


def _score(x: dict, proportion: bool) -> str:
    """A score and its 95% interval: shares in percent, other means as they are."""
    if not proportion:
        return f"{x['estimate']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"
    return f"{100 * x['estimate']:5.1f}% [{100 * x['low']:.1f}, {100 * x['high']:.1f}]"


def _task_head(t: dict) -> str:
    what = {"generative": f"graded by {t.get('reward_fn')}", "loss": "mean token loss (lower is better)",
            "harness": "lm-evaluation-harness"}
    return (f"{t['task']}: {t['prompts']} {t.get('unit', 'prompts')}, {what.get(t['kind'], t['kind'])}; "
            f"each score with its 95% interval")


def eval_table(result: dict) -> str:
    """`edgetune eval`'s tables, one a task: each system's scores with their 95% intervals,
    then each pair compared on the same items, in numbers and in words."""
    lines = []
    for t in result["tasks"]:
        systems = t["systems"]
        metrics = t.get("metrics") or list(dict.fromkeys(m for s in systems for m in s["scores"]))
        shares = set(t.get("shares", ()))
        cells = [[_score(s["scores"][m], m in shares) if m in s["scores"] else "–" for m in metrics]
                 for s in systems]
        names = [s["name"] for s in systems]
        nw = max(len(n) for n in names + ["system"])
        widths = [max(len(m), *(len(c[j]) for c in cells)) for j, m in enumerate(metrics)]
        lines += ([""] if lines else []) + [_task_head(t), "",
                                            f"{'system':{nw}s}  " + "  ".join(f"{m:{w}s}" for m, w in zip(metrics, widths))]
        lines += [f"{n:{nw}s}  " + "  ".join(f"{c:{w}s}" for c, w in zip(row, widths)) for n, row in zip(names, cells)]
        for s in systems:
            if s.get("adapter"):
                lines.append(f"  {s['name']}: {s['adapter']}")
        if t["comparisons"]:
            lines += ["", f"paired on the same {t.get('unit', 'prompts')}:"]
            for c in t["comparisons"]:
                unit = (lambda x: f"{100 * x:+.1f} pts") if c["kind"] == "proportion" else (lambda x: f"{x:+.3f}")
                lines.append(f"  {c['b']} vs {c['a']}, {c['metric']}: {unit(c['difference'])} "
                             f"[{unit(c['low'])}, {unit(c['high'])}], {p_text(c['p_value'])} ({TESTS[c['kind']]})")
                lines.append(f"    {c['words']}")
    return "\n".join(ln.rstrip() for ln in lines)
