"""Settings from text: defaults, then a preset, a YAML file and key=value overrides, each
value turned into its field's type; and a number typed outside the settings read the same way."""

from __future__ import annotations

import dataclasses
import math
import os
from typing import Any

import yaml

from edgetune.engine.core.config_files import TOO_LONG, list_presets, load_yaml
from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.settings.checks import suggest, validate
from edgetune.engine.core.settings.config import Config, field_types
from edgetune.engine.core.settings.fields import Range, brief, check_range, num_text


def coerce(path: str, value: Any, typ: Any) -> Any:
    """Turn a YAML/CLI value into the field's type, or say which key is wrong."""
    if typ is Any or value is None:
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{path}: expected true/false, got {brief(value)}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {brief(value)}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected an integer, got {brief(value)}") from None
        if not math.isfinite(f) or f != int(f):
            raise ConfigError(f"{path}: expected an integer, got {brief(value)}")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {brief(value)}") from None
        except OverflowError:  # an integer beyond any float
            raise ConfigError(f"{path} must be a finite number, got {num_text(value)}") from None
    if typ is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare on/off as a boolean
            return "on" if value else "off"
        return str(value)
    return value


def apply_settings(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of settings, got {brief(data)}")
    types = field_types(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if not prefix and key == "effective":
            continue  # a run's config.yaml records what was decided (engine/planning/effective.py): not a setting
        if key not in types:
            shown = path if path.isprintable() and len(path) <= 60 else brief(str(path)).strip("'\"")  # one line
            raise ConfigError(f"unknown setting '{shown}'{suggest(key, list(types))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            apply_settings(current, value, prefix=f"{path}.")
        else:
            setattr(obj, key, coerce(path, value, types[key]))


def parse_override(text: str) -> tuple[str, Any]:
    """'lora.r=32' -> ('lora.r', 32); the value is read as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {brief(text)}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except ValueError:  # an integer of more digits than Python converts
        raise ConfigError(f"{key.strip()}: {TOO_LONG}") from None
    return key.strip(), value


def nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


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
            raise ConfigError(f"unknown preset '{preset}'{suggest(preset, list(presets))}")
        apply_settings(cfg, load_yaml(presets[preset]))
    if config:
        apply_settings(cfg, load_yaml(config))
    if isinstance(overrides, dict):
        apply_settings(cfg, overrides)
    else:
        for text in overrides or []:
            key, value = parse_override(text)
            apply_settings(cfg, nest(key, value))
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    cfg = Config()
    apply_settings(cfg, data)
    validate(cfg)
    return cfg


def typed_number(name: str, value: Any, rng: Range, typ: type = int) -> Any:
    """A number typed outside the settings (a command-line flag, an app field of the same
    meaning) read like a setting's: text, a float or an int becomes `typ`, and anything
    outside `rng` (or not a number) is refused in one line naming `name`."""
    v = coerce(name, value.strip() if isinstance(value, str) else value, typ)
    check_range(name, v, rng)
    return v
