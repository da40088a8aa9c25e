"""The settings form: one widget spec per dataclass field of engine/core/settings/, read from
the dataclasses themselves (type, default, and the help text, section and choices each
field declares in its metadata), so a new setting appears in the app without touching it.

Values travel as a flat dict {"sft.lr": 0.001, ...}; `config_from_values` hands them to
the engine's `resolve()`, the same validator the CLI's `--set` goes through.
"""

from __future__ import annotations

import dataclasses
import os
import re
import typing
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from edgetune.engine.core import config_files
from edgetune.engine.core import settings as S
from edgetune.engine.core.methods import METHODS as RECORDS


def groups() -> dict:
    """Every settings group of Config, in the order the page shows them: the shared ones,
    then one per method (its record's name)."""
    return {f.name: f.default_factory for f in dataclasses.fields(S.Config) if f.name != "method"}


# What a newcomer needs to see of the shared groups; a method's group shows its record's
# `basic` first. Everything else of a group folds into "Advanced".
BASIC = {
    "model": ("name", "quant"),
    "data": ("path", "format", "max_seq_len"),
    "lora": ("r", "alpha", "target_modules"),
    "run": ("name", "seed", "checkpoint_every"),
}


def basic(group: str) -> tuple[str, ...]:
    """The settings of a group the page shows first."""
    return RECORDS[group].basic if group in RECORDS else BASIC.get(group, ())


# The app owns where runs live.
HIDDEN = {"run.runs_dir"}

@dataclass
class FieldSpec:
    group: str
    name: str
    kind: str  # int | float | bool | str | any (YAML text: lists, dicts, null)
    default: Any
    help: str
    section: str  # the section of its group the field declares ("" = none)
    basic: bool
    choices: tuple | None = None

    @property
    def key(self) -> str:
        return f"{self.group}.{self.name}"

    @property
    def elem_id(self) -> str:
        return f"field-{self.group}-{self.name}"


def _kind(typ) -> str:
    return {int: "int", float: "float", bool: "bool", str: "str"}.get(typ, "any")


def field_specs() -> list[FieldSpec]:
    specs = []
    for group, cls in groups().items():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            key = f"{group}.{f.name}"
            if key in HIDDEN:
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            specs.append(FieldSpec(group, f.name, _kind(hints[f.name]), default, f.metadata["help"],
                                   f.metadata["section"], f.name in basic(group), f.metadata["choices"]))
    return specs


# --------------------------------------------------------------------------- values


def to_widget(spec: FieldSpec, value: Any) -> Any:
    """A setting's value as its widget shows it."""
    if spec.kind == "any":
        if value is None:
            return ""
        if isinstance(value, str):
            return value
        return yaml.safe_dump(value, default_flow_style=True).strip()
    if spec.kind == "str":
        return "" if value is None else str(value)
    return value


def from_widget(spec: FieldSpec, value: Any) -> Any:
    if spec.kind == "any":
        text = (value or "").strip()
        if not text:
            return None
        try:
            return yaml.safe_load(text)
        except yaml.YAMLError:
            return text
    if spec.kind == "int" and isinstance(value, float) and value.is_integer():  # not NaN nor infinite
        return int(value)
    if spec.kind == "str":
        return "" if value is None else str(value)
    return value


def values_from_config(cfg: S.Config, specs: list[FieldSpec]) -> list:
    d = cfg.to_dict()
    return [to_widget(s, d[s.group][s.name]) for s in specs]


def nested(method: str, values: list, specs: list[FieldSpec]) -> dict:
    out: dict = {"method": method}
    for spec, v in zip(specs, values):
        out.setdefault(spec.group, {})[spec.name] = from_widget(spec, v)
    return out


def config_from_values(method: str, values: list, specs: list[FieldSpec], runs_dir: str) -> S.Config:
    """Widget values -> a validated Config (raises ConfigError with a one-line message)."""
    data = nested(method, values, specs)
    data.setdefault("run", {})["runs_dir"] = str(runs_dir)
    return S.resolve(overrides=data)


# --------------------------------------------------------------------------- presets


def user_preset_dir() -> Path:
    return Path(os.environ.get("EDGETUNE_PRESETS", Path.home() / ".config" / "edgetune" / "presets"))


def all_presets() -> dict[str, Path]:
    """Built-in presets (presets/*.yaml), then the user's (a saved name shadows nothing:
    user presets are listed as 'name (saved)' when the name is taken)."""
    found = dict(config_files.list_presets())
    d = user_preset_dir()
    if d.is_dir():
        for p in sorted(d.glob("*.yaml")):
            found[p.stem if p.stem not in found else f"{p.stem} (saved)"] = p
    return found


def preset_config(name: str, runs_dir: str) -> S.Config:
    path = all_presets().get(name)
    if path is None:
        raise S.ConfigError(f"unknown preset '{name}'")
    return S.resolve(config=path, overrides={"run": {"runs_dir": str(runs_dir)}})


def preset_title(path: Path) -> str:
    """A preset's description: the first sentence of its leading comment."""
    return config_files.preset_description(path)


def save_preset(name: str, cfg: S.Config, folder: Path | None = None) -> Path:
    """Write the settings that differ from the defaults (plus the method) as a preset."""
    name = name.strip()
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}", name):
        raise S.ConfigError("a preset name uses letters, digits, '-', '_' or '.', e.g. my-sft")
    folder = Path(folder or user_preset_dir())
    folder.mkdir(parents=True, exist_ok=True)
    default, current = S.Config().to_dict(), cfg.to_dict()
    out: dict = {"method": current["method"]}
    for group, fields in current.items():
        if group == "method":
            continue
        diff = {k: v for k, v in fields.items()
                if v != default[group][k] and f"{group}.{k}" not in HIDDEN and k != "name"}
        if diff:
            out[group] = diff
    path = folder / f"{name}.yaml"
    path.write_text(f"# {name}: saved from the edgetune app\n" + yaml.safe_dump(out, sort_keys=False))
    return path


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


def _yaml_value(value) -> str:
    """A value as `--set` reads it back (YAML: numbers, lists, bools; a string that would
    read as something else is quoted)."""
    text = yaml.safe_dump(value, default_flow_style=True, width=10**9).strip()
    return text[:-3].strip() if text.endswith("...") else text


def cli_command(cfg: S.Config) -> str:
    """The `edgetune train` command that starts the same run as `cfg`: the built-in preset of
    its method that differs from it least, then a --set for each setting that differs."""
    import shlex

    mine = _flat(cfg.to_dict())
    skip = {"run.runs_dir", "run.name"}

    def differs(name: str) -> list[str]:
        theirs = _flat(S.resolve(preset=name).to_dict())
        return [k for k in mine if k not in skip and theirs.get(k) != mine[k]]

    same_method = [n for n in config_files.list_presets() if S.resolve(preset=n).method == cfg.method]
    best = min(same_method, key=lambda n: len(differs(n)))
    words = ["edgetune", "train", "--preset", best] + \
        [w for k in differs(best) for w in ("--set", f"{k}={_yaml_value(mine[k])}")] + \
        (["--name", cfg.run.name] if cfg.run.name else []) + ["--runs-dir", cfg.run.runs_dir]
    return shlex.join(words)
