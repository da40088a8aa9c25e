"""The model's shape: layer sizes, heads, vocabulary, the projections LoRA can target, read
from a model's `config.json` (or its loaded config) with no torch. The memory planner sizes a
run from it before the weights load; `auto` settings are decided from it
(engine/planning/effective.py); the methods read it from the loaded model (`arch_of`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from edgetune.engine.core.errors import ModelError
from edgetune.engine.core.settings import EMBEDDED_MODEL, cache_dir

# The linear layers of a decoder block that LoRA can target, in the order `all-linear` lists them.
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# The shipped SmolLM2-135M-Instruct's architecture, so the embedded model is planned
# without converting its GGUF file first (that conversion needs torch).
EMBEDDED_CONFIG = {
    "model_type": "llama", "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
    "num_attention_heads": 9, "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152,
    "tie_word_embeddings": True, "attention_bias": False, "mlp_bias": False,
}

# Shapes of common hub models (their published config.json values), so that a preset
# naming one can be planned before the model is downloaded; "-Instruct" shares them.
_QWEN = dict(model_type="qwen2", head_dim=128)
KNOWN_CONFIGS = {
    "Qwen/Qwen2.5-0.5B": dict(_QWEN, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                              num_attention_heads=14, num_key_value_heads=2, head_dim=64, vocab_size=151936,
                              tie_word_embeddings=True),
    "Qwen/Qwen2.5-1.5B": dict(_QWEN, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                              num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                              tie_word_embeddings=True),
    "Qwen/Qwen2.5-3B": dict(_QWEN, hidden_size=2048, intermediate_size=11008, num_hidden_layers=36,
                            num_attention_heads=16, num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True),
    "Qwen/Qwen2.5-7B": dict(_QWEN, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                            num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-14B": dict(_QWEN, hidden_size=5120, intermediate_size=13824, num_hidden_layers=48,
                             num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-32B": dict(_QWEN, hidden_size=5120, intermediate_size=27648, num_hidden_layers=64,
                             num_attention_heads=40, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
    "Qwen/Qwen2.5-72B": dict(_QWEN, hidden_size=8192, intermediate_size=29568, num_hidden_layers=80,
                             num_attention_heads=64, num_key_value_heads=8, vocab_size=152064, tie_word_embeddings=False),
}


@dataclass
class Arch:
    """A decoder model's shape, in the numbers the planner and the methods count with."""

    hidden: int
    intermediate: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    tied: bool
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    experts: int = 0  # MoE: routed experts per layer (0 = dense)
    experts_per_token: int = 0
    model_type: str = ""

    @property
    def q_dim(self) -> int:
        return self.heads * self.head_dim

    @property
    def kv_dim(self) -> int:
        return self.kv_heads * self.head_dim

    def projections(self) -> dict[str, tuple[int, int, int]]:
        """name -> (in_features, out_features, copies per layer)."""
        h, i, e = self.hidden, self.intermediate, max(self.experts, 1)
        return {
            "q_proj": (h, self.q_dim, 1), "k_proj": (h, self.kv_dim, 1), "v_proj": (h, self.kv_dim, 1),
            "o_proj": (self.q_dim, h, 1), "gate_proj": (h, i, e), "up_proj": (h, i, e), "down_proj": (i, h, e),
        }


def _first(d: dict, *keys, default=None):
    for k in keys:
        if d.get(k) is not None:
            return d[k]
    return default


def arch_from_config(c: dict) -> Arch:
    """Arch from a config.json dict (Llama / Qwen / Mistral / Gemma names, GPT-style aliases)."""
    if "text_config" in c and "hidden_size" not in c:
        c = {**c["text_config"], "tie_word_embeddings": c.get("tie_word_embeddings", False)}
    h = _first(c, "hidden_size", "n_embd", "d_model")
    layers = _first(c, "num_hidden_layers", "n_layer", "num_layers")
    heads = _first(c, "num_attention_heads", "n_head")
    vocab = c.get("vocab_size")
    if not all((h, layers, heads, vocab)):
        raise ModelError("config.json lacks hidden size, layer count, head count or vocab size: cannot plan")
    mt = c.get("model_type", "")
    experts = _first(c, "num_local_experts", "num_experts", "n_routed_experts", default=0) or 0
    inter = _first(c, "moe_intermediate_size", default=None) if experts else None
    inter = inter or _first(c, "intermediate_size", "n_inner", "ffn_dim", default=4 * h)
    return Arch(
        hidden=h, intermediate=inter, layers=layers, heads=heads,
        kv_heads=_first(c, "num_key_value_heads", default=heads), head_dim=_first(c, "head_dim", default=h // heads),
        vocab=vocab, tied=bool(c.get("tie_word_embeddings", False)),
        # Qwen2 puts biases on q, k, v without a config key; Llama's `attention_bias` covers q, k, v, o.
        qkv_bias=mt.startswith("qwen2") or bool(c.get("attention_bias")), o_bias=bool(c.get("attention_bias")),
        mlp_bias=bool(c.get("mlp_bias")), experts=experts,
        experts_per_token=_first(c, "num_experts_per_tok", "moe_top_k", default=0) or 0, model_type=mt,
    )


def arch_of(model) -> Arch:
    """The shape of a loaded model (PEFT-wrapped or not), from its config: what the engine
    hands engine/planning/effective.decide once the weights are in memory."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    return arch_from_config(base.config.to_dict())


def _hub_cached_config(name: str) -> Path | None:
    try:
        from huggingface_hub import try_to_load_from_cache
    except ImportError:
        return None
    hit = try_to_load_from_cache(name, "config.json")
    return Path(hit) if isinstance(hit, str) else None


def read_model_config(name: str) -> dict:
    """config.json of a model folder, the embedded model, a GGUF's cached conversion, or a
    hub id already in the local Hugging Face cache."""
    if name == EMBEDDED_MODEL:
        return dict(EMBEDDED_CONFIG)
    p = Path(name).expanduser()
    if p.is_dir():
        f = p / "config.json"
        if not f.is_file():
            raise ModelError(f"{name}: not a Hugging Face model folder (no config.json)")
        return json.loads(f.read_text())
    if p.suffix == ".gguf":
        hits = sorted((cache_dir() / "gguf").glob(f"{p.stem}-*/config.json"))
        if hits:
            return json.loads(hits[-1].read_text())
        raise ModelError(f"{name}: a GGUF file is planned after its first load (its shape is read then)")
    if name.startswith(("/", "./", "../", "~")):
        raise ModelError(f"model path does not exist: {name}")
    hit = _hub_cached_config(name)
    if hit is not None:
        return json.loads(hit.read_text())
    known = KNOWN_CONFIGS.get(name.removesuffix("-Instruct"))
    if known is not None:
        return dict(known)
    raise ModelError(f"model '{name}' is not in the local Hugging Face cache and the hub is not "
                     "contacted to plan: download it first, or give a local folder with its config.json")
