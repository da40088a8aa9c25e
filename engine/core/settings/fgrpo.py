"""F-GRPO's settings: group-relative policy optimisation on prompts graded by a reward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from edgetune.engine.core.settings.fields import (
    COUNT,
    EVERY,
    FRACTION,
    MAX_NEW_TOKENS_HELP,
    REWARD_FILE_HELP,
    REWARD_HELP,
    ROWS,
    STEPS,
    TEMPERATURE,
    TOKENS,
    Range,
    lr_field,
    max_grad_norm_field,
    optimizer_field,
    samples_field,
    sebp_field,
    sebp_kernel_field,
    setting,
    warmup_steps_field,
)
from edgetune.engine.core.settings.grading import GradingSettings


@dataclass
class FGRPOSettings:
    """F-GRPO: group-relative RL with verifiable rewards and focal group weights."""

    num_generations: int = setting(8, "G, completions per prompt", section="rollouts", range=Range(2, 1024))
    prompts_per_step: int = setting(
        4,
        "Prompts per step; each gets num_generations completions.",
        section="rollouts", range=ROWS)
    max_new_tokens: int = setting(48, MAX_NEW_TOKENS_HELP, section="rollouts", range=TOKENS)
    temperature: float = setting(0.9, "Sampling temperature of the completions.", section="rollouts",
                                 range=TEMPERATURE)
    top_p: float = setting(
        1.0,
        "Nucleus sampling: sample from the smallest set of tokens whose probabilities reach top_p "
        "(1 = all).",
        section="rollouts", range=FRACTION)
    reward: Any = setting("last_number", REWARD_HELP, section="reward")
    reward_file: str = setting("", REWARD_FILE_HELP, section="reward")
    success_threshold: Any = setting(
        None,
        "What counts as success (p̂ of the focal weight, pass@k): None = every correctness part of "
        "the reward at its best (1 for a 0/1 reward; length_penalty ignored); a number = the "
        "weighted reward reaches it. See engine/training/rewards.py.",
        section="reward")
    loss_type: str = setting("dapo", "grpo | dapo | dr_grpo | cispo", section="loss",
                             choices=("grpo", "dapo", "dr_grpo", "cispo"))
    # gamma 2 with normalised weights is the default because it gained most over GRPO on the
    # learning benchmark's held-out tasks (bench/README.md); its cost there: completions of
    # some tasks grew towards max_new_tokens.
    gamma: float = setting(2.0, "focal exponent; 0 = plain GRPO", section="loss", range=Range(0, 100))
    focal_normalize: bool = setting(
        True,
        "Divide the focal weights by their mean over the step's groups whose rewards differ: gamma then "
        "moves the step towards prompts the model does not yet solve without shrinking it (the "
        "weights alone, as in the F-GRPO paper, also scale the step down as the model gets better; "
        "false gives the paper's form).",
        section="loss")
    scale_rewards: str = setting("group", "group | batch | none", section="loss",
                                 choices=("group", "batch", "none"))
    epsilon: float = setting(0.2, "The ratio is clipped below at 1 - epsilon.", section="loss", range=Range(0, 1))
    epsilon_high: float = setting(
        0.28,
        "The ratio is clipped above at 1 + epsilon_high; cispo: an absolute cap on the ratio "
        "instead (e.g. 5.0).",
        section="loss", range=Range(0, 1e6))
    beta: float = setting(0.0, "KL to the base model (adapter off)", section="loss", range=Range(0, 1e6))
    mask_truncated: bool = setting(
        False,
        "Leave completions that hit max_new_tokens out of the loss and its token count (DAPO's "
        "overlong filtering): a cut completion's low reward then says nothing about its tokens. "
        "They still count in their group's advantages and success share. Off by default: on the "
        "learning benchmark it let completions grow to the cap and lowered held-out success "
        "(bench/README.md).",
        section="loss")
    num_iterations: int = setting(
        1,
        "Optimizer steps per rollout batch (more than 1 reuses the rollouts, with the clipped "
        "ratio).",
        section="loss", range=Range(1, 1000))
    lr: float = lr_field(1e-4)
    steps: int = setting(30, "Optimizer steps (each on a fresh rollout batch).", section="optimisation",
                         range=STEPS)
    micro_batch_size: int = setting(
        16,
        "Completions per forward and backward of the update (bounds memory; the update itself does "
        "not depend on it); 0 = all at once.",
        section="optimisation", range=Range(0, ROWS.high))
    warmup_steps: int = warmup_steps_field(0)
    max_grad_norm: float = max_grad_norm_field()
    optimizer: str = optimizer_field()
    eval_every: int = setting(
        0,
        "Held-out success and pass@k every N steps; always before the first and after the last "
        "step.",
        section="evaluation", range=EVERY)
    eval_prompts: int = setting(
        50,
        "Held-out prompts per evaluation (0 = the whole held-out split). No held-out rows "
        "(data.eval_fraction 0 and no data.eval_path) = no evaluation during training; "
        "`edgetune eval` measures the adapter afterwards.",
        section="evaluation", range=COUNT)
    eval_k: int = setting(4, "pass@k; n = 2k samples per prompt (0 = greedy success only)", section="evaluation",
                          range=Range(0, 512))
    sample_every: int = setting(5, "Report one sample completion every N steps (0 = never).", section="evaluation",
                                range=EVERY)
    samples: int = samples_field(" (from its greedy pass: no extra generation)")
    sebp: str = sebp_field(" in the policy update")
    sebp_kernel: str = sebp_kernel_field()

    def grading(self) -> GradingSettings:
        """Its held-out prompts and task files are graded with its own reward and sampling."""
        return GradingSettings(self.reward, self.reward_file, self.max_new_tokens, self.temperature, self.top_p,
                               self.success_threshold, self.eval_k, self.eval_prompts,
                               max(1, self.prompts_per_step * self.num_generations))
