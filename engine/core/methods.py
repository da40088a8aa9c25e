"""One record per training method: what the worker, the planner, the CLI, the app and the
export know about a method, in one place. Light on purpose (no torch): the app reads it.

A method's training loop is `train(ctx)` in engine/methods/<name>.py; the worker
(engine/run/worker.py, `method_module`) imports it. Adding a method is a record here, its
settings dataclass in engine/core/settings.py, its module in engine/methods/, and its plots
in app/methods.py.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str  # Config.method, its settings group, engine/methods/<name>.py
    label: str  # its name on screens and in model cards
    title: str  # what the label stands for, in a few words
    description: str  # one line: what it does
    unit: str  # what one step of its progress is: "step" or "generation"
    length: str  # the setting of its group that counts those units
    data: str  # the rows it trains on: "sft" (demonstrations) or "rl" (prompt / gold answer)
    gradients: bool  # trains by back-propagation: optimizer, SEBP, Liger, checkpointing apply
    rollouts: bool  # generates completions while it trains
    # What to lower when a step runs out of GPU memory, in the order worth trying
    # (engine/planning/oom.py says by how much).
    oom_levers: tuple[str, ...]

    def total(self, config: dict) -> int | None:
        """How many units a run lasts, from its config as a dict (the `started` event's)."""
        return (config.get(self.name) or {}).get(self.length)


METHODS = {m.name: m for m in (
    Method("sft", "SFT", "supervised fine-tuning",
           "Supervised fine-tuning on demonstrations (prompt tokens masked).",
           unit="step", length="steps", data="sft", gradients=True, rollouts=False,
           oom_levers=("model.gradient_checkpointing", "sft.batch_size", "data.max_seq_len")),
    Method("fgrpo", "F-GRPO", "focal group-relative RL",
           "RL with verifiable rewards: group-relative advantages with focal group weights.",
           unit="step", length="steps", data="rl", gradients=True, rollouts=True,
           oom_levers=("fgrpo.micro_batch_size", "model.gradient_checkpointing", "fgrpo.max_new_tokens")),
    Method("essa", "ESSA", "evolution strategies over LoRA singular values",
           "CMA-ES over the singular values of a warm-start LoRA (inference-only memory).",
           unit="generation", length="generations", data="rl", gradients=False, rollouts=True,
           oom_levers=("essa.evaluation", "essa.max_new_tokens")),
)}
