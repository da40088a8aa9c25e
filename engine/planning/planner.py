"""Memory planner: predict the peak GPU memory of a configuration before anything is
loaded, and say whether it fits. A method's step is planned with the memory model its
record names (engine/core/methods.py's `memory`: rows, pairs, rollouts, population).

Imports no torch (the UI process calls it on every widget change): the model's shape
comes from its `config.json` (engine/core/arch.py), and the GPU's memory from `nvidia-smi`
(a CUDA context in the UI process would itself take ~0.5 GiB of the card).

What is counted, in bytes, following what the engine actually does:

- weights: linear layers of the blocks in NF4 (0.5 byte/param, + 1 byte per 64-block
  absmax with double quantisation, + an fp32 absmax per 256 blocks), int8 (1 byte/param
  + an fp32 scale per output row) or plain `dtype`. Embeddings, norms, biases and an
  untied lm_head stay unquantised in compute dtype (engine/models/model.add_lora does not run
  PEFT's fp32 upcast), so the residual stream, activations and KV cache are bf16 on
  CUDA. The training forward runs under bf16 autocast there, and SFT
  with Liger's RMSNorm / SwiGLU (engine/models/liger.py), which keep less for the backward.
- LoRA: r·(in + out) parameters per targeted projection, fp32; their gradients (fp32);
  optimizer state: AdamW (the default) 8 bytes/param, paged 8-bit AdamW 2 (+ block statistics).
- activations of one micro-batch (B x T tokens): with gradient checkpointing each layer
  keeps only its input ([tokens, hidden]) and one layer at a time is recomputed in the
  backward (its full activations + gradient buffers + the dequantised weight: the
  "recompute" transient); without it every layer keeps everything. Attention runs
  through sdpa / flash kernels: no seq² score matrix, only a boolean [B, T, T] mask when
  rows are padded or packed.
- logits: engine/training/lm_loss computes them only at labelled positions in checkpointed
  chunks of 512 rows; the backward of one chunk holds about three [chunk, vocab] fp32
  buffers (logits, log-softmax, its gradient). The peak holds either this or the layer
  recompute, not both (the head's backward finishes before the last layer's recompute).
- rollouts (F-GRPO): the rollout's KV cache (prompts_per_step x G rows of prompt + max_new_tokens)
  and prefill, or the policy update on micro_batch_size rows, whichever is larger.
- population (ESSA): inference only (no gradients, no optimizer state), plus K stacked LoRA copies
  when candidates share a batch, plus the warm-start SFT when it runs first.
- overhead: the CUDA context (outside PyTorch's allocator; nvidia-smi sees it) and the
  caching allocator's slack (fragmentation, rounding to blocks).

`allocated_peak` is the part `torch.cuda.max_memory_allocated` sees (tensors only, no
context, no slack, no paged optimizer state, which lives in CUDA managed memory);
bench/planner_check.py compares it with measurements. The formulas are first-order:
they aim at ±15% on the tensors, which is what deciding "fits / does not fit" needs.
"""

from __future__ import annotations

import copy
import math
import shutil
import subprocess
from dataclasses import dataclass

from edgetune.engine.core.arch import PROJECTIONS, Arch, arch_from_config, read_model_config
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings import DPO_REFERENCE_FREE, Config, warm_start_config
from edgetune.engine.core.units import size

from edgetune.engine.planning import long_levers
from edgetune.engine.planning.effective import (
    DTYPE_BYTES,
    LOSS_CHUNK_ROWS,
    decide,
    essa_candidates_per_batch,
    optimizer_name,
)
from edgetune.engine.planning.effective import checkpoint_split as effective_checkpoint_split

GiB = 1024**3
CUDA_CONTEXT = 512 * 1024**2  # driver context + cuBLAS/cuDNN handles on a Hopper card with torch 2.x
ALLOCATOR_FIXED = 256 * 1024**2
NCCL_BUFFERS = 512 * 1024**2  # NCCL's communicator and channel buffers on a rank of a data-parallel run
ALLOCATOR_SLACK = 0.08  # share of the step's transient memory lost to caching-allocator fragmentation

# --------------------------------------------------------------------------- GPU


