"""How a setting is declared and what values it allows: `setting()` (a field with its
help, section and allowed values), `Range` and the ranges the groups share, the fields the
optimising methods declare alike, and the one-line checks of a value against its range."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from edgetune.engine.core.errors import ConfigError


def num_text(v: float) -> str:
    """A number as the user would write it: 4294967294, 1, 0.5, 1.000e+300 (not 4.29497e+09,
    nor three hundred digits)."""
    if isinstance(v, int) and abs(v) >= 10**16:
        if v.bit_length() > 10_000:  # more digits than Python turns into text
            return f"{'-' if v < 0 else ''}about 2**{v.bit_length()}"
        d = str(abs(v))
        return f"{'-' if v < 0 else ''}{d[0]}.{d[1:4]}e+{len(d) - 1}"
    return str(int(v)) if float(v).is_integer() and abs(v) < 1e16 else f"{v:g}"


@dataclass(frozen=True)
class Range:
    """Allowed values of a numeric setting: low (excluded when low_open) up to high
    (excluded when high_open); None = unbounded. `words` replaces the generated
    description where a plainer one reads better."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False
    words: str = ""

    def allows(self, v: float) -> bool:
        if self.low is not None and (v < self.low or (self.low_open and v == self.low)):
            return False
        return self.high is None or (v < self.high or (not self.high_open and v == self.high))

    def describe(self) -> str:
        if self.words:
            return self.words
        if self.high is None:
            if self.low == 0 and self.low_open:
                return "must be positive"
            return f"must be >= {num_text(self.low)}"
        lo, hi = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"must be in {lo}{num_text(self.low)}, {num_text(self.high)}{hi}"

    def nearest(self, v: float) -> float | None:
        """The allowed value closest to v, when the bound it crossed is itself allowed."""
        if self.low is not None and v < self.low:
            return None if self.low_open else self.low
        if self.high is not None and v > self.high:
            return None if self.high_open else self.high
        return None


POSITIVE = Range(0, low_open=True)
NON_NEGATIVE = Range(0)
# Upper bounds: far past any run a workstation trains, so that a typo's extra digits (or
# 2**63) are refused where they are typed instead of reaching a progress bar, an int64
# tensor or a memory plan.
MAX_STEPS = 10**7
STEPS = Range(1, MAX_STEPS)  # optimizer steps, generations
EVERY = Range(0, MAX_STEPS)  # every N steps, 0 = never (or: only at the end)
ROWS = Range(1, 2**16)  # rows, prompts or completions handled together
COUNT = Range(0, 10**9)  # rows, prompts or batches to use, 0 = all
TOKENS = Range(1, 2**20)  # tokens of a row or of a completion
TEMPERATURE = Range(0, 100, low_open=True)
SHARE = Range(0, 1, high_open=True)  # [0, 1)
FRACTION = Range(0, 1, low_open=True)  # (0, 1]
# AdamW moves every adapter weight by about lr per step: above 1 that is noise, and a huge
# lr overflows the update to inf/NaN.
LEARNING_RATE = Range(0, 1, low_open=True, words="must be positive and at most 1")
# Every consumer of the seed takes it: numpy's legacy seeding (loop.seed_everything) up to
# 2**32 - 1, and CMA-ES (engine/methods/essa/essa.py), which is handed seed + 1.
SEED = Range(0, 2**32 - 2)

# Numbers typed on the command line (and in the app's fields of the same meaning) that are
# not settings: each checked with `typed_number`.
GPUS = Range(1, 1024)  # --gpus: ranks on this machine
NODES = Range(1, 1024)  # --nnodes
NODE_RANK = Range(0, NODES.high - 1)  # --node-rank
MORE_STEPS = STEPS  # --more-steps: steps added to a run (its steps stay within STEPS too)
PORT = Range(1, 65535)  # edgetune ui --port
CHAT_TOKENS = Range(8, 512)  # the app's Try-it tab: the most tokens of each reply
QUEUE_NUMBER = Range(1, 2**31 - 1)  # edgetune queue: a job's number, and a place in the queue (--to)

