"""How a run's completions are graded: not a settings group of its own, but what each
method's settings say in their `grading()`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class GradingSettings:
    """How a run's completions are graded (engine/training/grading.py): its held-out prompts
    and task files (`edgetune eval --task FILE`). Each method's settings say it, from their
    own fields, in their `grading()`; these defaults grade the runs of a method with no
    reward of its own (its task files)."""

    reward: Any = "last_number"  # REWARD_HELP
    reward_file: str = ""  # REWARD_FILE_HELP
    max_new_tokens: int = 48  # the most tokens of a graded completion
    temperature: float = 0.9  # the pass@k samples' temperature
    top_p: float = 1.0  # and their nucleus
    success_threshold: Any = None  # what counts as success (fgrpo.success_threshold's help)
    eval_k: int = 4  # pass@k from n = 2k samples per prompt (0 = greedy success only)
    eval_prompts: int = 50  # held-out prompts graded (0 = the whole held-out split)
    batch_rows: int = 32  # completions decoded together (a training rollout batch: a size the run fits)
