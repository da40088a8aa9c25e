"""Every setting checked against its declaration and the rules between settings; an
unknown name answered with the nearest known one."""

from __future__ import annotations

import difflib
import re
from typing import Any

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings.config import Config, declared
from edgetune.engine.core.settings.fields import REWARD_NAMES, brief, check_finite, check_range

# Names other tools use for our fields: suggested when they are typed here.
ALIASES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
           "learning_rate": "lr", "max_steps": "steps", "num_steps": "steps",
           "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "batch_size",
           "model_name_or_path": "name", "max_length": "max_seq_len", "beta_kl": "beta"}


def suggest(key: str, known: list[str]) -> str:
    key = str(key)[:100]  # a YAML key or value may be a number, a list or null (or a pasted page)
    if ALIASES.get(key) in known:
        return f" (did you mean '{ALIASES[key]}'?)"
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(known)})"


def choice_error(path: str, value: Any, allowed) -> ConfigError:
    near = difflib.get_close_matches(str(value)[:100], [str(a) for a in allowed], n=1, cutoff=0.5)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return ConfigError(f"{path}: {brief(str(value))} is not one of {', '.join(map(str, allowed))}{hint}")


def _check_reward(path: str, spec: Any) -> None:
    if spec is None or spec == "":
        return
    if not isinstance(spec, (str, dict)) or not spec:
        raise ConfigError(f"{path}: expected a reward name or a mapping {{name: weight}}, got {brief(spec)}")
    for name in [spec] if isinstance(spec, str) else spec:
        if isinstance(spec, dict):
            check_finite(f"{path}.{name}", spec[name])
        name = str(name).strip()
        if name in REWARD_NAMES or name.startswith("length_penalty:") or (name.startswith("rg:") and name[3:]):
            continue
        near = difflib.get_close_matches(name, REWARD_NAMES, n=1, cutoff=0.5)
        hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(REWARD_NAMES)})"
        raise ConfigError(f"{path}: unknown reward '{name}'{hint}")


def setting_value(cfg: Config, path: str) -> Any:
    group, name = path.split(".")
    return getattr(getattr(cfg, group), name)


def validate(cfg: Config) -> None:
    """Every setting against its declaration (choices, range, a finite number) and the
    rules between settings; the first problem is raised as one line that names the key."""
    if cfg.method not in RECORDS:
        raise ConfigError(f"unknown method '{cfg.method}'{suggest(cfg.method, list(RECORDS))}")
    if not (isinstance(cfg.model.gradient_checkpointing, bool) or cfg.model.gradient_checkpointing == "auto"):
        raise ConfigError(f"model.gradient_checkpointing: expected true, false or auto, "
                          f"got {brief(cfg.model.gradient_checkpointing)}")
    if cfg.model.shard == "fsdp" and RECORDS[cfg.method].fsdp:
        built = " and ".join(name for name, m in RECORDS.items() if not m.fsdp)
        raise ConfigError(f"model.shard: fsdp is built for {built}; {cfg.method} {RECORDS[cfg.method].fsdp}; "
                          "use model.shard: none")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.model.device)):
        raise choice_error("model.device", cfg.model.device, ("auto", "cpu", "cuda", "cuda:0"))
    for group in (cfg.sft, cfg.fgrpo):  # null: how "auto" was written before it was a word
        if group.sebp is None:
            group.sebp = "auto"
    for path, f in declared().items():
        value = setting_value(cfg, path)
        choices, rng = f.metadata["choices"], f.metadata["range"]
        if choices is not None and value not in choices:
            raise choice_error(path, value, choices)
        if rng is not None:
            check_range(path, value, rng)
        else:
            check_finite(path, value)
    for name in (name for name, m in RECORDS.items() if m.rewards):
        _check_reward(f"{name}.reward", setting_value(cfg, f"{name}.reward"))
    check = getattr(getattr(cfg, cfg.method), "check", None)
    if check is not None:  # the rules between the running method's own settings
        check()
