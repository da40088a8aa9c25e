"""One record per training method: what the worker, the planner, the OOM advice, the CLI,
the app and the export know about a method, in one place. Light on purpose (no torch): the
app reads it.

Every part reads a method's behaviour from its record's fields, never from a table of its
own keyed by the method's name: the worker imports `module` and calls its `train(ctx)`; the
planner (engine/planning/planner.py) sizes its step with the memory model `memory` names and
splits `per_rank` across GPUs; a far-beyond refusal names `shape`; engine/planning/oom.py
lowers `oom_levers`; the data loader reads `data`; the app shows `basic` first and draws
`plots`. Adding a method is a record here, its settings dataclass in engine/core/settings/<name>.py
(a group of Config named like the record, whose `grading()` says how its completions are
graded), its folder in engine/methods/ and its presets. tests/test_method_conformance.py runs
every part for every record; no code outside this file and the method's own folder compares a
method's name (tests/test_layout.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Lever:
    """A setting to lower when a step runs out of GPU memory (engine/planning/oom.py)."""

    setting: str  # "sft.batch_size"
    to: Any = None  # a switch: the value that saves memory, suggested while the setting has another one
    floor: int = 1  # a number (to None): halved while it is above this
    zero_means: tuple[str, ...] = ()  # a number whose 0 stands for the product of these settings ("all at once")


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
    name: str  # Config.method, its settings group, engine/methods/<name>/
    label: str  # its name on screens and in model cards
    title: str  # what the label stands for, in a few words
    description: str  # one line: what it does
    module: str  # the module whose `train(ctx)` is its loop (engine/methods/<name>/<name>.py)
    unit: str  # what one step of its progress is: "step" or "generation"
    length: str  # the setting of its group that counts those units
    # the rows it trains on: "demonstrations" (chat, prompt / completion, text), "prompts"
    # (prompt / gold answer) or "pairs" (prompt, chosen, rejected)
    data: str
    gradients: bool  # trains by back-propagation: optimizer, SEBP, Liger, checkpointing apply
    rollouts: bool  # generates completions while it trains
    # The planner's memory model of its step (engine/planning/planner.py's PLANS): "rows" (a
    # micro-batch of `batch` rows trained on), "pairs" (a chosen and a rejected row for each of
    # `batch`), "rollouts" (generate, then update in micro-batches) or "population" (candidates
    # scored by generation, no gradients)
    memory: str
    shape: tuple[str, ...]  # the settings that size its step's memory (a far-beyond refusal names them)
    # What to lower when a step runs out of GPU memory, in the order worth trying
    # (engine/planning/oom.py says by how much).
    oom_levers: tuple[Lever, ...]
    batch: str  # the setting of the rows one forward pass takes (the planner halves it to fit)
    basic: tuple[str, ...]  # the settings of its group the app shows first (the rest fold in "Advanced")
    plots: tuple[Plot, ...]  # what the app plots of a run, from its events
    headline: tuple[str, ...]  # the step event's fields the app's progress line shows
    # The setting a data-parallel run splits across its ranks ("" = none: each rank works on
    # the whole of it), and the setting of micro-batches a step accumulates ("" = one): a
    # rank's micro-batch holds at most `per_rank`, and a step's rows divided by the ranks.
    per_rank: str = ""
    accumulate: str = ""
    rollout_batch: str = ""  # the setting of the prompts a step generates for ("" = none)
    rewards: bool = False  # its group has `reward` / `reward_file` (a reward file runs as Python)
    samples: bool = False  # the app shows its sample completions (`sample` events)
    packing: bool = False  # its group has `packing`: rows laid end to end, flex_attention, Liger
    offload: bool = False  # model.offload_activations applies to its step
    fsdp: str = ""  # why model.shard: fsdp is refused for it ("" = built for it)
    more_steps: str = ""  # why `resume --more-steps` is refused for it ("" = it can train further)
    # the method whose run makes its starting adapter when none is given ("" = it starts from
    # lora.* or lora.init_from); its adapter's shape is kept
    warm_start: str = ""
    population: bool = False  # scores candidates in batches (essa.evaluation: batched)

    def total(self, config: dict) -> int | None:
        """How many units a run lasts, from its config as a dict (the `started` event's)."""
        return (config.get(self.name) or {}).get(self.length)

    def settings(self) -> list[str]:
        """Every setting the record names ("group.field"): each must exist in a config of it."""
        named = [*self.shape, *(lever.setting for lever in self.oom_levers),
                 *(s for lever in self.oom_levers for s in lever.zero_means), self.batch,
                 *(f"{self.name}.{f}" for f in (self.length, *self.basic))]
        return [s for s in [*named, self.per_rank, self.accumulate, self.rollout_batch] if s]


FIELDS = tuple(f.name for f in dataclasses.fields(Method))  # what a record holds, for the conformance test

CHECKPOINTING = Lever("model.gradient_checkpointing", to=True)
SEQ_LEN = Lever("data.max_seq_len", floor=256)  # shorter rows change what is learnt: last in each list

METHODS = {m.name: m for m in (
    Method("sft", "SFT", "supervised fine-tuning",
           "Supervised fine-tuning on demonstrations (prompt tokens masked).",
           module="edgetune.engine.methods.sft.sft",
           unit="step", length="steps", data="demonstrations", gradients=True, rollouts=False,
           memory="rows", shape=("sft.batch_size", "data.max_seq_len"),
           oom_levers=(CHECKPOINTING, Lever("sft.batch_size"), SEQ_LEN),
           batch="sft.batch_size", per_rank="sft.batch_size", accumulate="sft.grad_accum",
           basic=("steps", "lr", "batch_size", "eval_every"),
           plots=(Plot("Loss", "loss", (Series("step", "loss", "train loss"),
                                        Series("eval", "eval_loss", "eval loss"))),),
           headline=("loss",), packing=True, offload=True),
    Method("fgrpo", "F-GRPO", "focal group-relative RL",
           "RL with verifiable rewards: group-relative advantages with focal group weights.",
           module="edgetune.engine.methods.fgrpo.fgrpo",
           unit="step", length="steps", data="prompts", gradients=True, rollouts=True,
           memory="rollouts", shape=("fgrpo.prompts_per_step", "fgrpo.num_generations", "fgrpo.micro_batch_size",
                                     "fgrpo.max_new_tokens", "data.max_seq_len"),
           oom_levers=(Lever("fgrpo.micro_batch_size", zero_means=("fgrpo.prompts_per_step", "fgrpo.num_generations")),
                       CHECKPOINTING, Lever("fgrpo.max_new_tokens", floor=64)),
           batch="fgrpo.micro_batch_size", rollout_batch="fgrpo.prompts_per_step", per_rank="fgrpo.prompts_per_step",
           basic=("steps", "lr", "num_generations", "prompts_per_step", "max_new_tokens", "reward", "gamma",
                  "sample_every"),
           plots=(
               # Two plots: with a 0/1 reward, the reward mean equals the success rate and one
               # line would hide the other.
               Plot("Reward", "mean reward", (Series("step", "reward_mean", "reward"),)),
               Plot("Success", "share", (Series("step", "success_rate", "success rate"),
                                         Series("eval", "pass@1", "eval pass@1"))),
               Plot("KL to the base", "KL", (Series("step", "kl", "KL"),),
                    none_after_steps="not measured: fgrpo.beta is 0 (no KL term in the loss)"),
           ),
           headline=("reward_mean", "success_rate"), rewards=True, samples=True),
    Method("essa", "ESSA", "evolution strategies over LoRA singular values",
           "CMA-ES over the singular values of a warm-start LoRA (inference-only memory).",
           module="edgetune.engine.methods.essa.essa",
           unit="generation", length="generations", data="prompts", gradients=False, rollouts=True,
           memory="population", shape=("essa.prompts_per_generation", "essa.candidates_per_batch",
                                       "essa.max_new_tokens", "data.max_seq_len"),
           oom_levers=(Lever("essa.evaluation", to="sequential"), Lever("essa.max_new_tokens", floor=64)),
           batch="essa.prompts_per_generation",
           basic=("generations", "population", "reward", "prompts_per_generation", "warm_start", "evaluation"),
           plots=(
               Plot("Fitness per generation", "fitness",
                    (Series("step", "best", "best"), Series("step", "mean", "mean"),
                     Series("eval", "reward", "held-out reward")), "generation"),
               Plot("Warm-start SFT loss", "loss", (Series("warm_start:step", "loss", "warm-start loss"),),
                    "warm-start step"),
           ),
           headline=("best", "mean"), rewards=True, warm_start="sft", population=True,
           fsdp="trains no gradients and already splits its population over the GPUs; sharding the base "
                "for generation only is not built yet",
           more_steps="its search is not continued past essa.generations (a finished ESSA run keeps no "
                      "checkpoint of it); start a new run with more generations"),
    Method("dpo", "DPO", "preference tuning",
           "Preference tuning on chosen / rejected pairs (DPO, IPO, SimPO, ORPO); the reference is the base.",
           module="edgetune.engine.methods.dpo.dpo",
           unit="step", length="steps", data="pairs", gradients=True, rollouts=False,
           memory="pairs", shape=("dpo.batch_size", "data.max_seq_len"),
           oom_levers=(CHECKPOINTING, Lever("dpo.batch_size"), SEQ_LEN),
           batch="dpo.batch_size", per_rank="dpo.batch_size", accumulate="dpo.grad_accum",
           basic=("loss_type", "beta", "steps", "lr", "batch_size", "eval_every"),
           plots=(
               Plot("Loss", "loss", (Series("step", "loss", "preference loss"),
                                     Series("eval", "eval_loss", "eval preference loss"))),
               Plot("Reward accuracy", "share of pairs",
                    (Series("step", "accuracy", "reward accuracy"),
                     Series("eval", "eval_accuracy", "eval reward accuracy"))),
               Plot("Reward margin", "margin", (Series("step", "margin", "margin"),
                                                Series("eval", "eval_margin", "eval margin"))),
           ),
           headline=("loss", "accuracy"),
           fsdp="runs data-parallel (--gpus N) with the whole base on each GPU; sharding the base is not built "
                "for it yet"),
)}
