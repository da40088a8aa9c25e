"""The model families edgetune is tested with, and the speed paths each gets on CUDA:
writes docs/support.md.

Each family is a tiny random-init model (2 layers, hidden 64) built offline from
transformers' config class, with the embedded SmolLM2's tokenizer and chat template; the
embedded SmolLM2 itself is the last row. tests/test_families.py runs every family through
SFT, F-GRPO, ESSA and DPO, exports the adapter, reloads it with plain PEFT and plans it; and
checks that docs/support.md equals what `table()` writes now, so the page cannot drift.

The speed-path columns are what the engine decides for an SFT run (packing on) and for
rollouts on a CUDA device, asked from the decision functions themselves
(engine/planning/effective.decide through the planner, engine/generation/fast_decode.supported), since a CPU
has none of these paths.

    python bench/support_table.py            # rewrites docs/support.md
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "support.md"

# family -> (label, transformers config class, model class, settings beyond the shared shape)
FAMILIES = {
    "llama": ("Llama 3", "LlamaConfig", "LlamaForCausalLM", {}),
    "qwen2": ("Qwen2.5", "Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3", "Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "mistral": ("Mistral", "MistralConfig", "MistralForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma 2", "Gemma2Config", "Gemma2ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "gemma3": ("Gemma 3", "Gemma3TextConfig", "Gemma3ForCausalLM",
               {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "phi3": ("Phi-3", "Phi3Config", "Phi3ForCausalLM", {}),
}
EMBEDDED = "smollm2"  # the embedded SmolLM2-135M-Instruct itself (a Llama), not a tiny copy
LABELS = {**{k: v[0] for k, v in FAMILIES.items()}, EMBEDDED: "SmolLM2-135M (embedded)"}
# What tests/test_families.py runs on every family (each test fails if its method does).
TESTED = ("SFT", "F-GRPO", "ESSA", "DPO", "export + PEFT reload", "planner")


def build_tiny(family: str, out: Path, tokenizer_dir: Path) -> Path:
    """A 2-layer, hidden-64 random-init model of `family` (the config class's own other
    defaults, e.g. Gemma's tied embeddings) with the tokenizer of
    `tokenizer_dir`, saved to `out` (seeded: the same weights every time)."""
    import torch
    import transformers

    from edgetune.engine.models.model import load_tokenizer

    _, config_cls, model_cls, extra = FAMILIES[family]
    tok = load_tokenizer(str(tokenizer_dir))
    cfg = getattr(transformers, config_cls)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=512,
        pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id, **extra)
    torch.manual_seed(0)
    getattr(transformers, model_cls)(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def sft_settings(model_dir, runs_dir, **over):
    """The SFT settings every family trains with (and the table plans, packed, on CUDA)."""
    from edgetune.engine.core.settings import resolve

    sft = {"steps": 1, "batch_size": 2, "grad_accum": 1, "lr": 1e-2, "eval_every": 0, "warmup_steps": 0,
           **over}
    return resolve(overrides={
        "method": "sft", "model": {"name": str(model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": "embedded:arith-sft", "max_rows": 16, "max_seq_len": 64, "eval_fraction": 0},
        "run": {"runs_dir": str(runs_dir), "seed": 1, "checkpoint_every": 0}, "sft": sft})


def speed_paths(model_dir: Path) -> dict:
    """What the engine picks on a CUDA device for this model: {column: cell}."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from edgetune.engine.core.arch import arch_from_config, read_model_config

    from edgetune.engine.planning import effective, planner

    from edgetune.engine.generation import fast_decode

    cfg = sft_settings(model_dir, "runs", packing=True)
    GiB = 2**30
    eff = planner.estimate(cfg, gpu_total=80 * GiB, gpu_free=80 * GiB, device="cuda")["effective"]
    arch = arch_from_config(read_model_config(str(model_dir)))
    with torch.device("meta"):  # the module layout only: no weights
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_dir))
    fast, why = fast_decode.supported(model, torch.device("cuda"))
    liger_why = effective.liger_off_reason("auto", "cuda", "sft", arch)
    unpacked = effective.attention("auto", False, "cuda", arch.model_type)
    flex = eff["packing"] and eff["attn_implementation"] == "flex_attention" and type(model)._supports_flex_attn
    return {
        "attention": unpacked if unpacked == "sdpa" else f"{unpacked} (transformers has no sdpa for it)",
        "fast decode": "yes" if fast else f"plain loop: {why}",
        "Liger": "yes" if eff["liger"] else f"off: {liger_why}",
        "SEBP": "yes" if eff["sebp"] else "off",
        "packing / flex": "yes" if flex else f"padded rows ({eff['attn_implementation']})",
    }


def table(folders: dict[str, Path]) -> str:
    """docs/support.md for the families' model folders ({family: folder})."""
    rows = {f: speed_paths(p) for f, p in folders.items()}
    speed = list(next(iter(rows.values())))
    cols = ["family", *TESTED, *speed]
    lines = [
        "# Model families",
        "",
        "Generated by `python bench/support_table.py`; `tests/test_families.py` fails when this page",
        "differs from what it generates. Every family in the table is a tiny random-init model built from",
        "transformers' config class (the embedded SmolLM2 is the real model), trained on the CPU by SFT",
        "(one step), F-GRPO, ESSA and DPO (two steps each, ESSA from the SFT adapter), exported, reloaded",
        "with plain `peft.PeftModel.from_pretrained` (the same logits as the engine's own model with the",
        "adapter) and planned by `edgetune estimate` (deciding what the run decided).",
        "",
        "The speed paths are what the engine decides on a CUDA GPU for a packed SFT run and for",
        "rollouts (`engine/planning/effective.py`, `engine/generation/fast_decode.py`); where one does not apply, the run",
        "takes the named fallback and says why in its `worker.log`. What each path does:",
        "[performance.md](performance.md).",
        "",
        "| " + " | ".join(cols) + " |",
        "|" + "---|" * len(cols),
    ]
    for f, cells in rows.items():
        lines.append("| " + " | ".join([LABELS[f], *["yes"] * len(TESTED), *cells.values()]) + " |")
    return "\n".join(lines) + "\n"


def folders(root: Path) -> dict[str, Path]:
    """Build every tiny family under `root`; {family: folder}, the embedded model last."""
    from edgetune.engine.models.model import embedded_model_dir

    emb = embedded_model_dir()
    out = {f: build_tiny(f, root / f, emb) for f in FAMILIES}
    out[EMBEDDED] = emb
    return out


def main() -> int:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    with tempfile.TemporaryDirectory() as tmp:
        OUT.write_text(table(folders(Path(tmp))))
    print(f"wrote {OUT}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
