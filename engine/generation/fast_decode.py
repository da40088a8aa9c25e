"""The fast rollout loop: a static KV cache and one decode step replayed as a CUDA graph.

Selection (rollouts.generate): fast=None uses this loop whenever the model is on CUDA and
of a known layout (below); bf16_weights=None adds a packed bf16 copy of the base when it is
NF4 and the GPU's free memory holds it, else a copy of as many layers as it holds. On the
CPU it runs eagerly over an fp32 copy of a base in NF4 or 16 bits, when the host's
available memory holds it twice over (`host_copy_wanted`); else the plain loop. How much
faster than `model.generate` it decodes: bench/README.md.

Why it is faster than `model.generate` for rollouts:
- Launch overhead: one decode step of a 7B model with unmerged LoRA is thousands of small
  kernels; launched from Python that costs far more time per step than the GPU needs to
  read the weights once. The step is captured once per (batch, cache length) and generate
  call as a CUDA graph and replayed: the CPU cost per step becomes one graph launch plus a
  handful of sampling kernels, queued ahead of the GPU. What remains is GPU time of those
  many small kernels (norms, casts, rotary, thin LoRA GEMMs): the reason for packing below.
- No growing cache: K/V live in buffers of the final length allocated once (sized with the
  planner's formula, engine/planning/planner.py, see `reserve_bytes`), written in place at one index
  per step. Attention reads the whole buffer with a validity mask: the wasted reads of
  unwritten slots are small next to the weights.
- Optional bf16 copy of NF4 base weights (`bf16_weights`): an NF4 matmul at decode batch
  sizes dequantises every weight every step (read 4-bit, write and read bf16). For one
  generate call only, each Linear4bit's weight is dequantised once (exactly the bf16 values
  bitsandbytes computes with) and packed (see "packed weights"); LoRA stays unmerged, in
  its own dtype. Costs 2 bytes per base weight during the call; `None` = on when the GPU's
  free memory holds the copy, the static cache and a margin (see `bf16_copy_fits`).
- A copy of some layers (`base_path` "mixed"): when the whole bf16 copy does not fit (a 72B
  base), the first layers that do get it and the rest stay NF4, packed the same way, their
  packs calling bitsandbytes: the card's spare memory becomes decode speed in proportion.
  The copy is taken from the memory free at the call, after the chunk's static cache and
  prefill (under the process's allocator cap and model.memory_budget_gib, see
  `free_for_copies`), and given back when the call ends; the planner does not count it.

Rows keep their order for the whole decode (finished rows are fed pad and masked), so
per-row adapters stay aligned; graphs live for one generate call, so adapter weights
written between calls (ESSA) are always seen.

Per-row adapters (ESSA's batched population, engine/generation/multilora.py): inside `batched_lora`
with candidate-major row blocks, each pack holds the K candidates' factors stacked
(A [K, R, in], block-diagonal scaling*B [K, N, R]) and applies them with two `bmm`s over
the rows viewed as [K, B/K, in]: as many kernels as one adapter, and the base GEMM (bf16
copy or NF4) runs once for all K*P rows, so K candidates decode at close to the speed of
plain inference of K*P rows. Costs: the packed stacks are a copy of the K adapters for
the call (B block-diagonal: 3x its size for q|k|v, 2x for gate|up); and a graph is
captured per generate call for its (K*P rows, cache length), so an ESSA chunk of another K
(the last, smaller one) takes its own capture. The stacks are copied when the call
starts, so every chunk reads its own candidates. Without packing (no dense copy, or rows
not in candidate-major blocks) the step calls the patched LoRA forwards (multilora's bmm,
or its per-row gather), which the graph captures as well. Prefill uses the model's own
forward (a DynamicCache whose K/V are copied into the static buffers). Supported: decoder
layouts of the Llama family (llama, mistral, qwen2, qwen3: embed/layers/norm/rotary_emb,
q/k/v/o projections, optional q/k norms); other models fall back to the plain loop. On the
CPU the same step runs eagerly (no graph), which is how the tests check it against
`model.generate`.
"""

from __future__ import annotations

import contextlib
import sys
import time
import types
import weakref

import torch
import torch.nn.functional as F
from torch import Tensor

from edgetune.engine.core.errors import reason_line

from edgetune.engine.generation.decoding import Sampler, cache_kw, decode_plain, inner_model

FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
SYNC_EVERY = 8  # steps between host checks of "all rows done" (each check drains the queue)


def supported(model, device, require_cuda: bool = True) -> tuple[bool, str]:
    if require_cuda and device.type != "cuda":
        return False, "the model is not on CUDA"
    core = inner_model(model)
    cfg = core.config
    if cfg.model_type not in FAMILIES:
        return False, f"model type '{cfg.model_type}' has no static decoder (known: {', '.join(FAMILIES)})"
    body = getattr(core, "model", None)
    for name in ("embed_tokens", "layers", "norm", "rotary_emb"):
        if not hasattr(body, name):
            return False, f"model has no .model.{name}"
    attn = body.layers[0].self_attn
    for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
        if not hasattr(attn, name):
            return False, f"attention has no {name}"
    if getattr(core, "lm_head", None) is None:
        return False, "model has no lm_head"
    return True, ""


# --------------------------------------------------------------------------- bf16 copy


def linear4bit_modules(model):
    try:
        import bitsandbytes as bnb
    except ImportError:
        return []
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def bf16_copy_bytes(model) -> int:
    return sum(m.in_features * m.out_features * 2 for m in linear4bit_modules(model))


