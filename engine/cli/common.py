"""What several commands share: the run's settings from --preset/--config/--set and a
run named as the user names it."""

from __future__ import annotations

from pathlib import Path

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.settings import resolve


def config_args(sp) -> None:
    """--preset, --config and --set: the flags of a command that reads a run's settings."""
    sp.add_argument("--preset", help="a preset name from presets/ (edgetune presets)")
    sp.add_argument("--config", help="a YAML file of settings")
    sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. lora.r=32")


def config_from(a):
    """The run's settings from the command's --preset/--config/--set (and --name, --runs-dir)."""
    if not a.preset and not a.config:
        raise EdgetuneError("give --preset NAME or --config FILE (edgetune presets lists the presets)")
    overrides = list(a.set or [])
    if getattr(a, "name", None):
        overrides.append(f"run.name={a.name}")
    if getattr(a, "runs_dir", None):
        overrides.append(f"run.runs_dir={a.runs_dir}")
    return resolve(preset=a.preset, config=a.config, overrides=overrides)


def run_arg(value: str, runs_dir: str = "runs") -> str:
    """A run as the user names it: a path, or a name as `edgetune runs` prints it."""
    if Path(value).expanduser().exists():
        return value
    named = Path(runs_dir) / value
    if named.is_dir():
        return str(named)
    raise EdgetuneError(f"no run or folder '{value}' (not a path, and not in {runs_dir}/; "
                        f"edgetune runs --runs-dir {runs_dir} lists the runs)")
