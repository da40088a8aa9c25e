"""`Config`: a run's settings, one group each (model, lora, data, run, then a group per
method), and what reads the declarations of all of them."""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any

import yaml

from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings.dpo import DPOSettings
from edgetune.engine.core.settings.essa import ESSASettings
from edgetune.engine.core.settings.fgrpo import FGRPOSettings
from edgetune.engine.core.settings.groups import (
    EMBEDDED_SFT_DATA,
    DataSettings,
    LoraSettings,
    ModelSettings,
    RunSettings,
)
from edgetune.engine.core.settings.sft import SFTSettings

METHODS = tuple(RECORDS)


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
    dpo: DPOSettings = field(default_factory=DPOSettings)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)


def declared() -> dict[str, dataclasses.Field]:
    """Every setting's declaration by key ("sft.lr"), in the order of the dataclasses: its
    default, and in `.metadata` its help, section, choices and range."""
    out = {}
    for group in dataclasses.fields(Config):
        if group.name != "method":
            for f in dataclasses.fields(group.default_factory):
                out[f"{group.name}.{f.name}"] = f
    return out


def field_types(cls) -> dict[str, Any]:
    """A settings dataclass's field types by name (int, float, str, bool, Any, ...)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def warm_start_config(cfg: Config) -> Config:
    """The short SFT run an ESSA run starts from when `essa.warm_start` is unset: the same
    model and adapter shape, trained on `essa.warm_start_data` for `warm_start_steps`.
    One definition for the engine (engine/methods/essa/essa.py runs it) and the planner (which plans it)."""
    s = cfg.essa
    warm = copy.deepcopy(cfg)
    warm.method = RECORDS[cfg.method].warm_start
    warm.data = DataSettings(path=s.warm_start_data or EMBEDDED_SFT_DATA, system_prompt=cfg.data.system_prompt,
                             max_seq_len=cfg.data.max_seq_len)
    warm.sft = dataclasses.replace(cfg.sft, steps=s.warm_start_steps, eval_every=0)
    warm.lora = dataclasses.replace(cfg.lora, init_from="")
    warm.run = dataclasses.replace(cfg.run, checkpoint_every=0)
    # Liger's RoPE replaces a module-level function for the whole process (engine/models/liger.py),
    # and the search that follows in this process decodes through CUDA graphs that were not
    # measured with it: the short warm start runs without Liger.
    warm.model = dataclasses.replace(cfg.model, liger="off")
    return warm
