"""The training methods the app offers, one table entry each: what the page plots and
shows for a method. Its name, description and step unit are the engine's record
(engine/core/methods.py); adding a method is a record there plus an entry here, never a
special case in the page code."""

from __future__ import annotations

from dataclasses import dataclass

from edgetune.engine.core.methods import METHODS as RECORDS


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
    # What an empty plot says once the run has steps ("no data yet" before them).
    none_after_steps: str = "no data"


@dataclass(frozen=True)
class Method:
    key: str  # Config.method and the settings group
    plots: tuple[Plot, ...]
    samples: bool  # shows sample completions (RL methods)
    headline: tuple[str, ...]  # step-event fields the progress line shows

    @property
    def record(self):
        """The engine's record of the method (engine/core/methods.py): label, description, unit."""
        return RECORDS[self.key]

    @property
    def label(self) -> str:
        return self.record.label

    @property
    def blurb(self) -> str:
        return self.record.description


METHODS = (
    Method(
        "sft",
        plots=(Plot("Loss", "loss", (Series("step", "loss", "train loss"), Series("eval", "eval_loss", "eval loss"))),),
        samples=False, headline=("loss",),
    ),
    Method(
        "fgrpo",
        plots=(
            # Two plots: with a 0/1 reward, the reward mean equals the success rate and one
            # line would hide the other.
            Plot("Reward", "mean reward", (Series("step", "reward_mean", "reward"),)),
            Plot("Success", "share", (Series("step", "success_rate", "success rate"),
                                      Series("eval", "pass@1", "eval pass@1"))),
            Plot("KL to the base", "KL", (Series("step", "kl", "KL"),),
                 none_after_steps="not measured: fgrpo.beta is 0 (no KL term in the loss)"),
        ),
        samples=True, headline=("reward_mean", "success_rate"),
    ),
    Method(
        "essa",
        plots=(
            Plot("Fitness per generation", "fitness", (Series("step", "best", "best"), Series("step", "mean", "mean"),
                                                       Series("eval", "reward", "held-out reward")), "generation"),
            Plot("Warm-start SFT loss", "loss", (Series("warm_start:step", "loss", "warm-start loss"),),
                 "warm-start step"),
        ),
        samples=False, headline=("best", "mean"),
    ),
    Method(
        "dpo",
        plots=(
            Plot("Loss", "loss", (Series("step", "loss", "preference loss"),
                                  Series("eval", "eval_loss", "eval preference loss"))),
            Plot("Preference accuracy", "share of pairs", (Series("step", "accuracy", "chosen wins"),
                                                           Series("eval", "eval_accuracy", "eval chosen wins"))),
            Plot("Reward margin", "margin", (Series("step", "margin", "margin"),
                                             Series("eval", "eval_margin", "eval margin"))),
        ),
        samples=False, headline=("loss", "accuracy"),
    ),
)

# What the Runs tab can compare across runs: every series of every method's plots, once
# per label ("train loss", "eval pass@1", ...), with the plot it belongs to.
COMPARABLE = {}
for _m in METHODS:
    for _p in _m.plots:
        for _s in _p.series:
            COMPARABLE.setdefault(_s.label, (_s, _p))

BY_KEY = {m.key: m for m in METHODS}
BY_LABEL = {m.label: m for m in METHODS}
MAX_PLOTS = max(len(m.plots) for m in METHODS)