def reserve_bytes(model, rows: int, prompt_len: int, cache_len: int) -> int:
    """What a decode of `rows` rows needs beside any copy of the base: its KV cache of
    `cache_len` positions and the prefill's transient over `prompt_len` tokens, by the
    planner's formulas (engine/planning/planner.py), so that the plan and the loop agree."""
    from edgetune.engine.core.arch import arch_of

    from edgetune.engine.planning.planner import decode_ctx, kv_cache_bytes, prefill_bytes

    act = inner_model(model).get_input_embeddings().weight.dtype.itemsize  # the residual stream's dtype
    ctx = decode_ctx(arch_of(model), "nf4" if linear4bit_modules(model) else "none", act)
    return kv_cache_bytes(ctx, rows, cache_len) + prefill_bytes(ctx, rows, prompt_len)


def host_copy_bytes(model) -> int:
    """Bytes of an fp32 copy of the base's linear layers (the CPU's decode copy)."""
    return sum(m.in_features * m.out_features * 4 for m in _base_linears(model))


def _base_linears(model) -> list:
    """The decoder layers' base linears, the ones a pack copies (NF4 or dense)."""
    out = []
    for layer in inner_model(model).model.layers:
        at, mlp = layer.self_attn, layer.mlp
        for m in (at.q_proj, at.k_proj, at.v_proj, at.o_proj, mlp.gate_proj, mlp.up_proj, mlp.down_proj):
            out.append(getattr(m, "base_layer", m))
    return out


