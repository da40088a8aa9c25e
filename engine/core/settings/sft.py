"""SFT's settings: supervised fine-tuning on demonstrations."""

from __future__ import annotations

from dataclasses import dataclass

from edgetune.engine.core.settings.fields import (
    AUTO_ON_OFF,
    COUNT,
    EVERY,
    ROWS,
    STEPS,
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


@dataclass
class SFTSettings:
    """Supervised fine-tuning. See engine/methods/sft/sft.py for the loop."""

    lr: float = lr_field(2e-4)
    steps: int = setting(60, "Optimizer steps.", section="optimisation", range=STEPS)
    batch_size: int = setting(4, "Rows per micro-batch.", section="optimisation", range=ROWS)
    grad_accum: int = setting(
        1,
        "Micro-batches per optimizer step: a step trains on batch_size x grad_accum rows, each "
        "label token weighing the same.",
        section="optimisation", range=ROWS)
    warmup_steps: int = warmup_steps_field(5)
    weight_decay: float = weight_decay_field()
    max_grad_norm: float = max_grad_norm_field()
    optimizer: str = optimizer_field()
    eval_every: int = setting(
        20,
        "Held-out loss every N steps and at the end (0 = never).",
        section="evaluation", range=EVERY)
    eval_batches: int = setting(0, "0 = the whole held-out split", section="evaluation", range=COUNT)
    samples: int = samples_field(" (at most a few tokens past the reference's length)")
    sebp: str = sebp_field("")
    sebp_kernel: str = sebp_kernel_field()
    fused_lora: str = setting(
        "auto",
        "LoRA's branch inside the GEMMs (kernels/lora_fused.py): the scaled rank-r product accumulates into the "
        "base layer's output (and the backward's dX) in the GEMM itself, instead of separate multiply and add "
        "passes over the whole output. Same result to rounding. auto = on a CUDA GPU (measured faster there: "
        "bench/README.md), off on the CPU; on | off.",
        section="speed", choices=AUTO_ON_OFF)
    packing: bool = setting(
        False,
        "Padding-free batches (engine/data/packing.py): a micro-batch's rows laid end to end in one row, "
        "position ids restarting at each row, a block-diagonal causal mask. No compute or memory is "
        "spent on padding in the forward either; same loss as the padded batch.",
        section="speed")

    def grading(self) -> GradingSettings:
        """Task files of prompts and answers are graded with GradingSettings' defaults."""
        return GradingSettings()
