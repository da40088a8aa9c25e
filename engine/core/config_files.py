"""Settings files: the presets shipped in presets/ and the user's YAML files, read into
plain mappings that engine/core/settings/'s `resolve()` applies and validates.

A bad file is one line naming the file and what is wrong with it (engine/core/errors.py).
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import yaml

from edgetune.engine.core.errors import ConfigError


def preset_dir() -> Path:
    return Path(__file__).resolve().parents[2] / "presets"


def list_presets() -> dict[str, Path]:
    return {p.stem: p for p in sorted(preset_dir().glob("*.yaml"))}


def preset_description(path: str | os.PathLike) -> str:
    """A preset's first sentence, from the comment it starts with (which may wrap over
    several lines): what `edgetune presets` and the page show."""
    words = []
    for line in Path(path).read_text().splitlines():
        if not line.startswith("#") or line.startswith("#   ") or not line.strip("# "):
            break  # the end of the leading comment, or its command lines
        words.append(line.lstrip("#").strip())
    text = " ".join(words)
    end = re.search(r"(?<!e\.g)(?<!i\.e)[.!?](?=\s+[A-Z]|$)", text)
    return text[: end.end()] if end else text


def yaml_problem(path, e: yaml.YAMLError) -> str:
    """One line: file, line and column, and what the parser found there."""
    mark = getattr(e, "problem_mark", None)
    where = f"{path}, line {mark.line + 1}, column {mark.column + 1}" if mark is not None else str(path)
    what = getattr(e, "problem", None) or str(e)
    context = getattr(e, "context", None)
    text = f"{where}: not valid YAML: {what}" + (f" ({context})" if context else "")
    return " ".join(text.split())


TOO_LONG = "holds a number too long to be a setting (thousands of digits)"


def load_yaml(path: str | os.PathLike) -> dict:
    """The mapping of settings in a YAML file, or in the preset of that name."""
    p = Path(path)
    if not p.is_file():
        presets = list_presets()
        if str(path) in presets:
            p = presets[str(path)]
        else:
            raise ConfigError(f"config file not found: {path}")
    return _read_mapping(p, empty_ok=True)


def read_run_yaml(path: str | os.PathLike) -> dict:
    """A run folder's config.yaml as a mapping, or a one-line ConfigError naming the file
    (and the line, when the YAML is damaged). Reads only: `edgetune runs` lists with it."""
    return _read_mapping(Path(path), empty_ok=False)


def _read_mapping(p: Path, empty_ok: bool) -> dict:
    """A YAML file's top-level mapping; an empty file is {} when `empty_ok`. Any problem is
    one line naming the file (and the line, when the YAML is damaged)."""
    try:
        data = yaml.safe_load(p.read_text(encoding="utf-8"))
    except yaml.YAMLError as e:
        raise ConfigError(yaml_problem(p, e)) from None
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except RecursionError:
        raise ConfigError(f"{p}: YAML nested too deeply to read") from None
    except ValueError:  # an integer of more digits than Python converts (4300)
        raise ConfigError(f"{p}: {TOO_LONG}") from None
    except OSError as e:
        raise ConfigError(f"{p}: cannot read ({e.strerror})") from None
    if data is None and empty_ok:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{p}: expected a mapping of settings at the top level, found "
                          f"{'nothing' if data is None else type(data).__name__}")
    return data
