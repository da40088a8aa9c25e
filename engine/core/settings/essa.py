"""ESSA's settings: an evolution strategy over the singular values of a warm-start adapter."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.settings.fields import (
    COUNT,
    EVERY,
    FRACTION,
    MAX_NEW_TOKENS_HELP,
    POSITIVE,
    REWARD_FILE_HELP,
    REWARD_HELP,
    ROWS,
    STEPS,
    TEMPERATURE,
    TOKENS,
    Range,
    brief,
    check_range,
    setting,
)
from edgetune.engine.core.settings.grading import GradingSettings

FITNESS = "fitness: mean reward on a mini-batch of prompts shared by all candidates of a generation"


@dataclass
class ESSASettings:
    """ESSA: CMA-ES over the singular values of a warm-start LoRA adapter."""

    warm_start: str = setting(
        "",
        'adapter folder; "" = run a short SFT first (warm_start_steps)',
        section='warm start')
    warm_start_steps: int = setting(
        40,
        "Steps of the warm-start SFT run when essa.warm_start is unset.",
        section="warm start", range=EVERY)
    warm_start_data: str = setting(
        "",
        'SFT data for the warm start ("" = the embedded set)',
        section='warm start')
    alpha: float = setting(1.0, "share of each factor's singular values searched", section="search space",
                           range=FRACTION)
    # cma's CMA-ES stops with an internal error when the 2 candidates of a generation tie
    # (flat fitness: it injects a direction a population of 2 has no room for).
    population: int = setting(
        16,
        "Candidates per generation (the paper finds 24 or more works best).",
        section="CMA-ES", range=Range(3, 4096))
    sigma0: float = setting(
        0.05,
        "CMA-ES's initial step size, in units of the singular values' offsets.",
        section="CMA-ES", range=Range(0, 1e3, low_open=True))
    step: str = setting(
        "absolute",
        "absolute = sigma0 in the singular values' own units, alike for every value; relative = each "
        "value's step is sigma0 times the value itself (sigma0 0.2: moves of about 20%). After a short "
        "warm start a LoRA B holds much smaller singular values than its A, so one absolute step "
        "can flip B's values while it barely moves A's. Results of both: bench/README.md.",
        section="CMA-ES", choices=("absolute", "relative"))
    generations: int = setting(10, "CMA-ES generations.", section="CMA-ES", range=STEPS)
    reward: Any = setting("last_number", REWARD_HELP, section=FITNESS)
    reward_file: str = setting("", REWARD_FILE_HELP, section=FITNESS)
    prompts_per_generation: int = setting(
        32,
        "Prompts every candidate of a generation is scored on (the mean reward of its completions "
        "is its fitness).",
        section=FITNESS, range=ROWS)
    max_new_tokens: int = setting(32, MAX_NEW_TOKENS_HELP, section=FITNESS, range=TOKENS)
    fitness: str = setting(
        "reward",
        "reward = mean reward of the candidate's completions; gold_logprob = mean log-probability "
        "per token of each prompt's answer written as gold_template, teacher-forced (continuous, no "
        "decoding: candidates rarely tie); reward+gold_logprob = the reward, ties broken by the "
        "gold answer's probability; gold_margin = a soft count of the prompts whose greedy answer, "
        "teacher-forced after the template's lead-in, is the gold one (one forward, no decoding); "
        "reward+gold_margin = the reward, ties broken by that soft count (engine/methods/essa/fitness.py).",
        section=FITNESS,
        choices=("reward", "gold_logprob", "reward+gold_logprob", "gold_margin", "reward+gold_margin"))
    gold_template: str = setting(
        "Answer: {answer}",
        "How the gold answer is written for the gold_logprob and gold_margin fitnesses "
        "({answer} = the row's answer): "
        "the way the warm start's demonstrations state it.",
        section=FITNESS)
    greedy: bool = setting(
        True,
        "Greedy decoding of the candidates' completions (false: sampling at temperature).",
        section=FITNESS)
    # positive when sampling (greedy: false): `validate` checks it then
    temperature: float = setting(
        1.0,
        "sampling only (greedy: false); candidates share the random numbers",
        section=FITNESS)
    evaluation: str = setting(
        "sequential",
        "sequential = one candidate after another (inference memory only); batched = K candidates "
        "share a forward pass with a per-row adapter index.",
        section="evaluation mode", choices=("sequential", "batched"))
    candidates_per_batch: int = setting(
        0,
        "K for batched; 0 = the population on CPU, as many as memory allows on CUDA",
        section="evaluation mode", range=Range(0, 4096))
    eval_every: int = setting(
        5,
        "generations between held-out evaluations (0 = only before and after)",
        section="evaluation mode", range=EVERY)
    eval_prompts: int = setting(
        50,
        "held-out prompts per evaluation (0 = no held-out evaluation)",
        section="evaluation mode", range=COUNT)
    export: str = setting(
        "mean",
        "mean = the CMA-ES mean (less favoured by a lucky mini-batch); best = best candidate seen.",
        section="result", choices=("mean", "best"))

    def grading(self) -> GradingSettings:
        """Graded with its own reward (its fitness), at its max_new_tokens and temperature."""
        return dataclasses.replace(GradingSettings(), reward=self.reward, reward_file=self.reward_file,
                                   max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                   eval_prompts=self.eval_prompts)

    def check(self) -> None:
        """The rules between these settings, for a run of this method (validate calls it)."""
        if not self.warm_start:
            check_range("essa.warm_start_steps (or set essa.warm_start to an adapter folder)",
                         self.warm_start_steps, POSITIVE)
        if not self.greedy:
            check_range("essa.temperature", self.temperature, TEMPERATURE)
        if self.fitness != "reward" and "{answer}" not in self.gold_template:
            raise ConfigError(f"essa.gold_template must contain {{answer}} (fitness {self.fitness}), "
                              f"got {brief(self.gold_template)}")