def host_available() -> int | None:
    """Bytes of RAM the host can still give (MemAvailable), or None where unknown."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def host_copy_wanted(model, device) -> bool:
    """On the CPU, decode over an fp32 copy of a base held in NF4 or 16 bits: the CPU's
    kernels for those (bitsandbytes' NF4, bf16 without AMX) are several times slower than
    its fp32 GEMMs at decode batch sizes. Taken when the host's available memory holds
    the copy twice over (the copy, and room for everything else)."""
    if device.type != "cpu":
        return False
    linears = _base_linears(model)
    if not linears or all(type(m) is torch.nn.Linear and m.weight.dtype == torch.float32 for m in linears):
        return False
    free = host_available()
    return free is not None and free >= 2 * host_copy_bytes(model)


def free_for_copies(memory_budget: int | None = None) -> tuple[int, int]:
    """(bytes this process may still take, card total): the card's free memory, and no
    more than the allocator's per-process cap (torch.cuda.set_per_process_memory_fraction,
    e.g. a run held to 80 GB on a bigger card) or `memory_budget` (bytes the process may
    hold: model.memory_budget_gib) leaves."""
    free, total = torch.cuda.mem_get_info()
    frac = torch.cuda.get_per_process_memory_fraction()
    if frac < 1.0:
        free = min(free, int(frac * total) - torch.cuda.memory_reserved())
    if memory_budget:
        free = min(free, memory_budget - torch.cuda.memory_reserved())
    return free, total


def copy_margin(total: int) -> int:
    """Memory a copy of the base leaves free beside its reserve: max(2 GiB, 5% of the
    card), for the allocator's slack and logits."""
    return max(2 << 30, total // 20)


def bf16_copy_fits(model, reserve_bytes: int, memory_budget: int | None = None) -> bool:
    """Free GPU memory holds the copy, `reserve_bytes` (static cache, prefill) and
    `copy_margin`."""
    free, total = free_for_copies(memory_budget)
    return free >= bf16_copy_bytes(model) + reserve_bytes + copy_margin(total)


def layer_copy_bytes(model) -> list[int]:
    """Bytes of a bf16 copy of each decoder layer's NF4 linears, in layer order."""
    import bitsandbytes as bnb

    return [sum(m.in_features * m.out_features * 2 for m in layer.modules() if isinstance(m, bnb.nn.Linear4bit))
            for layer in inner_model(model).model.layers]


def dense_layers_that_fit(model, reserve_bytes: int, memory_budget: int | None = None) -> int:
    """How many decoder layers, from the first, get a bf16 copy in the GPU's free memory
    next to `reserve_bytes` and `copy_margin`."""
    free, total = free_for_copies(memory_budget)
    room = free - reserve_bytes - copy_margin(total)
    n = 0
    for b in layer_copy_bytes(model):
        if b > room:
            break
        room -= b
        n += 1
    return n


def base_path(model, device, bf16_weights: bool | None, reserve_bytes: int,
              dense_layers: int | None = None, memory_budget: int | None = None,
              nf4_kernel: str = "off", rows: int = 0) -> str:
    """How the decode step computes the base linears: "dense" (a packed dense copy: bf16
    for NF4 layers, the weights themselves otherwise), "mixed" (a packed bf16 copy of the
    first decoder layers, the others on their NF4 codes through bitsandbytes), "module"
    (the layers' own forward: bitsandbytes for NF4), "kernel" (every NF4 layer on its
    codes through kernels/nf4_matmul.py) or "mixed_kernel" (a copy of the first layers,
    the others through that kernel). None picks, with the free memory and the decode's
    `rows`, as engine/planning/effective.nf4_decode_base says for `nf4_kernel` (off: the
    bf16 copy when it fits, cuBLAS on bf16 decoding fastest; else as many layers' copies
    as fit, e.g. 72B on a 141 GB card; else bitsandbytes). On the CPU the copy is fp32,
    taken when host_copy_wanted says so, unless `nf4_kernel` puts the NF4 layers on the
    kernel (tests, benches: the kernel is CUDA's, Effective.nf4_kernel is off on the CPU).
    dense_layers forces the mixed split (tests, benches)."""
    from edgetune.engine.planning.effective import nf4_decode_base

    nf4 = bool(linear4bit_modules(model))
    cuda = device.type == "cuda"
    n_layers = len(inner_model(model).model.layers)
    if not cuda and dense_layers is None and bf16_weights is None:
        kernel = nf4 and nf4_decode_base(nf4_kernel, rows, n_layers, 0)[1] == "nf4kernel"
        bf16_weights = None if kernel else host_copy_wanted(model, device)  # the CPU's fp32 copy
    if not nf4:
        return "dense" if bf16_weights else "module"
    if bf16_weights and (cuda or dense_layers is None):  # the GPU's bf16 copy, the CPU's fp32 one
        return "dense"
    if dense_layers is not None and bf16_weights is not False:  # the split asked for
        if dense_layers >= n_layers:
            return "dense"
        return "mixed_kernel" if nf4_decode_base(nf4_kernel, rows, n_layers, 0)[1] == "nf4kernel" else "mixed"
    fit = 0
    if bf16_weights is None and cuda:
        fit = (n_layers if bf16_copy_fits(model, reserve_bytes, memory_budget)
               else dense_layers_that_fit(model, reserve_bytes, memory_budget))
    copied, rest = nf4_decode_base(nf4_kernel, rows, n_layers, fit)
    if copied >= n_layers:
        return "dense"
    if copied > 0:
        return "mixed_kernel" if rest == "nf4kernel" else "mixed"
    return "kernel" if rest == "nf4kernel" else "module"


class ModulePack:
    """The base of one pack left to its Linear4bit layers' own forward (bitsandbytes,
    their own biases included): each computes its slice, concatenated into one [M, sum N]
    output (the NF4 layers of a "mixed" decode)."""

    def __init__(self, mods):
        self.mods = mods
        self.shape = (sum(m.out_features for m in mods), mods[0].in_features)

    def linear(self, x: Tensor, bias: Tensor | None) -> Tensor:
        ys = [m(x) for m in self.mods]
        return torch.cat(ys, dim=-1) if len(ys) > 1 else ys[0]


class NF4KernelPack:
    """The base of one pack computed straight from its Linear4bit layers' 4-bit storage by
    kernels/nf4_matmul.py (no copy of the weights): one launch a layer, each writing its
    columns of one bf16 [M, sum N] output, with the pack's bias and its LoRA product
    (mid = X·Aᵀ, one small GEMM for the pack, times Bd) in the kernel's epilogue. Raises
    ValueError for storage the kernel does not read (e.g. repacked by bitsandbytes' CPU
    forward) or a layer that does not compute in bf16."""

    dtype = torch.bfloat16  # the kernel's output, and Linear4bit's compute dtype it stands for

    def __init__(self, mods):
        from edgetune.kernels.nf4_matmul import nf4_weight

        for m in mods:
            if getattr(m, "compute_dtype", None) not in (None, torch.bfloat16):
                raise ValueError(f"a Linear4bit computes in {m.compute_dtype} (the NF4 kernel in bf16)")
        self.weights = [nf4_weight(m.weight.data, m.weight.quant_state) for m in mods]
        self.shape = (sum(w.n for w in self.weights), self.weights[0].k)

    def linear(self, x: Tensor, bias: Tensor | None, a: Tensor | None = None, bd: Tensor | None = None) -> Tensor:
        from edgetune.kernels.nf4_matmul import nf4_matmul

        out = torch.empty(x.shape[0], self.shape[0], dtype=torch.bfloat16, device=x.device)
        mid = F.linear(x.to(a.dtype), a) if a is not None else None
        col = 0
        for w in self.weights:
            end = col + w.n
            nf4_matmul(x, w, bias[col:end] if bias is not None else None, mid,
                       bd[col:end] if mid is not None else None, out=out, column=col)
            col = end
        return out


@contextlib.contextmanager
def bf16_base_weights(model):
    """Swap every Linear4bit's forward to a matmul with a dequantised bf16 copy; undone on
    exit (the NF4 weights are never modified)."""
    import bitsandbytes.functional as bnbF

    mods = linear4bit_modules(model)
    try:
        for m in mods:
            w = bnbF.dequantize_4bit(m.weight.data, m.weight.quant_state).to(torch.bfloat16)
            m.forward = types.MethodType(_dense_forward(w), m)
        yield len(mods)
    finally:
        for m in mods:
            m.__dict__.pop("forward", None)


def _trains_whole_modules(model) -> bool:
    """Whether an adapter of the model holds more than LoRA factors (modules_to_save, trainable
    tokens): turning the adapter off would change those too."""
    from peft.utils.other import AuxiliaryTrainingWrapper

    return any(isinstance(m, AuxiliaryTrainingWrapper) for m in model.modules())


def copy_views(core, parts: list) -> list[tuple]:
    """(Linear4bit module, its rows of a dense pack) of every NF4 layer a dense pack copies:
    the prefill computes over the same copy (views, no more memory)."""
    out = []
    for layer, packs in zip(core.model.layers, parts):
        at, mlp = layer.self_attn, layer.mlp
        for mods, (w, _, _, _) in zip(([at.q_proj, at.k_proj, at.v_proj], [at.o_proj], [mlp.gate_proj, mlp.up_proj],
                                       [mlp.down_proj]), packs):
            if not isinstance(w, Tensor):
                continue
            row = 0
            for m in mods:
                base = getattr(m, "base_layer", m)
                if type(base).__name__ == "Linear4bit":
                    out.append((base, w[row:row + base.out_features]))
                row += base.out_features
    return out


@contextlib.contextmanager
def over_host_copy(model):
    """Inside, on the CPU, the model's NF4 linears compute over the fp32 copy the decode
    loop keeps (host_copy_wanted), whatever calls the forward (model.generate for chat).
    Yields whether they do."""
    device = next(model.parameters()).device
    core = inner_model(model)
    parts = None
    if supported(model, device, require_cuda=False)[0] and host_copy_wanted(model, device):
        try:
            parts = pack_model(core, dtype=torch.float32)
        except ValueError:
            parts = None
    if parts is None:
        yield False
        return
    with dense_forwards(copy_views(core, parts)):
        yield True


@contextlib.contextmanager
def dense_forwards(views: list[tuple]):
    """Each (Linear4bit, dense weight) computes over that weight until exit."""
    try:
        for m, w in views:
            m.forward = types.MethodType(_dense_forward(w), m)
        yield
    finally:
        for m, _ in views:
            m.__dict__.pop("forward", None)


def _dense_forward(w: Tensor):
    def forward(self, x):
        # same dtypes in and out as Linear4bit (compute in bf16, return the input's dtype)
        b = self.bias.to(w.dtype) if self.bias is not None else None
        return F.linear(x.to(w.dtype), w, b).to(x.dtype)

    return forward


# --------------------------------------------------------------------------- packed weights
# With a dense copy anyway (the bf16 copy of NF4 layers), pack it for the decode step:
# q|k|v and gate|up as one matrix each, and the LoRA factors of a pack as one stacked A
# [sum r, in] and one block-diagonal scaling*B [out, sum r]. A layer then costs 4 base
# GEMMs + 8 thin LoRA GEMMs instead of 7 + 14, with one input cast per pack: at batch
# 64 the step is bound by the number of small kernels, not only by weight bytes. The
# LoRA factors are copied at the start of each generate call (they do not change during
# one), so LoRA stays unmerged and exact in its own dtype. Plain LoRA layers are packed from
# their own adapters, layers inside multilora.batched_lora (candidate-major blocks) from
# the candidates' stacks (a leading K dimension); other patched or hooked forwards are not
# packed (the module path runs them).


def _base_and_lora(mod, base_kind: str = "dense"):
    """(base weight, bias, [(A, scaling * B)]) of a plain or PEFT-LoRA linear, or a reason.
    The base weight is dense (NF4 layers dequantised to bf16; base_kind "dense") or the
    Linear4bit module itself ("module", "nf4kernel").
    Inside multilora.batched_lora the factors are the candidates' stacks (A [K, r, in],
    scaling * B [K, out, r]) instead of the layer's own adapters."""
    import bitsandbytes.functional as bnbF

    loras = []
    base = mod
    per_row = getattr(mod, "_multilora", None)  # set by multilora.batched_lora
    if per_row is not None:
        a, b, scaling, _, blocks = per_row
        if not blocks:
            return None, None, None, "per-row adapters are not in candidate-major blocks"
        loras.append((a.detach(), b.detach() * scaling))
        base = mod.base_layer
    elif hasattr(mod, "base_layer") and hasattr(mod, "lora_A"):
        if "forward" in mod.__dict__ or mod._forward_hooks or mod._forward_pre_hooks:
            return None, None, None, "a LoRA layer's forward is patched or hooked"
        if getattr(mod, "merged", False):
            return None, None, None, "LoRA is merged"
        if not mod.disable_adapters:
            for ad in mod.active_adapters:
                if ad not in mod.lora_A:
                    continue
                if ad in getattr(mod, "lora_variant", {}) or getattr(mod, "use_dora", {}).get(ad):
                    return None, None, None, "a LoRA variant (DoRA, ...) is active"
                a = mod.lora_A[ad].weight.detach()
                b = mod.lora_B[ad].weight.detach() * mod.scaling[ad]
                if b.any():  # a fresh adapter's B is zero: its product adds exactly nothing
                    loras.append((a, b))
        base = mod.base_layer
    if type(base).__name__ == "Linear4bit" and base_kind in ("module", "nf4kernel"):
        w = base
    elif type(base).__name__ == "Linear4bit" and getattr(base.weight.quant_state, "packing_format_for_cpu", False):
        w = _dequantize_cpu_layout(base.weight.data, base.weight.quant_state)
    elif type(base).__name__ == "Linear4bit":
        w = bnbF.dequantize_4bit(base.weight.data, base.weight.quant_state).to(torch.bfloat16)
    elif isinstance(base, torch.nn.Linear):
        w = base.weight.detach()
    else:
        return None, None, None, f"unknown base layer {type(base).__name__}"
    return w, base.bias, loras, ""


def _dequantize_cpu_layout(weight: Tensor, qs) -> Tensor:
    """bf16 [N, K] of an NF4 weight that bitsandbytes repacked for its CPU kernel (on the
    layer's first CPU forward), which its dequantize_4bit does not read back: the codes
    put back in row order, times the bf16 absmax [K / blocksize, N] it keeps beside them,
    which is what its CPU matmul computes with."""
    import bitsandbytes.functional as bnbF

    N, K = qs.shape
    data = weight.view(torch.uint8) if weight.dtype != torch.uint8 else weight
    packed = data.reshape(-1, 32)
    codes = torch.cat([packed & 0xF, (packed >> 4) & 0xF], dim=-1)
    codes = codes.reshape(N // 32, K // 2, 32, 2).transpose(-3, -2).reshape(N, K).long()
    table = bnbF.get_4bit_type("nf4", device=data.device).float()
    absmax = qs.absmax.t().float()  # [N, K / blocksize]
    values = table[codes].reshape(N, K // qs.blocksize, qs.blocksize) * absmax[..., None]
    return values.reshape(N, K).to(torch.bfloat16)


def pack_linears(mods, base_kind: str = "dense", dtype: torch.dtype | None = None) -> tuple:
    """One pack (w [N, K], bias or None, A [R, K] or None, B [N, R] or None) of linears that
    read the same input; w is a dense tensor ("dense", in `dtype` when given), a ModulePack
    ("module": NF4 layers through bitsandbytes) or an NF4KernelPack ("nf4kernel": NF4 layers
    through kernels/nf4_matmul.py); raises ValueError when one cannot be packed. A dense
    pack in `dtype` (the CPU's fp32 copy) is kept in _HOST_COPIES and reused."""
    kept = _HOST_COPIES.get(mods[0]) if dtype is not None and base_kind == "dense" else None
    kept = kept if kept is not None and kept[0] == dtype else None
    parts = [_base_and_lora(m, "module" if kept else base_kind) for m in mods]  # "module": no new copy
    for _, _, _, why in parts:
        if why:
            raise ValueError(why)
    ws = [p[0] for p in parts]
    on_codes = base_kind in ("module", "nf4kernel")  # the base stays NF4
    if kept is not None:
        w, bias = kept[1], kept[2]
        sizes = [x.out_features if isinstance(x, torch.nn.Module) else x.shape[0] for x in ws]
    elif on_codes:
        if not all(type(x).__name__ == "Linear4bit" for x in ws):
            raise ValueError("a pack mixes NF4 and dense base layers")
        w = ModulePack(ws) if base_kind == "module" else NF4KernelPack(ws)
    elif len({w.dtype for w in ws}) != 1:
        raise ValueError("base weights of one pack differ in dtype")
    else:
        ws = [x.to(dtype) for x in ws] if dtype is not None else ws
        w = torch.cat(ws) if len(ws) > 1 else ws[0].clone()
    if kept is None:
        sizes = [x.out_features if on_codes else x.shape[0] for x in ws]
        bias = None
        if any(p[1] is not None for p in parts) and base_kind != "module":  # the modules add their own
            # (the NF4 kernel adds it in its epilogue, in bf16 as Linear4bit does)
            dev = next(p[1] for p in parts if p[1] is not None).device
            bias = torch.cat([p[1].detach().to(w.dtype) if p[1] is not None
                              else torch.zeros(n, dtype=w.dtype, device=dev) for p, n in zip(parts, sizes)])
        if dtype is not None and base_kind == "dense":
            _HOST_COPIES[mods[0]] = (dtype, w, bias)
    loras = [(i, a, b) for i, p in enumerate(parts) for a, b in p[2]]
    if not loras:
        return (w, bias, None, None)
    if len({a.dtype for _, a, _ in loras}) != 1:
        raise ValueError("LoRA factors differ in dtype")
    loras = _same_candidates(loras)
    A = torch.cat([a for _, a, _ in loras], dim=-2)
    Bd = A.new_zeros(*A.shape[:-2], w.shape[0], A.shape[-2])
    offs = [0]
    for n in sizes:
        offs.append(offs[-1] + n)
    r0 = 0
    for i, a, b in loras:
        r = a.shape[-2]
        Bd[..., offs[i]:offs[i + 1], r0:r0 + r] = b.to(A.dtype)
        r0 += r
    if isinstance(w, NF4KernelPack) and A.dim() == 2:  # the kernel's epilogue takes a rank of 2^n >= 16
        from edgetune.kernels.nf4_matmul import padded_rank

        pad = padded_rank(A.shape[0]) - A.shape[0]
        A, Bd = F.pad(A, (0, 0, 0, pad)), F.pad(Bd, (0, pad))
    return (w, bias, A, Bd)


# The CPU's fp32 copy of each pack's base (w, bias), by the pack's first module, kept while
# the model lives: the base never changes, so each generate call (a chat reply, a training
# step's rollouts) reuses it; LoRA factors are read again at each call.
_HOST_COPIES: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _same_candidates(loras: list) -> list:
    """Per-candidate stacks ([K, r, in]) and shared factors ([r, in]) in one pack: the
    shared ones are expanded (views, no copies) to the K candidates."""
    ks = {a.shape[0] for _, a, _ in loras if a.dim() == 3}
    if not ks:
        return loras
    if len(ks) != 1:
        raise ValueError(f"per-row adapters of one pack have different candidate counts {sorted(ks)}")
    k = ks.pop()
    return [(i, a if a.dim() == 3 else a.expand(k, *a.shape), b if b.dim() == 3 else b.expand(k, *b.shape))
            for i, a, b in loras]


def pack_model(core, base_kind: str = "dense", dense_layers: int | None = None,
               dtype: torch.dtype | None = None) -> list:
    """Packs of every decoder layer, the base as `base_kind` ("dense", "module", "nf4kernel"); with
    dense_layers, the first that many layers dense and the rest as base_kind (the "mixed"
    path). `dtype`: the dense copies' (None: bf16 for NF4 layers, the weights' own else)."""
    if getattr(core.config, "hidden_act", "silu") != "silu":
        raise ValueError(f"activation {core.config.hidden_act} (packed step knows silu)")
    out = []
    for i, layer in enumerate(core.model.layers):
        kind = "dense" if dense_layers is not None and i < dense_layers else base_kind
        at, mlp = layer.self_attn, layer.mlp
        out.append((pack_linears([at.q_proj, at.k_proj, at.v_proj], kind, dtype),
                    pack_linears([at.o_proj], kind, dtype),
                    pack_linears([mlp.gate_proj, mlp.up_proj], kind, dtype), pack_linears([mlp.down_proj], kind, dtype)))
    return out


def packed_linear(x: Tensor, p: tuple) -> Tensor:
    """What the module path computes (base in the copy's dtype, back to x's dtype, plus
    LoRA in its own dtype), over one pack."""
    w, b, a, bd = p
    if isinstance(w, NF4KernelPack):
        if a is not None and a.dim() == 2:  # LoRA in the kernel's epilogue
            return w.linear(x, b, a, bd).to(x.dtype)
        y = w.linear(x, b).to(x.dtype)
    elif isinstance(w, ModulePack):
        y = w.linear(x, b).to(x.dtype)
    else:
        y = F.linear(x.to(w.dtype), w, b).to(x.dtype)
    if a is not None and a.dim() == 3:
        # K candidates' factors (A [K, R, in], B [K, N, R]) over candidate-major row blocks:
        # rows viewed as [K, B/K, in], two batched thin GEMMs, no gather of factors per row.
        k, n = a.shape[0], x.shape[0]
        if n % k:
            raise RuntimeError(f"per-row adapters: {n} rows do not split into {k} candidate blocks")
        mid = torch.bmm(x.to(a.dtype).reshape(k, n // k, x.shape[-1]), a.transpose(1, 2))
        if y.dtype == bd.dtype:
            return torch.baddbmm(y.reshape(k, n // k, -1), mid, bd.transpose(1, 2)).reshape(n, -1)
        return y + torch.bmm(mid, bd.transpose(1, 2)).reshape(n, -1).to(y.dtype)
    if a is not None:
        mid = F.linear(x.to(a.dtype), a)
        if y.dtype == bd.dtype:
            y = torch.addmm(y, mid, bd.t())
        else:
            y = y + F.linear(mid, bd).to(y.dtype)
    return y


def attend(q: Tensor, kc: Tensor, vc: Tensor, keep: Tensor, scaling: float) -> Tensor:
    """One new token's attention [B, heads * D]: q [B, heads, 1, D] against the cache
    kc / vc [B, kv, L, D] where `keep` [B, 1, 1, L]. On CUDA grouped-query without
    repeating K/V ([B, kv, g, D] @ [B, kv, D, L]), softmax in fp32 as the fused kernels do
    (what the graph captures); on the CPU its fused attention kernel."""
    B, n_heads, _, head_dim = q.shape
    if not kc.is_cuda:
        return F.scaled_dot_product_attention(q.to(kc.dtype), kc, vc, attn_mask=keep, scale=scaling,
                                              enable_gqa=True).reshape(B, n_heads * head_dim)
    n_kv = kc.shape[1]
    qg = q.reshape(B, n_kv, n_heads // n_kv, head_dim).to(kc.dtype)
    s = torch.matmul(qg, kc.transpose(-1, -2)).float() * scaling
    p = s.masked_fill(~keep, float("-inf")).softmax(-1).to(vc.dtype)
    return torch.matmul(p, vc).reshape(B, n_heads * head_dim)


def packed_step(core, rotary, n_heads: int, n_kv: int, head_dim: int, tok, pos, t, valid, ks, vs, parts,
                logits_out) -> None:
    """One decode step over packed weights (a plain function of tensors: what the CUDA
    graph captures)."""
    body = core.model
    B = tok.shape[0]
    valid.index_fill_(1, t, True)
    keep = valid[:, None, None, :]
    h = body.embed_tokens(tok)
    cos, sin = body.rotary_emb(h[:, None], pos[:, None])
    nq, nk = n_heads * head_dim, n_kv * head_dim
    for i, layer in enumerate(body.layers):
        qkv, o_p, gu, down = parts[i]
        attn = layer.self_attn
        y = packed_linear(layer.input_layernorm(h), qkv)
        q = y[:, :nq].reshape(B, 1, n_heads, head_dim)
        k = y[:, nq:nq + nk].reshape(B, 1, n_kv, head_dim)
        v = y[:, nq + nk:].reshape(B, 1, n_kv, head_dim).transpose(1, 2)
        if getattr(attn, "q_norm", None) is not None:
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k = rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
        kc, vc = ks[i], vs[i]
        kc.index_copy_(2, t, k.to(kc.dtype))
        vc.index_copy_(2, t, v.to(vc.dtype))
        o = attend(q, kc, vc, keep, attn.scaling).to(h.dtype)
        h = h + packed_linear(o, o_p)
        y = packed_linear(layer.post_attention_layernorm(h), gu)
        half = y.shape[1] // 2
        h = h + packed_linear(F.silu(y[:, :half]) * y[:, half:], down)
    logits_out.copy_(core.lm_head(body.norm(h)).float())


# --------------------------------------------------------------------------- decoder


class Decoder:
    """Holds what one `generate` call reuses across its chunks: the model pieces, and one
    captured graph per (batch, cache length)."""

    def __init__(self, model):
        self.model = model
        self.core = inner_model(model)
        cfg = self.core.config
        self.body = self.core.model
        self.layers = list(self.body.layers)
        self.n_heads = cfg.num_attention_heads
        self.n_kv = cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.window = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        self.rotary = getattr(sys.modules[type(self.layers[0].self_attn).__module__], "apply_rotary_pos_emb")
        self.device = next(model.parameters()).device
        self.use_graph = self.device.type == "cuda"
        self.graphs: dict = {}
        self.parts: list | None = None  # packed weights (see pack_model), when used
        self.views: list = []  # the NF4 layers' rows of a dense copy, for the prefill (copy_views)
        self.no_lora = False  # the packs hold no LoRA product: the prefill skips the adapter's
        self.info = {"graph": self.use_graph, "bf16_weights": False, "packed": False, "dense_layers": None,
                     "capture_s": 0.0, "graph_error": "", "prefill_s": 0.0, "loop_s": 0.0, "steps": 0}

    @classmethod
    @contextlib.contextmanager
    def for_model(cls, model, bf16_weights: bool | None = None, reserve_bytes: int = 0,
                  dense_layers: int | None = None, memory_budget: int | None = None,
                  nf4_kernel: str = "off", rows: int = 0):
        """bf16_weights: a dense copy of the base weights for the decode step (bf16 for NF4
        layers), packed when the layout allows, else swapped into the Linear4bit layers.
        None = on for NF4 models on CUDA when it fits, else a copy of as many layers as fit
        (packed; the other layers' packs call bitsandbytes). On the CPU an fp32 copy, kept
        between calls, of a base in NF4 or 16 bits when host_copy_wanted says so, or when
        asked (tests: a plain fp32 model then gets a packed fp32 copy). dense_layers: the copy
        for the first that many layers only. memory_budget: bytes the process may hold;
        the copy stays within it. nf4_kernel (Effective.nf4_kernel) and rows (of one decode):
        NF4 layers without a copy through kernels/nf4_matmul.py where
        effective.nf4_decode_base says so. The choice is `base_path`'s."""
        dec = cls(model)
        nf4 = bool(linear4bit_modules(model))
        path = base_path(model, dec.device, bf16_weights, reserve_bytes, dense_layers, memory_budget,
                         nf4_kernel, rows)
        bf16_weights = path == "dense"
        dec.info["nf4_kernel"] = path in ("kernel", "mixed_kernel")
        # the CPU's copy is fp32 (its fp32 GEMMs are its fastest), the GPU's bf16
        dtype = torch.float32 if dec.device.type == "cpu" and (nf4 or host_copy_wanted(model, dec.device)) else None
        with contextlib.ExitStack() as stack:
            if path in ("mixed", "mixed_kernel", "kernel"):
                n = 0 if path == "kernel" else (dense_layers if dense_layers is not None
                                                else dense_layers_that_fit(model, reserve_bytes, memory_budget))
                rest = "module" if path == "mixed" else "nf4kernel"
                try:
                    dec.parts = pack_model(dec.core, rest, dense_layers=n, dtype=dtype)
                    dec.info.update(packed=True, bf16_weights=path != "kernel", dense_layers=n)
                except ValueError as e:  # not packable: every layer through its own forward
                    dec.info.update(packed=f"no: {e}", nf4_kernel=False)
            if bf16_weights:
                try:
                    dec.parts = pack_model(dec.core, dtype=dtype)
                    dec.info["packed"] = True
                    if dtype is not None:  # the CPU: the prefill over the copy too
                        dec.views = copy_views(dec.core, dec.parts)
                        # no adapter adds anything (a fresh one's B is zero): the prefill without it
                        dec.no_lora = (all(p[2] is None for packs in dec.parts for p in packs)
                                       and not _trains_whole_modules(model))
                except ValueError as e:
                    dec.info["packed"] = f"no: {e}"
                    if nf4:
                        stack.enter_context(bf16_base_weights(model))
                dec.info["bf16_weights"] = True
            try:
                yield dec
            finally:
                dec.graphs.clear()
                dec.parts, dec.views, dec.no_lora = None, [], False

    # -- one decode step over static buffers (captured on CUDA)

    def _step(self, st: dict) -> None:
        if self.parts is not None:
            packed_step(self.core, self.rotary, self.n_heads, self.n_kv, self.head_dim, st["tok"], st["pos"],
                        st["t"], st["valid"], st["k"], st["v"], self.parts, st["logits"])
            return
        B = st["tok"].shape[0]
        t = st["t"]
        st["valid"].index_fill_(1, t, True)
        keep = st["valid"][:, None, None, :]
        h = self.body.embed_tokens(st["tok"][:, None])
        cos, sin = self.body.rotary_emb(h, st["pos"][:, None])
        for i, layer in enumerate(self.layers):
            attn = layer.self_attn
            x = layer.input_layernorm(h)
            q = attn.q_proj(x).view(B, 1, self.n_heads, self.head_dim)
            k = attn.k_proj(x).view(B, 1, self.n_kv, self.head_dim)
            v = attn.v_proj(x).view(B, 1, self.n_kv, self.head_dim).transpose(1, 2)
            if getattr(attn, "q_norm", None) is not None:  # qwen3
                q, k = attn.q_norm(q), attn.k_norm(k)
            q, k = self.rotary(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
            kc, vc = st["k"][i], st["v"][i]
            kc.index_copy_(2, t, k.to(kc.dtype))
            vc.index_copy_(2, t, v.to(vc.dtype))
            o = attend(q, kc, vc, keep, attn.scaling).reshape(B, 1, -1).to(h.dtype)
            h = h + attn.o_proj(o)
            h = h + layer.mlp(layer.post_attention_layernorm(h))
        h = self.body.norm(h)
        st["logits"].copy_(self.core.lm_head(h)[:, -1].float())

    def _buffers(self, B: int, L: int, dtype) -> dict:
        dev = self.device
        return {
            "tok": torch.zeros(B, dtype=torch.long, device=dev),
            "pos": torch.zeros(B, dtype=torch.long, device=dev),
            "t": torch.zeros(1, dtype=torch.long, device=dev),
            "valid": torch.zeros(B, L, dtype=torch.bool, device=dev),
            "k": [torch.zeros(B, self.n_kv, L, self.head_dim, dtype=dtype, device=dev) for _ in self.layers],
            "v": [torch.zeros(B, self.n_kv, L, self.head_dim, dtype=dtype, device=dev) for _ in self.layers],
            "logits": torch.zeros(B, self.core.lm_head.weight.shape[0], device=dev),
        }

    def _capture(self, st: dict):
        """Record one step into a graph. The state is that of the first real step, and a
        step is idempotent for fixed inputs (same cache slot, same mask bit), so the
        warm-up runs that capture needs change nothing."""
        t0 = time.perf_counter()
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            for _ in range(2):
                self._step(st)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            self._step(st)
        torch.cuda.synchronize()
        self.info["capture_s"] += time.perf_counter() - t0
        return graph

    @torch.no_grad()
    def decode(self, prompt_ids: Tensor, prompt_mask: Tensor, max_new_tokens: int, sampler: Sampler,
               eos_id: int, pad_id: int) -> tuple[Tensor, Tensor]:
        from transformers import DynamicCache

        B, P = prompt_ids.shape
        t_start = self._clock()
        # Round the cache length up so chunks with other prompt lengths reuse the graph.
        L = -(-(P + max_new_tokens) // 64) * 64
        if self.window and P + max_new_tokens > self.window:
            return decode_plain(self.model, prompt_ids, prompt_mask, max_new_tokens, sampler, eos_id, pad_id)

        # Prefill with the model's own forward, then move its K/V into the static buffers.
        cache = DynamicCache(config=self.core.config)
        pos0 = (prompt_mask.cumsum(-1) - 1).masked_fill(prompt_mask == 0, 0)
        skip = self.model.disable_adapter() if self.no_lora and hasattr(self.model, "disable_adapter") \
            else contextlib.nullcontext()
        with dense_forwards(self.views), skip:
            out = self.core(input_ids=prompt_ids, attention_mask=prompt_mask, position_ids=pos0, use_cache=True,
                            logits_to_keep=1, **{cache_kw(self.core): cache})
        kv = _cache_tensors(cache)
        key = (B, L)
        if key not in self.graphs:
            st = self._buffers(B, L, kv[0][0].dtype)
            self.graphs[key] = [st, None]
        st, graph = self.graphs[key]
        for i, (k, v) in enumerate(kv):
            st["k"][i][:, :, :P].copy_(k)
            st["v"][i][:, :, :P].copy_(v)
        del cache, kv
        st["valid"].zero_()
        st["valid"][:, :P].copy_(prompt_mask.bool())
        st["pos"].copy_(prompt_mask.sum(-1))

        tok, lp = sampler(out.logits[:, -1, :])
        del out
        t_loop = self._clock()
        self.info["prefill_s"] += t_loop - t_start
        done = tok == eos_id
        toks, lps = [tok], [lp]
        for step in range(1, max_new_tokens):
            if step % SYNC_EVERY == 0 and bool(done.all()):
                break
            st["tok"].copy_(tok.masked_fill(done, pad_id))
            st["t"].fill_(P + step - 1)
            if self.use_graph:
                if graph is None:
                    graph = self._try_capture(st, key)
                if graph is not None:
                    graph.replay()
                else:
                    self._step(st)
            elif self.device.type == "cuda":  # a graph that could not be captured: eager, as captured
                self._step(st)
            else:  # eager (the CPU): attention over the positions written so far only
                n = P + step
                self._step({**st, "valid": st["valid"][:, :n], "k": [k[:, :, :n] for k in st["k"]],
                            "v": [v[:, :, :n] for v in st["v"]]})
            st["pos"].add_(1)
            tok, lp = sampler(st["logits"])
            tok = tok.masked_fill(done, pad_id)
            lps.append(lp.masked_fill(done, 0.0))
            toks.append(tok)
            done = done | (tok == eos_id)
        toks, lps = torch.stack(toks, 1), torch.stack(lps, 1)
        self.info["loop_s"] += self._clock() - t_loop
        self.info["steps"] += toks.shape[1]
        # drop trailing steps taken after every row had stopped (between host checks)
        ended = (toks == eos_id).cumsum(1) > 0
        still = (~ended).any(0)
        T = min(toks.shape[1], int(still.nonzero().max()) + 2) if still.any() else 1
        return toks[:, :T], lps[:, :T]

    def _clock(self) -> float:
        # one sync per chunk, to split prefill from decode time in the info
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def _try_capture(self, st: dict, key):
        try:
            graph = self._capture(st)
        except Exception as e:  # a layer that cannot be captured: keep decoding eagerly
            torch.cuda.synchronize()
            self.info["graph_error"] = f"{type(e).__name__}: {reason_line(str(e))}"
            self.use_graph = False
            return None
        self.graphs[key][1] = graph
        return graph


def _cache_tensors(cache) -> list[tuple[Tensor, Tensor]]:
    return [(layer.keys, layer.values) for layer in cache.layers]
