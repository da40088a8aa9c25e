"""SEBP on a GPU: a CUDA correctness check, then backward times of one layer.

For each shape, layer kind and active fraction f (right-padded batch of 16 x 512 rows):
  dense     the padded batch through plain autograd (the paper's baseline)
  sebp      ours: the same padded tensors, backward over the active rows only (on CUDA the
            path that kernels/sebp.choose_backend measured faster for this layer and fraction)
  sebp_triton  forced: the row-gathering Triton GEMMs
  sebp_gather  the same rows through index_select + cuBLAS (the torch path, gathered copies)
  unpadded  dense GEMMs on tensors holding only the active rows (the physical limit)
Layer kinds: "linear" (bf16 weight, trainable: dX + dW) and "lora-nf4" (PEFT LoRA r=16
over a bitsandbytes NF4 Linear4bit: dX + dA + dB). Times are medians of
triton.testing.do_bench; "host" is the median time to enqueue one backward (launch-bound
when it reaches the GPU time); "extra" is the backward's peak memory minus dense's. For
LoRA-NF4 at f < 1, "pieces_ms" times each kernel of the sparse backward alone (the
Triton path's, summed, then the cuBLAS path's two dX kernels).
"at_quarter" in the JSON is the headline: f = 0.25 against unpadded, target <= 1.3.

    python bench/sebp.py --out DIR [--quick]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time

import torch
from torch import nn

from edgetune.kernels import sebp

from edgetune.engine.training.lm_loss import causal_lm_loss

SHAPES = [
    ("llama-3.2-3b up_proj", 3072, 8192),
    ("qwen2.5-7b up_proj", 3584, 18944),
    ("qwen2.5-7b down_proj", 18944, 3584),
]
FRACTIONS = [0.1, 0.25, 0.5, 0.75, 1.0]
BATCH, SEQ, RANK = 16, 512, 16
DEVICE = "cuda"


class Holder(nn.Module):
    def __init__(self, layer):
        super().__init__()
        self.layer = layer

    def forward(self, x):
        return self.layer(x)


def right_padded_mask(f, gen, device):
    """[BATCH, SEQ] bool, each row a prefix; lengths vary, the total is round(f·rows)."""
    target = round(f * BATCH * SEQ)
    lengths = [target // BATCH + (i < target % BATCH) for i in range(BATCH)]
    for i in range(0, BATCH - 1, 2):  # uneven lengths, same total
        room = min(lengths[i] // 2, SEQ - lengths[i + 1])
        d = int(torch.randint(0, room + 1, (1,), generator=gen)) if room > 0 else 0
        lengths[i] -= d
        lengths[i + 1] += d
    lengths = torch.tensor(lengths)
    return (torch.arange(SEQ)[None, :] < lengths[:, None]).to(device)


def make_linear(k, n, gen):
    layer = nn.Linear(k, n, bias=False, dtype=torch.bfloat16, device=DEVICE)
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k, generator=gen) * 0.02)
    return Holder(layer), [layer.weight]


def make_lora_nf4(k, n, gen, dtype=torch.bfloat16):
    import bitsandbytes as bnb
    from peft import LoraConfig, get_peft_model

    base = bnb.nn.Linear4bit(k, n, bias=False, compute_dtype=dtype, compress_statistics=True,
                             quant_type="nf4", quant_storage=dtype)
    base.weight = bnb.nn.Params4bit((torch.randn(n, k, generator=gen) * 0.02).to(dtype), requires_grad=False,
                                    compress_statistics=True, quant_type="nf4", quant_storage=dtype)
    holder = Holder(base).to(DEVICE)  # quantises here
    holder.is_loaded_in_4bit = True  # makes PEFT pick its bnb Linear4bit LoRA layer
    model = get_peft_model(holder, LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=["layer"]))
    layer = model.base_model.model.layer
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    with torch.no_grad():
        a.copy_(torch.randn(a.shape, generator=gen) * 0.02)
        b.copy_(torch.randn(b.shape, generator=gen) * 0.02)
    return model.base_model.model, [a, b]


def rel(a, b):
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def peak_extra(fn):
    if DEVICE != "cuda":
        return 0
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_allocated() - base
    del out
    return peak


def bench_case(kind, k, n, f, gen, do_bench):
    holder, params = make_linear(k, n, gen) if kind == "linear" else make_lora_nf4(k, n, gen)
    handle = sebp.patch(holder)
    mask = right_padded_mask(f, gen, DEVICE)
    idx = mask.reshape(-1).nonzero().squeeze(1)
    x = (torch.randn(BATCH, SEQ, k, generator=gen) * 0.5).to(DEVICE, torch.bfloat16).requires_grad_(True)
    dy = torch.randn(BATCH, SEQ, n, generator=gen).to(DEVICE, torch.bfloat16)
    dy_masked = dy * mask[..., None]
    xc = x.detach().reshape(-1, k)[idx][None].requires_grad_(True)
    dyc = dy.reshape(-1, n)[idx][None]

    sebp.set_active_rows(handle, None)
    y_dense = holder(x)
    y_unpad = holder(xc)
    sebp.set_active_rows(handle, mask)
    handle.backend = "auto"  # on CUDA: whichever of the two paths below measured faster
    y_sebp = holder(x)
    handle.backend = "triton"  # row-gathering Triton GEMMs
    y_triton = holder(x)
    handle.backend = "torch"  # the same rows through index_select + cuBLAS (gathered copies)
    y_gather = holder(x)
    handle.backend = "auto"
    variants = {
        "dense": lambda: torch.autograd.grad(y_dense, [x, *params], dy_masked, retain_graph=True),
        "sebp": lambda: torch.autograd.grad(y_sebp, [x, *params], dy, retain_graph=True),
        "sebp_triton": lambda: torch.autograd.grad(y_triton, [x, *params], dy, retain_graph=True),
        "sebp_gather": lambda: torch.autograd.grad(y_gather, [x, *params], dy, retain_graph=True),
        "unpadded": lambda: torch.autograd.grad(y_unpad, [xc, *params], dyc, retain_graph=True),
    }
    ref = variants["dense"]()
    known = set(sebp._CHOICE)
    got = variants["sebp"]()  # also tunes the kernels for this shape and picks the path
    choice = [v for k, v in sebp._CHOICE.items() if k not in known]
    got_gather = variants["sebp_gather"]()
    errs = [rel(g, r) for g, r in zip(got, ref)]
    zero_ok = bool((got[0][~mask] == 0).all())
    row = {"kind": kind, "K": k, "N": n, "f": round(idx.numel() / (BATCH * SEQ), 4), "rel_err": max(errs),
           "rel_err_gather": max(rel(g, r) for g, r in zip(got_gather, ref)), "dx_zero_outside_R": zero_ok,
           "auto_choice": choice[0] if choice else ("triton" if DEVICE != "cuda" else "cached")}
    if kind == "lora-nf4" and DEVICE == "cuda" and idx.numel() < BATCH * SEQ:
        row["err_vs_fp32"] = fp32_errors(holder, x, dy, idx, params, ref, got)
    for name, fn in variants.items():
        row[f"{name}_ms"] = do_bench(fn)
        row[f"{name}_host_ms"] = host_ms(fn)
        row[f"{name}_peak_mib"] = peak_extra(fn) / 2**20
    if kind == "lora-nf4" and idx.numel() < BATCH * SEQ:
        row["pieces_ms"] = lora_pieces(holder, x, dy, mask, do_bench)
    row["sebp_vs_unpadded"] = row["sebp_ms"] / row["unpadded_ms"]
    row["gather_vs_unpadded"] = row["sebp_gather_ms"] / row["unpadded_ms"]
    row["triton_vs_unpadded"] = row["sebp_triton_ms"] / row["unpadded_ms"]
    row["sebp_vs_dense"] = row["sebp_ms"] / row["dense_ms"]
    row["extra_mib"] = row["sebp_peak_mib"] - row["dense_peak_mib"]
    sebp.unpatch(holder)
    return row


def host_ms(fn, reps=20):
    """Median host time to enqueue one backward (the GPU idle first, no sync after): when
    it reaches the do_bench time, the backward is bound by Python-side launches, not GPU."""
    times = []
    for _ in range(reps):
        if DEVICE == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        out = fn()
        times.append((time.perf_counter() - t) * 1e3)
        del out
    if DEVICE == "cuda":
        torch.cuda.synchronize()
    return sorted(times)[len(times) // 2]


def lora_pieces(holder, x, dy, mask, do_bench):
    """GPU time of each piece of the LoRA-over-NF4 sparse backward alone (ms): which
    kernel, if any, is slow at this fraction. The sum next to sebp_ms shows the share of
    launch overhead and gaps."""
    from edgetune.kernels import sebp_triton as st

    layer = holder.layer
    base = layer.base_layer
    rows = sebp.ActiveRows.from_mask(mask)
    idx, n = rows.index, rows.n_active
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    s = layer.scaling["default"]
    x2 = x.detach().reshape(-1, x.shape[-1])
    g2 = dy.reshape(-1, dy.shape[-1])
    w = sebp._dequant(base)
    dh = torch.empty((n, a.shape[0]), device=x.device, dtype=torch.float32)
    h = torch.empty_like(dh)
    db, da = torch.empty_like(b), torch.empty_like(a)
    dx = torch.empty_like(x2)
    out = {
        "dequant": do_bench(lambda: sebp._dequant(base)),
        "dh=s*dY[R]B": do_bench(lambda: st.gathered_mm(g2, idx, b, dh, scatter=False, alpha=s)),
        "h=X[R]At": do_bench(lambda: st.gathered_mm(x2, idx, a.t(), h, scatter=False)),
        "dB": do_bench(lambda: st.gathered_tn(g2, idx, h, db, gather_q=False, alpha=s)),
        "dA": do_bench(lambda: st.gathered_tn(x2, idx, dh, da.t(), gather_q=False)),
        "dx_memset": do_bench(lambda: dx.zero_()),
        "dx_gemm": do_bench(lambda: st.gathered_mm(g2, idx, w, dx, scatter=True, extra=(dh, a))),
    }
    out["sum"] = sum(out.values())
    # dX of the index_select + cuBLAS path (not in the sum above: the other path's dX):
    # the compact product, then one pass writing every row of dX (LoRA's share added).
    gr = g2.index_select(0, idx.long())
    part = gr @ w
    out["gather_dx_cublas"] = do_bench(lambda: gr @ w)
    out["gather_dx_scatter_rows"] = do_bench(lambda: st.scatter_rows(part, rows.position, dx, extra=(dh, a)))
    return out


def fp32_errors(holder, x, dy, idx, params, dense, ours):
    """Both bf16 backwards against fp32 math on the same (dequantised) weights."""
    import bitsandbytes.functional as bnbf

    layer = holder.layer
    w = bnbf.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state).float()
    a, b = (t.float() for t in params)
    s = layer.scaling["default"]
    xr = x.detach().reshape(-1, x.shape[-1])[idx].float()
    gr = dy.reshape(-1, dy.shape[-1])[idx].float()
    dh = s * (gr @ b)
    ref = [gr @ w + dh @ a, dh.t() @ xr, s * gr.t() @ (xr @ a.t())]
    pick = lambda g: [g[0].reshape(-1, g[0].shape[-1])[idx], g[1], g[2]]  # noqa: E731
    names = ("dx", "dA", "dB")
    return {v: {nm: rel(t, r) for nm, t, r in zip(names, pick(g), ref)} for v, g in (("dense", dense), ("sebp", ours))}


# --------------------------------------------------------------------------- CUDA check


def check_tiny_model():
    """A tiny NF4 + LoRA Llama in bf16 on CUDA: one step patched vs unpatched."""
    import tempfile

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    path = tempfile.mkdtemp()
    LlamaForCausalLM(cfg).save_pretrained(path)
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                           bnb_4bit_compute_dtype=torch.bfloat16, bnb_4bit_quant_storage=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(path, quantization_config=q, dtype=torch.bfloat16, device_map={"": 0})
    model.config.use_cache = False
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.enable_input_require_grads()
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", task_type="CAUSAL_LM"))
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.05)
    handle = sebp.patch(model)
    seq = 96
    lengths = torch.tensor([96, 70, 33, 5])
    attn = (torch.arange(seq)[None, :] < lengths[:, None])
    ids = torch.randint(0, 512, (4, seq), generator=gen)
    labels = ids.clone()
    labels[~attn] = -100
    labels[:, :8] = -100
    ids, attn, labels = ids.cuda(), attn.cuda(), labels.cuda()

    def step(mask, sparse_head):
        sebp.set_active_rows(handle, mask)
        model.zero_grad(set_to_none=True)
        if sparse_head:
            loss, _ = causal_lm_loss(model, {"input_ids": ids, "attention_mask": attn.long(), "labels": labels})
        else:
            loss = model(input_ids=ids, attention_mask=attn.long(), labels=labels).loss
        loss.backward()
        return loss.item(), {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}

    out = {"patched_layers": len(handle)}
    # the engine's training forward runs under bf16 autocast on CUDA: check SEBP there too
    for amp in (False, True):
        ctx = (lambda: torch.autocast("cuda", dtype=torch.bfloat16)) if amp else contextlib.nullcontext
        with ctx():
            loss_ref, g_ref = step(None, False)
        out["loss_dense" + ("_autocast" if amp else "")] = loss_ref
        for label, sparse_head in [("sebp", False), ("sebp+lm_head", True)]:
            with ctx():
                loss, g = step(attn, sparse_head)
            errs = {n: rel(g[n], g_ref[n]) for n in g_ref}
            out[label + ("_autocast" if amp else "")] = {
                "loss": loss, "loss_rel_err": abs(loss - loss_ref) / abs(loss_ref),
                "grad_rel_err_max": max(errs.values()), "grad_rel_err_median": sorted(errs.values())[len(errs) // 2]}
    sebp.unpatch(model)
    return out


def profile_kernels(do_bench, k=3072, n=8192):
    return _profile(do_bench, k, n)


def _profile(do_bench, k, n):
    """Each kernel alone against cuBLAS on compact rows, with the tiles autotuning chose."""
    from edgetune.kernels import sebp_triton as st

    gen = torch.Generator().manual_seed(2)
    out = []
    x2 = torch.randn(BATCH * SEQ, k, generator=gen).to(DEVICE, torch.bfloat16)
    g2 = torch.randn(BATCH * SEQ, n, generator=gen).to(DEVICE, torch.bfloat16)
    w = (torch.randn(n, k, generator=gen) * 0.02).to(DEVICE, torch.bfloat16)
    for f in (0.25, 0.5, 0.75, 1.0):
        rows = sebp.ActiveRows.from_mask(right_padded_mask(f, gen, DEVICE))
        idx = rows.index
        inactive = rows.inactive()
        xc, gc = x2[idx.long()], g2[idx.long()]
        dx = torch.empty_like(x2)
        dw = torch.empty_like(w)
        r = {"f": f,
             "dx_gathered": do_bench(lambda: st.gathered_mm(g2, idx, w, dx, scatter=True)),
             "dx_cublas_compact": do_bench(lambda: gc @ w),
             "dx_zero_fill": do_bench(lambda: dx.index_fill_(0, inactive, 0)),
             "dw_gathered": do_bench(lambda: st.gathered_tn(g2, idx, x2, dw, gather_q=True)),
             "dw_cublas_compact": do_bench(lambda: gc.t() @ xc)}
        r["mm_config"] = str(st._mm_wide.best_config) if DEVICE == "cuda" else ""
        r["tn_config"] = str(st._tn_wide.best_config) if DEVICE == "cuda" else ""
        out.append(r)
        print(json.dumps(r), flush=True)
    return out


def markdown(rows):
    lines = ["| layer | K→N | f | dense ms | sebp ms (host) [auto picks] | triton ms (host) | gather ms (host) "
             "| unpadded ms (host) | sebp/unpadded | triton/unpadded | gather/unpadded | sebp/dense | extra MiB | rel err |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['kind']} | {r['K']}→{r['N']} | {r['f']} | error: {r['error'][:80]} |||||||")
            continue
        lines.append(
            f"| {r['kind']} | {r['K']}→{r['N']} | {r['f']:.2f} | {r['dense_ms']:.3f} | "
            f"{r['sebp_ms']:.3f} ({r['sebp_host_ms']:.3f}) [{r.get('auto_choice')}] | "
            f"{r['sebp_triton_ms']:.3f} ({r['sebp_triton_host_ms']:.3f}) | "
            f"{r['sebp_gather_ms']:.3f} ({r['sebp_gather_host_ms']:.3f}) | "
            f"{r['unpadded_ms']:.3f} ({r['unpadded_host_ms']:.3f}) | {r['sebp_vs_unpadded']:.2f} | "
            f"{r['triton_vs_unpadded']:.2f} | {r['gather_vs_unpadded']:.2f} | {r['sebp_vs_dense']:.2f} | "
            f"{r['extra_mib']:+.0f} | {r['rel_err']:.1e} |")
    return "\n".join(lines)


def quarter_summary(rows, target=1.3):
    """The headline: backward time at f = 0.25 over the same layer on the unpadded rows
    alone (both from this run), against the target."""
    out = {}
    for r in rows:
        if "error" in r or abs(r["f"] - 0.25) > 0.01:
            continue
        key = f"{r['kind']} {r['K']}->{r['N']}"
        out[key] = {"sebp_vs_unpadded": round(r["sebp_vs_unpadded"], 3),
                    "triton_vs_unpadded": round(r["triton_vs_unpadded"], 3),
                    "gather_vs_unpadded": round(r["gather_vs_unpadded"], 3), "auto_choice": r.get("auto_choice"),
                    "sebp_host_ms": round(r["sebp_host_ms"], 3), "sebp_ms": round(r["sebp_ms"], 3),
                    "met": r["sebp_vs_unpadded"] <= target}
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--quick", action="store_true", help="the two 7B shapes, f = 0.25 and 1")
    ap.add_argument("--kinds", default="lora-nf4,linear")
    ap.add_argument("--profile", action="store_true", help="also time each kernel alone")
    ap.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, TRITON_INTERPRET: checks the script")
    args = ap.parse_args()
    os.makedirs(args.out, exist_ok=True)
    global DEVICE, BATCH, SEQ, SHAPES
    if args.dry_run:
        os.environ["TRITON_INTERPRET"] = "1"
        DEVICE, BATCH, SEQ, SHAPES = "cpu", 4, 16, [("tiny", 32, 48)]
        globals()["profile_kernels"] = lambda do_bench, k=32, n=48: _profile(do_bench, k, n)
    import triton

    def do_bench(fn):
        if DEVICE != "cuda":
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return triton.testing.do_bench(fn, warmup=10, rep=60, return_mode="median")

    result = {"device": torch.cuda.get_device_name() if DEVICE == "cuda" else "cpu", "torch": torch.__version__, "triton": triton.__version__,
              "rows": BATCH * SEQ, "command": " ".join(sys.argv), "date": time.strftime("%Y-%m-%d")}
    t0 = time.time()
    try:
        result["tiny_model_check"] = check_tiny_model() if DEVICE == "cuda" else {}
    except Exception as e:  # keep the timing table even if the check breaks
        result["tiny_model_check"] = {"error": f"{type(e).__name__}: {e}"}
    print(json.dumps(result["tiny_model_check"]), flush=True)
    if args.profile:
        try:
            result["profile"] = profile_kernels(do_bench)
        except Exception as e:
            result["profile"] = {"error": f"{type(e).__name__}: {e}"}
            print(result["profile"], flush=True)
    shapes = [sh for sh in SHAPES if "7b" in sh[0]] if args.quick and not args.dry_run else SHAPES
    fractions = [0.25, 1.0] if args.quick else FRACTIONS
    rows = []
    gen = torch.Generator().manual_seed(0)
    for kind in args.kinds.split(","):
        for name, k, n in shapes:
            for f in fractions:
                try:
                    row = bench_case(kind, k, n, f, gen, do_bench)
                except Exception as e:
                    row = {"kind": kind, "K": k, "N": n, "f": f, "error": f"{type(e).__name__}: {e}"}
                row["shape"] = name
                rows.append(row)
                print(json.dumps(row), f"t={time.time() - t0:.0f}s", flush=True)
                result["table"] = rows
                result["at_quarter"] = quarter_summary(rows)
                with open(os.path.join(args.out, "sebp.json"), "w") as fh:
                    json.dump(result, fh, indent=1)
                torch.cuda.empty_cache()
    print(markdown(rows))
    print("f = 0.25 vs unpadded (target <= 1.3):", json.dumps(result.get("at_quarter", {}), indent=1))


if __name__ == "__main__":
    main()
