"""The training methods the app offers, one table entry each: adding a method is adding
an entry here (plus its settings dataclass in engine/core/settings.py), never a special case
in the page code."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Series:
    event: str  # event type the value comes from ("step", "eval", or "warm_start:step" for ESSA's SFT)
    key: str  # field of that event
    label: str  # legend entry


@dataclass(frozen=True)
class Plot:
    title: str
    y_title: str
    series: tuple[Series, ...]
    x_title: str = "step"


@dataclass(frozen=True)
class Method:
    key: str  # Config.method and the settings group
    label: str
    blurb: str
    plots: tuple[Plot, ...]
    samples: bool  # shows sample completions (RL methods)
    headline: tuple[str, ...]  # step-event fields the progress line shows


METHODS = (
    Method(
        "sft", "SFT", "Supervised fine-tuning on demonstrations (prompt tokens masked).",
        plots=(Plot("Loss", "loss", (Series("step", "loss", "train loss"), Series("eval", "eval_loss", "eval loss"))),),
        samples=False, headline=("loss",),
    ),
    Method(
        "fgrpo", "F-GRPO", "RL with verifiable rewards: group-relative advantages with focal group weights.",
        plots=(
            # Two plots: with a 0/1 reward, the reward mean equals the success rate and one
            # line would hide the other.
            Plot("Reward", "mean reward", (Series("step", "reward_mean", "reward"),)),
            Plot("Success", "share", (Series("step", "success_rate", "success rate"),
                                      Series("eval", "pass@1", "eval pass@1"))),
            Plot("KL to the base", "KL", (Series("step", "kl", "KL"),)),
        ),
        samples=True, headline=("reward_mean", "success_rate"),
    ),
    Method(
        "essa", "ESSA", "CMA-ES over the singular values of a warm-start LoRA (inference-only memory).",
        plots=(
            Plot("Fitness per generation", "fitness", (Series("step", "best", "best"), Series("step", "mean", "mean"),
                                                       Series("eval", "reward", "held-out reward")), "generation"),
            Plot("Warm-start SFT loss", "loss", (Series("warm_start:step", "loss", "warm-start loss"),),
                 "warm-start step"),
        ),
        samples=False, headline=("best", "mean"),
    ),
)

BY_KEY = {m.key: m for m in METHODS}
BY_LABEL = {m.label: m for m in METHODS}
MAX_PLOTS = max(len(m.plots) for m in METHODS)
