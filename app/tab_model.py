"""1 · Model: the model settings and the memory estimate of the whole form."""

from __future__ import annotations

import gradio as gr

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import api

from . import panels


def estimate_text(cfg) -> str:
    """The planner's estimate of `cfg` as the panel shows it. The planner reads config.json
    and asks nvidia-smi: no torch, so it runs in the app's process."""
    try:
        est = api.estimate(cfg)
        return panels.estimate_markdown({"ok": True, "estimate": est}) + longest_text(
            api.longest_sequence(cfg, est.get("gpu_total")))
    except ImportError:
        return panels.estimate_markdown({"ok": False, "error": "the memory planner is not installed"})
    except EdgetuneError as e:
        return panels.estimate_markdown({"ok": False, "error": str(e)})


def longest_text(rows: list[dict]) -> str:
    """The longest data.max_seq_len per memory (api.longest_sequence), as set and with every
    long-sequence lever the settings do not use yet; "" when there are none."""
    if not rows:
        return ""
    lines = ["", "", "**Longest `data.max_seq_len` that fits** (the planner's prediction):"]
    for r in rows:
        levers = list(r["levers"].items())
        more = f"; with {levers[-1][0]}: {levers[-1][1]:,}" if levers else ""
        lines.append(f"- {r['memory_gib']:g} GiB: {r['as_set']:,} tokens as set{more}")
    return "\n".join(lines)


def decided_text(cfg) -> str:
    """What a Start with `cfg` would decide for its `auto` settings (engine/planning/effective.py,
    as the planner asks it), one line; the run records the same in its config.yaml."""
    try:
        est = api.estimate(cfg)
    except (ImportError, EdgetuneError) as e:
        return f"_What Start would decide is not known yet: {e}_"
    eff = est.get("effective")
    return panels.effective_markdown(eff, "Start would use", (est.get("model") or {}).get("layers"),
                                     cfg.method) if eff else ""


def time_text(cfg, report: dict | None) -> str:
    """The run's time on this machine, phase by phase, before Start (api.time_estimate):
    from the Data tab's report of this very data when it was checked there, else rows of
    data.max_seq_len tokens (an upper bound, said so). The machine's matmul rate is timed
    once, in a process of its own (this one never loads torch)."""
    from edgetune.engine.planning import timing

    try:
        est = api.time_estimate(cfg, report if report is not None else {})
    except (EdgetuneError, OSError) as e:
        return f"_The run's time is not known yet: {e}_"
    line = timing.words(est)
    hint = "" if report is not None else " Check the data on the Data tab to count its own rows."
    return f"**{line[0].upper()}{line[1:]}.**{hint}"


class ModelTab:
    def __init__(self, page):
        self.page = page
        gr.Markdown("The embedded default is SmolLM2-135M-Instruct (works offline). Or give a local "
                    "Hugging Face folder, a hub id, or a `.gguf` file.")
        page.group_fields("model", basic_cols=2)
        self.estimate_btn = gr.Button("Estimate memory", elem_id="estimate-btn")
        self.estimate = gr.Markdown("_Press “Estimate memory” for the predicted peak of these settings "
                                    "(weights, LoRA, optimizer, activations, rollout KV cache)._",
                                    elem_id="estimate")

    def do_estimate(self, values: dict) -> dict:
        try:
            cfg = self.page.config(values)
        except EdgetuneError as e:
            return {self.estimate: f"**Settings problem:** {e}"}
        return {self.estimate: estimate_text(cfg)}

    def wire(self) -> None:
        self.estimate_btn.click(self.do_estimate, self.page.form_inputs, [self.estimate])
