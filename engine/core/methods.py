"""One record per training method: what the worker, the planner, the CLI, the app and the
export know about a method, in one place. Light on purpose (no torch): the app reads it.

A method's training loop is `train(ctx)` at the top of engine/methods/<name>/<name>.py; the worker
(engine/run/worker.py, `method_module`) imports it, and the planner's memory model of its step
is in engine/planning/planner.py's `PLANS`; both tables are checked against these records
(tests/test_method_records.py). Adding a method is a record here, its settings dataclass in
engine/core/settings.py, its folder in engine/methods/, its plan, its presets and its plots
in app/methods.py. No code outside this file and the method's folder compares a method's name
(tests/test_layout.py): it reads the record's fields.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Method:
    name: str  # Config.method, its settings group, engine/methods/<name>/
    label: str  # its name on screens and in model cards
    title: str  # what the label stands for, in a few words
    description: str  # one line: what it does
    unit: str  # what one step of its progress is: "step" or "generation"
    length: str  # the setting of its group that counts those units
    # the rows it trains on: "demonstrations" (chat, prompt / completion, text), "prompts"
    # (prompt / gold answer) or "pairs" (prompt, chosen, rejected)
    data: str
    gradients: bool  # trains by back-propagation: optimizer, SEBP, Liger, checkpointing apply
    rollouts: bool  # generates completions while it trains
    # What to lower when a step runs out of GPU memory, in the order worth trying
    # (engine/planning/oom.py says by how much).
    oom_levers: tuple[str, ...]
    batch: str  # the setting of the rows one forward pass takes (the planner halves it to fit)
    rollout_batch: str = ""  # the setting of the prompts a step generates for ("" = none)
    rewards: bool = False  # its group has `reward` / `reward_file` (a reward file runs as Python)
    packing: bool = False  # its group has `packing`: rows laid end to end, flex_attention, Liger
    offload: bool = False  # model.offload_activations applies to its step
    fsdp: str = ""  # why model.shard: fsdp is refused for it ("" = built for it)
    more_steps: str = ""  # why `resume --more-steps` is refused for it ("" = it can train further)
    warm_start: bool = False  # its adapter comes from a warm start, whose shape it keeps (not lora.*)
    population: bool = False  # scores candidates in batches (essa.evaluation: batched)

    def total(self, config: dict) -> int | None:
        """How many units a run lasts, from its config as a dict (the `started` event's)."""
        return (config.get(self.name) or {}).get(self.length)


METHODS = {m.name: m for m in (
    Method("sft", "SFT", "supervised fine-tuning",
           "Supervised fine-tuning on demonstrations (prompt tokens masked).",
           unit="step", length="steps", data="demonstrations", gradients=True, rollouts=False,
           oom_levers=("model.gradient_checkpointing", "sft.batch_size", "data.max_seq_len"),
           batch="sft.batch_size", packing=True, offload=True),
    Method("fgrpo", "F-GRPO", "focal group-relative RL",
           "RL with verifiable rewards: group-relative advantages with focal group weights.",
           unit="step", length="steps", data="prompts", gradients=True, rollouts=True,
           oom_levers=("fgrpo.micro_batch_size", "model.gradient_checkpointing", "fgrpo.max_new_tokens"),
           batch="fgrpo.micro_batch_size", rollout_batch="fgrpo.prompts_per_step", rewards=True),
    Method("essa", "ESSA", "evolution strategies over LoRA singular values",
           "CMA-ES over the singular values of a warm-start LoRA (inference-only memory).",
           unit="generation", length="generations", data="prompts", gradients=False, rollouts=True,
           oom_levers=("essa.evaluation", "essa.max_new_tokens"),
           batch="essa.prompts_per_generation", rewards=True, warm_start=True, population=True,
           fsdp="trains no gradients and already splits its population over the GPUs; sharding the base "
                "for generation only is not built yet",
           more_steps="its search is not continued past essa.generations (a finished ESSA run keeps no "
                      "checkpoint of it); start a new run with more generations"),
    Method("dpo", "DPO", "preference tuning",
           "Preference tuning on chosen / rejected pairs (DPO, IPO, SimPO, ORPO); the reference is the base.",
           unit="step", length="steps", data="pairs", gradients=True, rollouts=False,
           oom_levers=("model.gradient_checkpointing", "dpo.batch_size", "data.max_seq_len"),
           batch="dpo.batch_size",
           fsdp="runs data-parallel (--gpus N) with the whole base on each GPU; sharding the base is not built "
                "for it yet"),
)}