def gpu_memory() -> tuple[int, int] | None:
    """(free, total) bytes of GPU 0 from nvidia-smi, or None without one. No torch, no CUDA
    context in the calling process."""
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    try:
        out = subprocess.run([smi, "--query-gpu=memory.free,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=5).stdout
        free, total = (int(float(x)) * 1024**2 for x in out.splitlines()[0].split(","))
        return free, total
    except (OSError, ValueError, IndexError, subprocess.SubprocessError):
        return None


def gpu_memory_torch() -> tuple[int, int] | None:
    """(free, total) through torch, for a process that already holds a CUDA context."""
    import torch

    return torch.cuda.mem_get_info() if torch.cuda.is_available() else None


# --------------------------------------------------------------------------- pieces


@dataclass
class Ctx:
    """What the engine will do with this config, reduced to numbers."""

    arch: Arch
    quant: str
    device: str
    compute_bytes: int  # bf16 on CUDA by default
    param_bytes: int  # unquantised parameters (embeddings, norms, biases, lm_head)
    act_bytes: int  # residual stream / activations / KV cache
    targets: tuple[str, ...]
    r: int
    checkpointing: bool
    optimizer: str
    ckpt_layers: int | None = None  # checkpointed decoder layers (the first ones); None = all when checkpointing
    offload: bool = False  # model.offload_activations: layer inputs in pinned host memory
    autocast: bool = False  # engine/models/model.autocast: 16-bit compute on CUDA, adapter products in bf16
    liger: bool = False  # engine/models/liger.py's RMSNorm / SwiGLU in the training step
    mlp_chunk: int = 0  # model.mlp_chunk_tokens (engine/planning/long_levers.py counts it)
    mask_free: bool = False  # model.mask_free_attention: no [T, T] mask, k and v at their grouped width


def _targets(target_modules, notes: list) -> tuple[str, ...]:
    if target_modules in ("all-linear", None, ""):
        return PROJECTIONS
    names = target_modules.split(",") if isinstance(target_modules, str) else list(target_modules)
    names = [n.strip() for n in names]
    known = tuple(n for n in PROJECTIONS if n in names)
    if len(known) < len(names):
        notes.append(f"LoRA targets not sized (unknown names): {sorted(set(names) - set(known))}")
    return known


def make_ctx(cfg: Config, device: str, optimizer: str) -> tuple[Ctx, list]:
    notes: list[str] = []
    arch = arch_from_config(read_model_config(cfg.model.name))
    eff = decide(cfg, device, arch)  # the engine's own decisions (engine/planning/effective.py)
    c = DTYPE_BYTES[eff.dtype]
    opt = optimizer_name(optimizer)
    if arch.experts:
        notes.append("mixture-of-experts: experts counted in weights; activations use the routed share (approximate)")
    ctx = Ctx(arch, cfg.model.quant, device, c, c, c, _targets(cfg.lora.target_modules, notes), cfg.lora.r,
              bool(cfg.model.gradient_checkpointing), opt,
              offload=bool(cfg.model.gradient_checkpointing) and getattr(cfg.model, "offload_activations", False),
              autocast=eff.autocast, liger=eff.liger)
    long_levers.levers_of(cfg, ctx)
    return ctx, notes


def weight_bytes(ctx: Ctx) -> int:
    a = ctx.arch
    linear = 0
    n_linear = 0
    bias = 0
    for name, (i, o, copies) in a.projections().items():
        linear += i * o * copies
        n_linear += copies
        has_bias = a.qkv_bias if name in ("q_proj", "k_proj", "v_proj") else (
            a.o_bias if name == "o_proj" else a.mlp_bias)
        bias += o * copies if has_bias else 0
    linear *= a.layers
    n_linear *= a.layers
    if ctx.quant == "nf4":
        blocks = linear / 64
        # 4-bit codes + uint8 absmax per block (double quant) + fp32 absmax per 256 blocks
        # + the two code tables (16 and 256 fp32) each layer keeps.
        q = linear / 2 + blocks + blocks / 256 * 4 + n_linear * (16 + 256) * 4
    elif ctx.quant == "int8":
        q = linear + sum(o * cp for _, o, cp in a.projections().values()) * a.layers * 4
    else:
        q = linear * ctx.compute_bytes
    router = a.layers * a.hidden * a.experts if a.experts else 0
    norms = (2 * a.layers + 1) * a.hidden
    embed = a.vocab * a.hidden * (1 if a.tied else 2)
    return int(q + (bias * a.layers + norms + embed + router) * ctx.param_bytes)


def lora_params(ctx: Ctx) -> int:
    per_layer = sum(ctx.r * (i + o) * cp for n, (i, o, cp) in ctx.arch.projections().items() if n in ctx.targets)
    return per_layer * ctx.arch.layers


def optimizer_bytes(opt: str, n: int) -> int:
    if opt in ("paged_adamw_8bit", "adamw_8bit"):
        # two uint8 states + an fp32 max per 256-value block for each (bitsandbytes' blockwise 8-bit)
        return int(n * 2 + 2 * n / 256 * 4)
    return n * 8  # AdamW: fp32 exp_avg and exp_avg_sq


def _mlp_width(a: Arch) -> int:
    return a.intermediate * (a.experts_per_token or 1)


def layer_activation_bytes(ctx: Ctx, tokens: int, masked: bool = False) -> int:
    """What one decoder layer keeps for its backward (no checkpointing), for `tokens` tokens.

    Counted from the tensors autograd saves (tests/test_planner.py checks this against a
    real layer): the layer's input, the normalised inputs read by the adapters, the rotary
    q and k, v, the attention output, gate, up and act(gate), act * up (read by down's
    adapter), LoRA's rank-r intermediates (fp32). Frozen 4-bit matmuls keep nothing. With a
    mask (padded or packed rows) transformers repeats k and v to all query heads before
    sdpa, so they are saved at q's width. With a bf16 residual, PEFT casts each adapted
    layer's input to the adapters' fp32 (one copy per projection) and each RMSNorm keeps
    an fp32 upcast; under autocast (CUDA) autograd keeps those copies cast back to bf16,
    and the rank-r intermediates are bf16 too, beside bf16 copies of the factors; Liger's
    kernels (CUDA SFT) keep one [tokens, intermediate] and one fp32 norm upcast fewer
    (tests/test_liger.py measures that case); with an fp32 residual those are the
    activations themselves."""
    a, b = ctx.arch, ctx.act_bytes
    i = _mlp_width(a)
    kv = 2 * a.q_dim if masked else 2 * a.kv_dim
    dims = a.projections()
    copy_bytes = ctx.compute_bytes if ctx.autocast else 4
    lora_mid = len(ctx.targets) * ctx.r * copy_bytes
    if b >= 4:
        per_tok = b * (3 * a.hidden + 2 * a.q_dim + kv + 3 * i + (i if "down_proj" in ctx.targets else 0))
    else:
        fp32_inputs = a.hidden + sum(dims[t][0] for t in ctx.targets)
        per_tok = copy_bytes * fp32_inputs + b * (3 * i + 2 * a.q_dim + kv)
        if ctx.liger:
            # Liger's SwiGLU recomputes act(gate) in its backward instead of keeping it, and its
            # RMSNorm keeps the bf16 input and one fp32 scale per row instead of an fp32 upcast
            per_tok -= b * i + (4 - b) * a.hidden
    # autocast's bf16 copies of the layer's fp32 LoRA factors live as long as its activations
    lora_casts = sum(ctx.r * (dims[t][0] + dims[t][1]) * dims[t][2] for t in ctx.targets) * ctx.compute_bytes \
        if ctx.autocast else 0
    return long_levers.chunked_layer(ctx, tokens, tokens * (per_tok + lora_mid) + lora_casts)


def dequant_transient(ctx: Ctx) -> int:
    """bitsandbytes dequantises the widest weight to compute dtype for each matmul."""
    if ctx.quant == "none":
        return 0
    return max(i * o for i, o, _ in ctx.arch.projections().values()) * ctx.compute_bytes


def recompute_bytes(ctx: Ctx, tokens: int, masked: bool = False) -> int:
    """Backward of one layer: its activations (recomputed when checkpointing), gradient
    buffers about two [tokens, intermediate] wide, the input cast to compute dtype, and the
    dequantised weight."""
    a = ctx.arch
    mlp_tokens = long_levers.mlp_tokens(ctx, tokens)  # the MLP in chunks: one chunk's worth at a time
    grads = mlp_tokens * 2 * _mlp_width(a) * ctx.act_bytes
    cast = mlp_tokens * _mlp_width(a) * ctx.compute_bytes if ctx.act_bytes != ctx.compute_bytes else 0
    layer = layer_activation_bytes(ctx, tokens, masked) if n_checkpointed(ctx) else 0
    return layer + long_levers.chunk_recompute(ctx, tokens) + grads + cast + dequant_transient(ctx)


def n_checkpointed(ctx: Ctx) -> int:
    if not ctx.checkpointing:
        return 0
    return ctx.arch.layers if ctx.ckpt_layers is None else max(0, min(ctx.ckpt_layers, ctx.arch.layers))


def head_bytes(ctx: Ctx, labelled: int) -> int:
    """Backward of one loss chunk: logits, log-softmax and its gradient, fp32 ([chunk, vocab]);
    a bf16 residual adds the bf16 logits before the upcast."""
    rows = min(LOSS_CHUNK_ROWS, labelled)
    per = ctx.arch.vocab * (3 * 4 + (ctx.act_bytes if ctx.act_bytes < 4 else 0))
    return rows * per


def mask_bytes(rows: int, seq: int, masked: bool) -> int:
    """sdpa gets a boolean [B, 1, T, T] mask when rows are padded or packed (never a float one)."""
    return rows * seq * seq if masked else 0


def train_activation_parts(ctx: Ctx, rows: int, seq: int, labelled: int, masked: bool | None = None) -> dict:
    """Saved activations and the peak transient of one forward+backward. `masked`: sdpa
    gets a mask (default: when there are several rows, which are padded in practice)."""
    a = ctx.arch
    masked = (rows > 1 if masked is None else masked) and not ctx.mask_free
    tokens = rows * seq
    host = 0
    k = n_checkpointed(ctx)
    # layers that are not checkpointed keep everything; checkpointed ones keep their input
    saved = (a.layers - k) * layer_activation_bytes(ctx, tokens, masked) if k < a.layers else 0
    if ctx.offload and k:
        # engine/models/offload.py: the inputs wait in host memory; about two are on the GPU at
        # a time (the one being copied out, the one being computed on)
        host = k * tokens * a.hidden * ctx.act_bytes
        saved += 2 * tokens * a.hidden * ctx.act_bytes
    else:
        saved += k * tokens * a.hidden * ctx.act_bytes
    # final norm (2 x [tokens, hidden]), the gathered labelled rows, the hidden states' gradient
    saved += (3 * tokens + labelled) * a.hidden * ctx.act_bytes
    saved += mask_bytes(rows, seq, masked)
    head = head_bytes(ctx, labelled)
    layer = recompute_bytes(ctx, tokens, masked)
    return {"activations": saved, "transient": max(head, layer), "logits_chunk": head, "layer_recompute": layer,
            "host_pinned": host}


def decode_ctx(arch: Arch, quant: str, act_bytes: int) -> Ctx:
    """A loaded model as the decode formulas below read it (the shape, the quantisation,
    the residual stream's bytes per value): engine/generation/fast_decode.reserve_bytes sizes a
    rollout's memory with the same kv_cache_bytes and prefill_bytes this plan adds up."""
    return Ctx(arch, quant, "", act_bytes, act_bytes, act_bytes, targets=(), r=0, checkpointing=False,
               optimizer="adamw")


def kv_cache_bytes(ctx: Ctx, rows: int, seq: int) -> int:
    # DynamicCache grows by concatenation: one layer's cache is briefly held twice.
    per = 2 * ctx.arch.kv_dim * ctx.act_bytes * rows * seq
    return per * (ctx.arch.layers + 1)


def prefill_bytes(ctx: Ctx, rows: int, prompt: int) -> int:
    """Widest transient of an inference forward over the prompts: one layer's working set
    (nothing is kept between layers), the left-padding mask, last-position logits."""
    a = ctx.arch
    tokens = rows * prompt
    layer = tokens * (3 * a.hidden + a.q_dim + 2 * a.kv_dim + 3 * _mlp_width(a)) * ctx.act_bytes
    return layer + mask_bytes(rows, prompt, True) + rows * a.vocab * 4 * 2 + dequant_transient(ctx)


# --------------------------------------------------------------------------- methods


def _static(ctx: Ctx, train: bool) -> dict:
    n = lora_params(ctx)
    return {
        "weights": weight_bytes(ctx),
        "lora": n * 4,
        "lora_grads": n * 4 if train else 0,
        "optimizer": optimizer_bytes(ctx.optimizer, n) if train else 0,
    }


def _group(cfg: Config):
    """The settings group of the config's method (its record's name)."""
    return getattr(cfg, cfg.method)


def _plan_rows(cfg: Config, ctx: Ctx, gpu_free: int | None, notes: list) -> dict:
    """A micro-batch of the record's `batch` rows trained on (padded, or packed in one row)."""
    rows, seq = _get(cfg, RECORDS[cfg.method].batch), cfg.data.max_seq_len
    if RECORDS[cfg.method].packing and _group(cfg).packing:
        seq = rows * cfg.data.max_seq_len  # one row, block-diagonal mask
        rows = 1
        parts = train_activation_parts(ctx, 1, seq, seq, masked=True)
    else:
        parts = train_activation_parts(ctx, rows, seq, rows * seq)
    return {**_static(ctx, True), **parts, "kv_cache": 0, "shape": f"{rows} x {seq} tokens"}


def _plan_pairs(cfg: Config, ctx: Ctx, gpu_free: int | None, notes: list) -> dict:
    """A micro-batch's chosen and rejected rows in one padded forward and backward; the
    reference's forward (no_grad, adapter off) before it holds no activations past itself."""
    rows, seq = 2 * _get(cfg, RECORDS[cfg.method].batch), cfg.data.max_seq_len
    parts = train_activation_parts(ctx, rows, seq, rows * seq)
    static = _static(ctx, True)
    if cfg.lora.init_from and _group(cfg).loss_type not in DPO_REFERENCE_FREE:
        static["lora"] *= 3  # the starting adapter kept as the reference, and the trained one while it is swapped in
    return {**static, **parts, "kv_cache": 0, "shape": f"{rows} x {seq} tokens (chosen + rejected)"}


def _plan_rollouts(cfg: Config, ctx: Ctx, gpu_free: int | None, notes: list) -> dict:
    """The rollout's generation, or the policy update in micro-batches, whichever is larger."""
    s, record = _group(cfg), RECORDS[cfg.method]
    prompt = cfg.data.max_seq_len
    roll_rows = _get(cfg, record.rollout_batch) * s.num_generations
    seq = prompt + s.max_new_tokens
    kv = kv_cache_bytes(ctx, roll_rows, seq)
    prefill = prefill_bytes(ctx, roll_rows, prompt)
    mb = min(_get(cfg, record.batch) or roll_rows, roll_rows)  # 0 = the whole step at once
    train = train_activation_parts(ctx, mb, seq, mb * s.max_new_tokens)
    static = _static(ctx, True)
    if kv + prefill >= train["activations"] + train["transient"]:
        parts = {"activations": 0, "transient": prefill, "kv_cache": kv, "phase": "rollout"}
    else:
        parts = {"activations": train["activations"], "transient": train["transient"], "kv_cache": 0,
                 "phase": "policy update"}
    parts.update(rollout_kv_cache=kv, rollout_prefill=prefill, update_activations=train["activations"],
                 update_transient=train["transient"],
                 shape=f"rollout {roll_rows} x ({prompt} + {s.max_new_tokens}); update {mb} x {seq}")
    return {**static, **parts}


def essa_free_after_load(ctx: Ctx, gpu_free: int | None) -> int | None:
    """The card's free memory once ESSA's model, adapter and search space are loaded:
    what the engine measures when it sizes its batched evaluation."""
    if gpu_free is None:
        return None
    loaded = weight_bytes(ctx) + 3 * lora_params(ctx) * 4 + (CUDA_CONTEXT if ctx.device.startswith("cuda") else 0)
    return max(0, gpu_free - loaded)


def _essa_k(cfg: Config, ctx: Ctx, gpu_free: int | None) -> int:
    """engine/planning/effective's K for the free memory the engine will see after loading (on a
    card of unknown memory: one candidate per pass; _plan says so in a note)."""
    dtype = "bf16" if ctx.compute_bytes == 2 else "fp32"
    return essa_candidates_per_batch(cfg, ctx.device, ctx.arch, dtype, essa_free_after_load(ctx, gpu_free))


def _plan_population_step(cfg: Config, ctx: Ctx, gpu_free: int | None) -> dict:
    s = _group(cfg)
    k = _essa_k(cfg, ctx, gpu_free)
    rows = s.prompts_per_generation * k
    prompt = cfg.data.max_seq_len
    static = _static(ctx, False)
    n = lora_params(ctx)
    # the SVD search space keeps U, V of both factors (about two adapters' worth), and a
    # batched pass stacks K candidates' rebuilt factors.
    static["lora"] += 2 * n * 4 + (k * n * 4 if k > 1 else 0)
    out = {**static, "activations": 0, "transient": prefill_bytes(ctx, rows, prompt),
           "kv_cache": kv_cache_bytes(ctx, rows, prompt + s.max_new_tokens), "candidates_per_batch": k,
           "shape": f"{rows} rows ({k} candidate(s) x {s.prompts_per_generation} prompts) x "
                    f"({prompt} + {s.max_new_tokens})"}
    return out


ADDITIVE = ("weights", "lora", "lora_grads", "optimizer", "activations", "transient", "kv_cache")


def _finish(plan: dict, ctx: Ctx) -> dict:
    tensors = sum(int(plan[k]) for k in ADDITIVE)
    dynamic = plan["activations"] + plan["transient"] + plan["kv_cache"]
    plan["allocator_overhead"] = int(ALLOCATOR_FIXED + ALLOCATOR_SLACK * dynamic) if ctx.device.startswith("cuda") else 0
    plan["cuda_context"] = CUDA_CONTEXT if ctx.device.startswith("cuda") else 0
    paged = plan["optimizer"] if ctx.optimizer.startswith("paged") else 0
    plan["allocated_peak"] = tensors - paged
    plan["parts"] = list(ADDITIVE) + ["allocator_overhead", "cuda_context"]
    plan["total"] = sum(int(plan[k]) for k in plan["parts"])
    for k in plan["parts"] + ["total", "allocated_peak"]:
        plan[k] = int(plan[k])
    return plan


def _plan(cfg: Config, device: str, gpu_free: int | None) -> tuple[dict, Ctx, list]:
    opt = getattr(getattr(cfg, cfg.method), "optimizer", "auto")  # ESSA has no optimizer
    ctx, notes = make_ctx(cfg, device, opt)
    if cfg.model.gradient_checkpointing == "auto":
        split = _split(cfg, ctx, gpu_free)
        ctx.ckpt_layers = split["checkpointed"]
        notes.append(split["note"])
    return _plan_ctx(cfg, ctx, device, gpu_free, notes)


def _plan_population(cfg: Config, ctx: Ctx, gpu_free: int | None, notes: list) -> dict:
    """The search's evaluation, or the warm-start run before it where that is the peak."""
    s = _group(cfg)
    plan = _plan_population_step(cfg, ctx, gpu_free)
    if s.evaluation == "batched" and not s.candidates_per_batch and gpu_free is None \
            and ctx.device.startswith("cuda"):
        notes.append("candidates per batch are picked at run time from half the free GPU memory; "
                     "planned here for one (set essa.candidates_per_batch to plan more)")
    if RECORDS[cfg.method].warm_start and not s.warm_start:
        # the warm start is a short run of another method on the same model before the search
        wplan, _, _ = _plan(warm_start_config(cfg), ctx.device, gpu_free)
        wplan = _finish(wplan, ctx)
        plan["warm_start_total"] = wplan["total"]
        if wplan["total"] > sum(int(plan[k]) for k in ADDITIVE):
            notes.append("the warm-start SFT is the peak (essa.warm_start unset)")
            plan = {**wplan, "candidates_per_batch": plan["candidates_per_batch"],
                    "warm_start_total": wplan["total"], "phase": "warm-start SFT"}
    return plan


# The memory models of a step, by the name a record's `memory` gives
# (tests/test_method_conformance.py plans every record).
PLANS = {"rows": _plan_rows, "pairs": _plan_pairs, "rollouts": _plan_rollouts, "population": _plan_population}


def _get(cfg: Config, path: str):
    group, name = path.split(".")
    return getattr(getattr(cfg, group), name)


def _set(cfg: Config, path: str, value) -> None:
    group, name = path.split(".")
    setattr(getattr(cfg, group), name, value)



def _plan_ctx(cfg: Config, ctx: Ctx, device: str, gpu_free: int | None, notes: list) -> tuple[dict, Ctx, list]:
    if RECORDS[cfg.method].rollouts and ctx.quant != "none" and device.startswith("cuda"):
        linear = sum(i * o * cp for i, o, cp in ctx.arch.projections().values()) * ctx.arch.layers
        notes.append(f"rollouts may also take a bf16 copy of the 4-bit weights ({linear * 2 / GiB:.1f} GiB, "
                     "or of as many layers as fit; engine/generation/fast_decode.py) for speed, only from free memory "
                     "during generation: not counted")
    plan = PLANS[RECORDS[cfg.method].memory](cfg, ctx, gpu_free, notes)
    return _finish(plan, ctx), ctx, notes


# --------------------------------------------------------------------------- checkpointing split

def _split(cfg: Config, ctx: Ctx, gpu_free: int | None) -> dict:
    """engine/planning/effective.checkpoint_split with this planner's prediction of the total for
    k checkpointed layers (offloading needs a checkpointed layer). A CPU run plans to
    model.memory_budget_gib only: a card's free memory is not its budget."""
    if not ctx.device.startswith("cuda"):
        gpu_free = None

    def planned_total(k: int) -> int:
        c = copy.copy(ctx)
        c.checkpointing, c.ckpt_layers = True, k
        c.offload = ctx.offload and k > 0
        return _plan_ctx(cfg, c, ctx.device, gpu_free, [])[0]["total"]

    return effective_checkpoint_split(cfg, ctx.arch.layers, gpu_free, planned_total,
                                      min_layers=1 if ctx.offload else 0)


def checkpoint_split(cfg: Config, device: str | None = None, gpu_free: int | None = None) -> dict:
    """How many decoder layers (the first ones) a run checkpoints: all or none for
    gradient_checkpointing true / false; for auto, the fewest that fit the budget
    (model.memory_budget_gib, or the card's free memory minus a margin, read here when
    `gpu_free` is None). Keys: layers, checkpointed, budget, planned_total, note."""
    if cfg.model.gradient_checkpointing != "auto":
        return effective_checkpoint_split(cfg, arch_from_config(read_model_config(cfg.model.name)).layers)
    if device is None:
        device = "cuda" if cfg.model.device == "auto" else cfg.model.device
    if gpu_free is None and not cfg.model.memory_budget_gib and device.startswith("cuda"):
        got = gpu_memory() or gpu_memory_torch()
        gpu_free = got[0] if got else None
    opt = getattr(getattr(cfg, cfg.method), "optimizer", "auto")  # ESSA has no optimizer
    ctx, _ = make_ctx(cfg, device, opt)
    return _split(cfg, ctx, gpu_free)


# --------------------------------------------------------------------------- verdict


def _suggestions(cfg: Config) -> list[tuple[str, Config]]:
    """Single changes that lower memory, most effective first where it does not cost quality."""
    out = []
    if cfg.model.quant != "nf4":
        c = copy.deepcopy(cfg)
        c.model.quant = "nf4"
        out.append(("quant nf4", c))
    if not cfg.model.gradient_checkpointing and RECORDS[cfg.method].gradients:
        c = copy.deepcopy(cfg)
        c.model.gradient_checkpointing = True
        out.append(("gradient checkpointing", c))
    if RECORDS[cfg.method].population and _group(cfg).evaluation == "batched":
        k = _group(cfg).candidates_per_batch or _group(cfg).population
        while k > 1:
            k //= 2
            c = copy.deepcopy(cfg)
            _group(c).candidates_per_batch = k
            out.append((f"fewer candidates per batch ({cfg.method}.candidates_per_batch={k})", c))
    if RECORDS[cfg.method].offload and cfg.model.gradient_checkpointing and not cfg.model.offload_activations:
        c = copy.deepcopy(cfg)
        c.model.offload_activations = True
        out.append(("offload activations (model.offload_activations)", c))
    batch = RECORDS[cfg.method].batch.split(".")
    group = getattr(cfg, batch[0])
    b = getattr(group, batch[1])
    while b > 1:
        b //= 2
        c = copy.deepcopy(cfg)
        setattr(getattr(c, batch[0]), batch[1], b)
        out.append((f"smaller batch ({batch[0]}.{batch[1]}={b})", c))
    rollout = RECORDS[cfg.method].rollout_batch
    if rollout and _get(cfg, rollout) > 1:
        c = copy.deepcopy(cfg)
        _set(c, rollout, max(1, _get(cfg, rollout) // 2))
        out.append((f"fewer rollouts ({rollout}={_get(c, rollout)})", c))
    n = cfg.data.max_seq_len
    while n > 128:
        n //= 2
        c = copy.deepcopy(cfg)
        c.data.max_seq_len = n
        out.append((f"shorter max_seq_len ({n})", c))
    return out


def verdict(cfg: Config, total: int, budget: int | None, device: str, gpu_free: int | None) -> tuple[str, bool | None]:
    if budget is None:
        return f"no GPU known: predicted peak {size(total)}", None
    if total <= budget:
        return f"fits: {size(total)} of {size(budget)}", True
    for label, c in _suggestions(cfg):
        t = _plan(c, device, gpu_free)[0]["total"]
        if t <= budget:
            return (f"does not fit ({size(total)} > {size(budget)}) — try: {label} (predicted {size(t)})", False)
    return (f"does not fit ({size(total)} > {size(budget)}) — try: quant nf4 / gradient checkpointing / "
            "smaller batch / shorter max_seq_len together, or a smaller model", False)


def _shard_plan(plan: dict, ctx: Ctx, gpus: int) -> None:
    """One rank's static parts under `model.shard: fsdp` (engine/models/fsdp.py): the decoder
    layers' weights and the adapter, its gradients and optimizer state divided by the
    rank count; two layers gathered whole (the one running and the next, which FSDP
    gathers ahead; their LoRA gradients are whole until reduce-scattered); the embeddings,
    head and final norm whole on every rank."""
    a = ctx.arch
    outside = (a.vocab * a.hidden * (1 if a.tied else 2) + a.hidden) * ctx.param_bytes
    layer = (plan["weights"] - outside) / a.layers
    lora_layer = lora_params(ctx) * 4 / a.layers
    plan["weights"] = int(math.ceil((plan["weights"] - outside) / gpus) + 2 * layer + outside)
    plan["lora"] = int(math.ceil(plan["lora"] / gpus) + 2 * lora_layer)
    plan["lora_grads"] = int(math.ceil(plan["lora_grads"] / gpus) + 2 * lora_layer)
    plan["optimizer"] = int(math.ceil(plan["optimizer"] / gpus))
    plan["allocated_peak"] = sum(int(plan[k]) for k in ADDITIVE) - (
        plan["optimizer"] if ctx.optimizer.startswith("paged") else 0)


def per_rank(cfg: Config, gpus: int) -> Config:
    """The shapes one rank of a data-parallel run on `gpus` GPUs works on
    (engine/core/distributed.py): the record's `per_rank` setting split across the ranks,
    in micro-batches of at most its value (a step's rows are `per_rank` x `accumulate`:
    SFT's and DPO's rows, F-GRPO's prompts, whole groups per rank); a method without one
    (ESSA splits its candidates, each rank scoring as one process does) is unchanged."""
    record = RECORDS[cfg.method]
    if gpus <= 1 or not record.per_rank:
        return cfg
    out = copy.deepcopy(cfg)
    value = _get(out, record.per_rank)
    steps = _get(out, record.accumulate) if record.accumulate else 1
    _set(out, record.per_rank, max(1, min(value, math.ceil(value * steps / gpus))))
    return out


def estimate(cfg: Config, gpu_total: int | None = None, gpu_free: int | None = None,
             device: str | None = None, detect_gpu: bool = True, gpus: int = 1) -> dict:
    """Predicted peak GPU memory of `cfg`, in bytes per part, with a verdict.

    `gpu_total` / `gpu_free`: the card's memory; when both are None and `detect_gpu`,
    nvidia-smi is asked. `device`: plan for this device (default: cfg.model.device, with
    auto meaning cuda: the planner is about GPU memory).
    Keys: each part in `parts` (they sum to `total`), `allocated_peak` (what
    torch.cuda.max_memory_allocated would show), `verdict`, `fits`, and details.
    `gpus` > 1: the peak of each GPU of a data-parallel run (every GPU holds the whole
    4-bit base; the batch is split; plus the gradient all-reduce buffer and NCCL's), or
    with `model.shard: fsdp` of a sharded one (_shard_plan)."""
    if gpus > 1:
        cfg = per_rank(cfg, gpus)
    if device is None:
        device = "cuda" if cfg.model.device == "auto" else cfg.model.device
    if gpu_total is None and gpu_free is None and detect_gpu and device.startswith("cuda"):
        got = gpu_memory()
        if got is not None:
            gpu_free, gpu_total = got
    plan, ctx, notes = _plan(cfg, device, gpu_free)
    if gpus > 1 and cfg.model.shard == "fsdp":
        _shard_plan(plan, ctx, gpus)
        notes[:] = [n for n in notes if not n.startswith("rollouts may also take")]  # sharded: the plain loop
        plan["cuda_context"] += NCCL_BUFFERS if device.startswith("cuda") else 0
        plan["total"] = sum(int(plan[k]) for k in plan["parts"])
        notes.append(f"per GPU of {gpus} (model.shard: fsdp): 1/{gpus} of the decoder layers' weights, adapter, "
                     f"gradients and optimizer state, plus two whole layers while they run and the embeddings "
                     f"and head whole; shape per GPU: {plan.get('shape', '')}")
    elif gpus > 1:
        flat = lora_params(ctx) * 4 if RECORDS[cfg.method].gradients else 0  # the flattened gradients all-reduced
        plan["lora_grads"] += flat
        plan["allocated_peak"] += flat
        plan["cuda_context"] += NCCL_BUFFERS if device.startswith("cuda") else 0
        plan["total"] = sum(int(plan[k]) for k in plan["parts"])
        notes.append(f"per GPU of {gpus} (data-parallel): each holds the whole 4-bit base and adapter; "
                     f"shape per GPU: {plan.get('shape', '')}")
    plan["gpus"] = gpus
    budget = gpu_free if gpu_free is not None else gpu_total
    run_device = cfg.model.device
    if run_device == "auto":
        run_device = "cuda" if (gpu_total or gpu_free) and device.startswith("cuda") else "cpu"
    plan["verdict"], plan["fits"] = verdict(cfg, plan["total"], budget, device, gpu_free)
    a = ctx.arch
    plan.update(
        method=cfg.method, device=device, gpu_total=gpu_total, gpu_free=gpu_free, notes=notes,
        model={"name": cfg.model.name, "type": a.model_type, "layers": a.layers, "hidden": a.hidden,
               "intermediate": a.intermediate, "vocab": a.vocab, "quant": ctx.quant,
               "lora_params": lora_params(ctx), "optimizer": ctx.optimizer,
               "activation_bytes": ctx.act_bytes, "gradient_checkpointing": ctx.checkpointing,
               "checkpointed_layers": n_checkpointed(ctx)},
        # what the run will decide for every `auto` setting (engine/planning/effective.py), on the device
        # it will get: model.device, or auto = a CUDA card when one is known here, else the CPU
        effective=decide(cfg, run_device, a, essa_free_after_load(ctx, gpu_free) if run_device == device else None,
                         checkpointed=n_checkpointed(ctx)).to_dict(),
    )
    return plan


# --------------------------------------------------------------------------- refusing before loading

# A run is refused before anything loads when the planner predicts this many times the
# memory of the device it runs on. The planner aims at ±15%; a prediction this far over is
# a setting typed wrong (a batch of a billion rows), not a close call: those are left to
# the run itself (engine/planning/oom.py), as the verdict of `edgetune estimate` is.
FAR_BEYOND = 4

# The settings behind each part of a plan, for the refusal's one line (the rest: the record's `shape`).
_DRIVERS = {
    "weights": ("model.name", "model.quant"),
    "lora": ("lora.r", "lora.target_modules"),
    "lora_grads": ("lora.r", "lora.target_modules"),
    "optimizer": ("lora.r", "lora.target_modules"),
}


def host_memory() -> int | None:
    """Bytes of RAM of this machine (the CPU device's memory), or None where unknown."""
    import os

    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


def refuse_far_beyond(cfg: Config, device: str, gpus: int = 1, memory: int | None = None) -> None:
    """Raise a one-line ConfigError when the predicted peak of `cfg` on `device` ("cpu" or
    "cuda") is more than FAR_BEYOND times `memory` (default: host RAM for the CPU, the
    card's memory for a GPU), naming the settings that drive the prediction. Called
    before the model loads (engine/run/worker.py)."""
    from edgetune.engine.core.errors import ConfigError, EdgetuneError

    gpu = device.startswith("cuda")
    if memory is None:
        got = (gpu_memory_torch() or gpu_memory()) if gpu else None
        memory = got[1] if got else None if gpu else host_memory()
    if not memory:
        return
    try:
        plan = estimate(cfg, device="cuda" if gpu else "cpu", detect_gpu=False, gpus=gpus)
    except EdgetuneError:  # a model the planner cannot read: loading it names the problem
        return
    total = plan["total"]
    if total <= FAR_BEYOND * memory:
        return
    shape = RECORDS[cfg.method].shape
    overhead = ("allocator_overhead", "cuda_context", "host_pinned")
    sizes = {k: int(plan[k]) for k in plan["parts"] if k not in overhead}
    # the parts that alone exceed the memory, else the largest one
    big = [k for k, v in sorted(sizes.items(), key=lambda kv: -kv[1]) if v > memory] or [max(sizes, key=sizes.get)]
    names = list(dict.fromkeys(n for k in big for n in _DRIVERS.get(k, shape)))
    shown = ", ".join(f"{n}={_value(cfg, n)}" for n in names)
    where = "the GPU's memory" if gpu else "this machine's RAM"
    raise ConfigError(f"the planner predicts {size(total)} at the peak, far beyond {where} ({size(memory)}); "
                      f"driven by {shown} (edgetune estimate shows the parts)")


def _value(cfg: Config, dotted: str):
    group, field = dotted.split(".")
    return getattr(getattr(cfg, group), field)
