"""DPO's settings: preference optimisation on chosen/rejected pairs."""

from __future__ import annotations

from dataclasses import dataclass

from edgetune.engine.core.settings.fields import (
    EVERY,
    ROWS,
    STEPS,
    Range,
    lr_field,
    max_grad_norm_field,
    optimizer_field,
    samples_field,
    sebp_field,
    sebp_kernel_field,
    setting,
    warmup_steps_field,
    weight_decay_field,
)
from edgetune.engine.core.settings.grading import GradingSettings

DPO_REFERENCE_FREE = ("simpo", "orpo")  # the DPO losses that compare with no reference policy


@dataclass
class DPOSettings:
    """Preference tuning on chosen / rejected pairs. See engine/methods/dpo/dpo.py for the loop
    and docs/methods.md for the losses."""

    loss_type: str = setting(
        "sigmoid",
        "sigmoid = DPO; ipo = IPO (squared, length-normalised): both compare with the reference policy, the "
        "base with the adapter off or the adapter lora.init_from starts from; simpo = SimPO and orpo = ORPO, "
        "which need no reference (no second forward a step).",
        section="loss", choices=("sigmoid", "ipo", *DPO_REFERENCE_FREE))
    beta: float = setting(
        0.1,
        "How far from the reference the adapter may move (sigmoid, ipo; larger = closer), SimPO's reward "
        "scale, ORPO's weight of the odds-ratio term beside the chosen reply's NLL.",
        section="loss", range=Range(0, 100, low_open=True, words="must be positive and at most 100"))
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin.", section="loss", range=Range(0, 100))
    lr: float = lr_field(5e-5)
    steps: int = setting(100, "Optimizer steps.", section="optimisation", range=STEPS)
    batch_size: int = setting(4, "Pairs per micro-batch (their chosen and rejected rows share one forward).",
                              section="optimisation", range=ROWS)
    grad_accum: int = setting(1, "Micro-batches per optimizer step.", section="optimisation", range=ROWS)
    warmup_steps: int = warmup_steps_field(5)
    weight_decay: float = weight_decay_field()
    max_grad_norm: float = max_grad_norm_field()
    optimizer: str = optimizer_field()
    eval_every: int = setting(
        25,
        "Held-out preference accuracy and loss every N steps, and before and after training (0 = never).",
        section="evaluation", range=EVERY)
    samples: int = samples_field(" (greedy completions of held-out prompts)")
    sebp: str = sebp_field("")
    sebp_kernel: str = sebp_kernel_field()

    def grading(self) -> GradingSettings:
        """Task files of prompts and answers are graded with GradingSettings' defaults."""
        return GradingSettings()
