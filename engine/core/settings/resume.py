"""A run's saved settings read back, and what a resume may change: the settings read at
every step take their new value, any other change is refused in one line."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path
from typing import Any

from edgetune.engine.core.config_files import read_run_yaml
from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings.checks import setting_value
from edgetune.engine.core.settings.config import Config, declared
from edgetune.engine.core.settings.fields import brief
from edgetune.engine.core.settings.parse import from_dict

# Settings that earlier versions wrote into a run's config.yaml and that no longer exist
# (nothing read them): dropped when a run's config is read, refused anywhere else.
RETIRED = ("sft.sample_every",)


def load_run_config(path: str | os.PathLike) -> Config:
    """The settings a run resumes with, from its config.yaml: every problem in one line
    naming the file. A run writes every group of settings, so a file missing some was cut
    short (a full disk, a copy that stopped): refused, rather than resumed on defaults."""
    p = Path(path)
    data = read_run_yaml(p)
    missing = [f.name for f in dataclasses.fields(Config) if f.name not in data]
    if missing:
        lines = len(p.read_text(encoding="utf-8").splitlines())
        raise ConfigError(f"{p}, line {lines}: ends without the '{missing[0]}' settings (cut short?); a run's "
                          "config.yaml holds every group")
    for key in RETIRED:  # a run saved by an earlier edgetune still resumes
        group, _, name = key.partition(".")
        if isinstance(data.get(group), dict):
            data[group].pop(name, None)
    try:
        return from_dict(data)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None



# Settings a resumed run takes as config.yaml has them now (they are read at every step,
# evaluation or checkpoint). Any other setting of the run's method and of model, lora,
# data and run edited since the run last started is refused on resume, naming it: its
# checkpoint holds what that setting decided (the optimizer's state and learning-rate
# schedule, the data's order and split, the model), so a new value would be ignored.
APPLIED_ON_RESUME = ("run.log_every", "run.checkpoint_every", "run.keep_checkpoints", "run.report_to",
                     "sft.steps", "sft.eval_every", "sft.eval_batches", "sft.samples",
                     "fgrpo.steps", "fgrpo.eval_every", "fgrpo.eval_prompts", "fgrpo.eval_k", "fgrpo.sample_every",
                     "fgrpo.samples", "essa.eval_every", "essa.eval_prompts")
NOT_COMPARED_ON_RESUME = ("run.name", "run.runs_dir")  # where the run lives, not how it trains


def resume_changes(cfg: Config, trained: dict, config_path: str | os.PathLike = "config.yaml") \
        -> list[tuple[str, Any, Any]]:
    """The settings of `cfg` that differ from `trained` (the config a run last started with,
    from its `started` event), as (key, then, now): each one APPLIED_ON_RESUME; a change to
    any other is a one-line ConfigError naming it. A `trained` that is no config (an old
    or damaged event) compares nothing."""
    if not isinstance(trained, dict) or any(f.name not in trained for f in dataclasses.fields(Config)):
        return []  # no config recorded, or not a whole one
    try:
        data = {k: dict(v) if isinstance(v, dict) else v for k, v in dict(trained).items()}
        for key in RETIRED:
            group, _, name = key.partition(".")
            if isinstance(data.get(group), dict):
                data[group].pop(name, None)
        then = from_dict(data)
    except (ConfigError, TypeError, ValueError):
        return []
    changes = []
    for key in declared():
        group = key.split(".")[0]
        if group not in ("model", "lora", "data", "run", cfg.method) or key in NOT_COMPARED_ON_RESUME:
            continue
        old, new = setting_value(then, key), setting_value(cfg, key)
        if old == new:
            continue
        more = key == f"{cfg.method}.{RECORDS[cfg.method].length}" and not RECORDS[cfg.method].more_steps
        if key not in APPLIED_ON_RESUME and not more:  # (more: its step count, which --more-steps raises)
            raise ConfigError(f"{config_path}: {key} is {brief(new)} but the run trained with {brief(old)}, which "
                              f"its checkpoint keeps (a resume would ignore the new value); set it back to "
                              f"{brief(old)} to resume, or start a new run with the new value")
        changes.append((key, old, new))
    return changes
