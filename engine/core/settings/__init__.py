"""Every setting of a run, as dataclasses: shared groups (model, lora, data, run) and one
group per method (sft, fgrpo, essa, dpo), each in its own module here.

Each field is declared once, with `setting()` (fields.py): its default, help text (what the
app shows beside the widget), the section of its group, and its allowed values (a closed set
of words, or a numeric range). Validation, the CLI's did-you-mean, the app's widgets and the
tests all read that declaration. Presets are YAML files of these same fields
(engine/core/config_files.py reads them); the CLI's `--set a.b=c` and the app's widgets write
the same fields; `resolve()` (parse.py) is the one place that validates them all (an unknown
key names the nearest known one). What a resume may change is resume.py's.

    fields.py    setting(), Range and the shared ranges, the one-line range checks
    groups.py    ModelSettings, LoraSettings, DataSettings, RunSettings
    sft.py, fgrpo.py, essa.py, dpo.py   each method's settings
    config.py    Config (a run's groups), declared(), warm_start_config()
    checks.py    validate(): every declaration and the rules between settings
    parse.py     resolve(), from_dict(), parse_override(), typed_number()
    resume.py    load_run_config(), resume_changes()
"""

import dataclasses  # noqa: F401  (settings.dataclasses.fields(group): how callers have read a group's fields)

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.settings.checks import ALIASES, validate
from edgetune.engine.core.settings.config import METHODS, Config, declared, field_types, warm_start_config
from edgetune.engine.core.settings.dpo import DPO_REFERENCE_FREE, DPOSettings
from edgetune.engine.core.settings.essa import FITNESS, ESSASettings
from edgetune.engine.core.settings.fgrpo import FGRPOSettings
from edgetune.engine.core.settings.fields import (
    AUTO_ON_OFF,
    CHAT_TOKENS,
    COUNT,
    EVERY,
    FRACTION,
    GPUS,
    LEARNING_RATE,
    MAX_NEW_TOKENS_HELP,
    MAX_STEPS,
    MORE_STEPS,
    NODE_RANK,
    NODES,
    NON_NEGATIVE,
    OPTIMIZERS,
    PORT,
    POSITIVE,
    QUEUE_NUMBER,
    REWARD_FILE_HELP,
    REWARD_HELP,
    REWARD_NAMES,
    ROWS,
    SEBP_KERNELS,
    SEED,
    SHARE,
    STEPS,
    TEMPERATURE,
    TOKENS,
    Range,
    setting,
)
from edgetune.engine.core.settings.grading import GradingSettings
from edgetune.engine.core.settings.groups import (
    EMBEDDED_MODEL,
    EMBEDDED_PAIRS_DATA,
    EMBEDDED_RL_DATA,
    EMBEDDED_SFT_DATA,
    DataSettings,
    LoraSettings,
    ModelSettings,
    RunSettings,
    cache_dir,
)
from edgetune.engine.core.settings.parse import from_dict, parse_override, resolve, typed_number
from edgetune.engine.core.settings.resume import (
    APPLIED_ON_RESUME,
    NOT_COMPARED_ON_RESUME,
    RETIRED,
    load_run_config,
    resume_changes,
)
from edgetune.engine.core.settings.sft import SFTSettings

__all__ = [
    "ALIASES", "APPLIED_ON_RESUME", "AUTO_ON_OFF", "CHAT_TOKENS", "COUNT", "DPO_REFERENCE_FREE", "EMBEDDED_MODEL",
    "EMBEDDED_PAIRS_DATA", "EMBEDDED_RL_DATA", "EMBEDDED_SFT_DATA", "EVERY", "FITNESS", "FRACTION", "GPUS",
    "LEARNING_RATE", "MAX_NEW_TOKENS_HELP", "MAX_STEPS", "METHODS", "MORE_STEPS", "NODE_RANK", "NODES",
    "NON_NEGATIVE", "NOT_COMPARED_ON_RESUME", "OPTIMIZERS", "PORT", "POSITIVE", "QUEUE_NUMBER", "RETIRED",
    "GradingSettings", "REWARD_FILE_HELP", "REWARD_HELP", "SEBP_KERNELS", "REWARD_NAMES", "ROWS", "SEED", "SHARE", "STEPS", "TEMPERATURE", "TOKENS",
    "Config", "ConfigError", "DPOSettings", "DataSettings", "ESSASettings", "FGRPOSettings", "LoraSettings",
    "ModelSettings", "Range", "RunSettings", "SFTSettings", "cache_dir", "declared", "field_types", "from_dict",
    "load_run_config", "parse_override", "resolve", "resume_changes", "setting", "typed_number", "validate",
    "warm_start_config",
]