OPTIMIZERS = ("auto", "adamw", "adamw_8bit", "paged_adamw_8bit")
AUTO_ON_OFF = ("auto", "on", "off")
# Reward names (engine/training/rewards.py implements them); length_penalty also takes
# length_penalty:<characters>, rg:<task> names a reasoning-gym task, file the reward_file.
REWARD_NAMES = ("answer_format", "exact", "file", "last_number", "length_penalty", "math", "normalized",
                "rg:<task>")


def setting(default: Any, help: str, section: str = "", choices: tuple | None = None,
            range: Range | None = None) -> Any:
    """A settings field: its default, its help text, the section of its group it belongs
    to, and its allowed values (`choices`: a closed set of words; `range`: a Range for a
    number). `validate` checks them; the app shows choices as drop-downs."""
    return field(default=default, metadata={"help": help, "section": section, "choices": choices, "range": range})


# Fields the SFT and F-GRPO groups share, declared once here.


def lr_field(default: float) -> Any:
    return setting(default, "Peak learning rate (linear warmup, then cosine decay).", section="optimisation",
                   range=LEARNING_RATE)


def warmup_steps_field(default: int) -> Any:
    return setting(default, "Steps of linear learning-rate warmup (then cosine decay).", section="optimisation",
                   range=EVERY)


def weight_decay_field() -> Any:
    return setting(0.0, "AdamW weight decay on the adapter.", section="optimisation", range=Range(0, 100))


def max_grad_norm_field() -> Any:
    return setting(1.0, "Clip the gradient norm to this (0 = no clipping).", section="optimisation",
                   range=Range(0, 1e6))


def optimizer_field() -> Any:
    return setting(
        "auto",
        "auto = AdamW (fused on CUDA). paged_adamw_8bit / adamw_8bit (bitsandbytes, CUDA): 2 bytes "
        "of state per LoRA parameter instead of 8, slower per step.",
        section="optimisation", choices=OPTIMIZERS)


def sebp_field(where: str) -> Any:
    return setting(
        "auto",
        f"Exact sparsity-exploiting backward (kernels/){where}: skips the padding rows in the backward of "
        "every linear layer (CUDA). auto = off (measured: see docs/performance.md); on | off.",
        section="speed", choices=AUTO_ON_OFF)


SEBP_KERNELS = ("auto", "indexed", "gather", "runs")


def sebp_kernel_field() -> Any:
    return setting(
        "runs",
        "How SEBP's backward reads the active rows (kernels/sebp.py). runs = cuBLAS on each run of consecutive "
        "rows in place (no copies, nothing compiled or tuned per row count; the fastest measured: "
        "bench/README.md); auto = per kind of layer, the faster of indexed and gather, measured on its first "
        "backward; indexed = Triton GEMMs reading the rows by index in their loads; gather = copies of the "
        "rows, then cuBLAS.",
        section="speed", choices=SEBP_KERNELS)


def samples_field(where: str) -> Any:
    return setting(3, f"Held-out prompts shown with the model's greedy completion and the reference at each "
                      f"evaluation{where} (0 = none).", section="evaluation", range=Range(0, 20))


REWARD_HELP = ("math | exact | normalized | last_number | answer_format | length_penalty[:chars] | "
               "rg:<task> | file (the function in reward_file), or {name: weight, ...} summed")
REWARD_FILE_HELP = ("A local .py file with `def reward(completion, answer, row) -> float`. It runs as ordinary "
                    "Python with your rights (files, network): use only code you trust.")
MAX_NEW_TOKENS_HELP = "The most tokens a completion may have."


def brief(value: Any, n: int = 60) -> str:
    """repr(value) for a message, at most `n` characters (a pasted megabyte stays one short line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return num_text(value)
    text = repr(value)
    return text if len(text) <= n else text[: n - 1] + "…"


def check_finite(path: str, value: Any) -> None:
    """inf and nan pass every range check written as comparisons; the run would then end
    "finished" with an adapter of NaNs."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value}")


def check_range(path: str, value: Any, rng: Range) -> None:
    check_finite(path, value)
    if value is None or not rng.allows(value):
        near = None if value is None else rng.nearest(value)
        hint = f" (nearest allowed: {num_text(near)})" if near is not None else ""
        shown = num_text(value) if isinstance(value, int) and not isinstance(value, bool) else value
        raise ConfigError(f"{path} {rng.describe()}, got {shown}{hint}")
