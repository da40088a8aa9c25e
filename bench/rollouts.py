"""Rollout throughput: model.generate (default, and HF's static cache + compile) against
edgetune's rollouts.generate (static loop + CUDA graph; NF4 base through bitsandbytes'
layers, through the NF4 kernel on the 4-bit codes (kernels/nf4_matmul.py, model.nf4_kernel
on), a bf16 copy of some layers with the rest through bitsandbytes or through the kernel,
the whole bf16 copy, and that copy with the decode step under torch.compile, which this
script applies itself), all in one process on one model, so the ratios hold on a shared
machine.

Model: random-init Qwen2.5-7B architecture, NF4 (built layer by layer on the GPU by
bench/reference/baseline.py), then edgetune's
own add_lora (r=16, all linear projections, no gradient checkpointing): the model F-GRPO
samples from. Batch 64, 128-token prompts, 256 new tokens, temperature 1.0. The model
never emits EOS on purpose here; every row runs all 256 steps in every method.

Correctness on the GPU: a small random Qwen2 in fp32 (greedy, ragged left-padded prompts)
must give model.generate's tokens exactly through the CUDA-graph path; on the 7B model the
share of greedy tokens equal to model.generate's (up to the first divergence, bf16) is
reported, for the NF4 (bitsandbytes), NF4-kernel and bf16-copy paths, with each one's
log-probabilities against a full forward.

    export PYTHONPATH=$PWD/.gpu-site:$PYTHONPATH; python bench/rollouts.py   # on the GPU
    python bench/rollouts.py --tiny                                          # CPU smoke run (the
                                                                             # kernel interpreted)
    python bench/rollouts.py --72b                                           # 72B, GPU

--72b: random-init Qwen2.5-72B architecture built layer by layer on the GPU in NF4
(baseline.build_72b_layers, capped by --max-build-s, layers truncated and noted when
slower), LoRA r16; no whole bf16 copy (it would need 145 GB): bitsandbytes' layers and the
NF4 kernel against a copy of as many layers as fit (the rest through either), with --new
tokens (default 64) so that all fit the budget.
Writes $OUT/rollouts.json; prints a markdown table last.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "bench" / "reference"))
sys.path.insert(0, str(ROOT))

ap = argparse.ArgumentParser()
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--budget", type=float, default=380.0)
ap.add_argument("--skip", default="", help="comma list: default,static,ours_nf4,ours_nf4_kernel,ours_mixed,"
                                            "ours_mixed_kernel,ours_bf16,ours_bf16_compiled,check7b")
ap.add_argument("--rounds", type=int, default=1,
                help="interleaved rounds: every row once per round (A B C A B C); a row's figure is its median round")
ap.add_argument("--72b", dest="big", action="store_true", help="Qwen2.5-72B architecture (GPU)")
ap.add_argument("--max-build-s", type=float, default=150.0, help="72B: stop building layers after this (noted)")
ap.add_argument("--new", type=int, default=0, help="new tokens per row (default 256; 64 with --72b)")
ap.add_argument("--mixed-layers", type=int, default=-1,
                help="layers the ours_mixed row copies to bf16 (default: half the layers at 7B, as many as fit "
                     "with --72b; 0 = none: every layer NF4 through bitsandbytes, but packed)")
args = ap.parse_known_args()[0]
if args.tiny:  # the NF4 kernel's rows on the CPU: Triton's interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import baseline as B  # noqa: E402  (reads --tiny itself)
import torch  # noqa: E402

from edgetune.engine.core.settings import LoraSettings  # noqa: E402

from edgetune.engine.models.model import add_lora  # noqa: E402

from edgetune.engine.generation import fast_decode, rollouts  # noqa: E402

T0 = time.perf_counter()
OUT = os.environ.get("OUT", ".")
DEV = B.DEV
BATCH, PROMPT, NEW = (4, 16, 8) if args.tiny else (64, 128, 256)
NEW = args.new or (min(NEW, 64) if args.big else NEW)
ARCH = "72B" if args.big else "7B"
R: dict = {"env": {}, "setup": {}, "check": {}, "speed": {}, "errors": {}}


def left():
    return args.budget - (time.perf_counter() - T0)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def dump():
    with open(os.path.join(OUT, "rollouts.json"), "w") as f:
        json.dump(R, f, indent=1, default=str)


def guarded(key, fn, need_s=0):
    if key in args.skip.split(",") or left() < need_s:
        R["errors"][key] = f"skipped ({left():.0f}s left)"
        return None
    try:
        return fn()
    except Exception as e:  # noqa: BLE001
        R["errors"][key] = f"{type(e).__name__}: {e}"[:1500]
        log(f"ERROR {key}: {type(e).__name__}: {e}")
        traceback.print_exc()
        return None
    finally:
        dump()


class IdTokenizer:
    """What rollouts.generate needs from a tokenizer when prompts are token ids: ids of
    eos and pad, and a decoder (ids as text: the random model has no vocabulary)."""

    def __init__(self, eos, pad):
        self.eos_token_id, self.pad_token_id = eos, pad

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def peak_gib():
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if DEV == "cuda" else 0.0


def reset_peak():
    B.cleanup()


# --------------------------------------------------------------------------- correctness


def check_small():
    """Greedy through the CUDA graph == model.generate, fp32, ragged left padding."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                      num_key_value_heads=2, vocab_size=2048, tie_word_embeddings=False, bos_token_id=1,
                      eos_token_id=2, max_position_embeddings=4096)
    m = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32, attn_implementation="sdpa").to(DEV).eval()
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 2048, (n,), generator=g).tolist() for n in (5, 11, 17, 23)]
    ids, mask = rollouts.left_pad(prompts, 0, DEV)

    def hf(eos):
        with torch.no_grad():
            return m.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=40,
                              pad_token_id=0, eos_token_id=eos)[:, ids.shape[1]:]

    # Rows must stop inside the run to check masks and stopping: call EOS the token that
    # row 0 emits greedily at step 6.
    eos = int(hf(2)[0, 6])
    tok = IdTokenizer(eos=eos, pad=0)
    ours = rollouts.generate(m, tok, prompts, greedy=True, max_new_tokens=40, fast=True)
    info = dict(ours.info)
    ref = hf(eos)
    R["check"]["small_rows_stopped"] = sum(not t for t in ours.truncated)
    T = ours.completion_ids.shape[1]
    same = torch.equal(ours.completion_ids, ref[:, :T])
    R["check"]["small_fp32_greedy_equal"] = bool(same)
    R["check"]["small_fp32_info"] = info
    log("small fp32 greedy equal:", same, info)


def recompute(model, prompt_ids, prompt_mask, comp):
    """log_softmax of a full forward over prompt + completion, at the completion tokens."""
    ids = torch.cat([prompt_ids, comp], 1)
    mask = torch.cat([prompt_mask, torch.ones_like(comp)], 1)
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits.float()
    P, T = prompt_ids.shape[1], comp.shape[1]
    return torch.log_softmax(logits[:, P - 1:P + T - 1], -1).gather(-1, comp[..., None]).squeeze(-1)


def greedy_agreement(model, tok, n_rows=8, n_new=32, **kw):
    """Greedy tokens against model.generate's (up to the first divergence), and the
    log-probs of each against a full forward over its own tokens: a random-init model has
    small top-2 gaps, so bf16 rounding alone flips some argmaxes; the log-prob errors
    of model.generate's own incremental decode give the noise floor to compare with."""
    g = torch.Generator().manual_seed(5)
    lens = torch.randint(PROMPT // 2, PROMPT + 1, (n_rows,), generator=g).tolist()
    prompts = [torch.randint(3, 1000, (n,), generator=g).tolist() for n in lens]
    ours = rollouts.generate(model, tok, prompts, greedy=True, max_new_tokens=n_new, fast=True, **kw)
    info = dict(ours.info)
    ids, mask = rollouts.left_pad(prompts, tok.pad_token_id, DEV)
    with torch.no_grad():
        out = model.generate(input_ids=ids, attention_mask=mask, do_sample=False, max_new_tokens=n_new,
                             min_new_tokens=n_new, pad_token_id=tok.pad_token_id, output_logits=True,
                             return_dict_in_generate=True)
    ref = out.sequences[:, ids.shape[1]:]
    hf_lp = torch.stack([torch.log_softmax(x.float(), -1) for x in out.logits], 1).gather(-1, ref[..., None]).squeeze(-1)
    o = ours.completion_ids[:, :n_new]
    r = ref[:, : o.shape[1]]
    first_diff = [(int((a != b).nonzero()[0]) if (a != b).any() else o.shape[1]) for a, b in zip(o.cpu(), r.cpu())]
    err_ours = (ours.logprobs - recompute(model, ids, mask, ours.completion_ids)).abs()
    err_hf = (hf_lp - recompute(model, ids, mask, ref)).abs()
    return {"rows_identical": sum(d == o.shape[1] for d in first_diff), "rows": n_rows,
            "tokens_before_first_divergence": sum(first_diff), "tokens": n_rows * o.shape[1],
            "first_divergence": first_diff,
            "logprob_err_vs_full_forward": {"ours_max": round(float(err_ours.max()), 4),
                                            "ours_mean": round(float(err_ours.mean()), 5),
                                            "hf_generate_max": round(float(err_hf.max()), 4),
                                            "hf_generate_mean": round(float(err_hf.mean()), 5)},
            "info": info}


# --------------------------------------------------------------------------- speed


def prompts_ids(vocab):
    g = torch.Generator().manual_seed(1)
    return torch.randint(3, min(vocab, 1000), (BATCH, PROMPT), generator=g)


def time_hf(model, ids, static, reps=1):
    kw = dict(do_sample=True, temperature=1.0, top_p=1.0, top_k=0, pad_token_id=0, max_new_tokens=NEW,
              min_new_tokens=NEW)
    if static:
        kw["cache_implementation"] = "static"
    am = torch.ones_like(ids)
    model.eval()
    with torch.no_grad():
        B.sync()
        t = time.perf_counter()
        # warm-up: the full run when static (compiles for that cache length), else a short one
        model.generate(input_ids=ids, attention_mask=am, **(kw if static else {**kw, "max_new_tokens": 8,
                                                                              "min_new_tokens": 8}))
        B.sync()
        first = time.perf_counter() - t
        times = []
        for _ in range(reps):
            reset_peak()
            t = time.perf_counter()
            out = model.generate(input_ids=ids, attention_mask=am, **kw)
            B.sync()
            times.append(time.perf_counter() - t)
    n = out.shape[0] * (out.shape[1] - ids.shape[1])
    return {"first_call_s": round(first, 2), "times_s": [round(x, 3) for x in times], "new_tokens": n,
            "tok_per_s": round(n / min(times)), "ms_per_step": round(1000 * min(times) / NEW, 2),
            "peak_GiB": peak_gib()}


def mixed_layers(cfg) -> int | None:
    if args.mixed_layers >= 0:
        return args.mixed_layers
    return None if args.big else cfg["num_hidden_layers"] // 2


def time_ours(model, tok, ids, bf16, compile_step=False, reps=2, dense_layers=None, nf4_kernel="off"):
    if compile_step:  # the packed decode step under torch.compile (the engine never compiles it)
        step = fast_decode.packed_step
        fast_decode.packed_step = torch.compile(step, dynamic=False)
        try:
            return time_ours(model, tok, ids, bf16, reps=reps, dense_layers=dense_layers, nf4_kernel=nf4_kernel)
        finally:
            fast_decode.packed_step = step
    prompts = ids.tolist()
    kw = dict(max_new_tokens=NEW, temperature=1.0, seed=0, fast=True, bf16_weights=bf16, dense_layers=dense_layers,
              nf4_kernel=nf4_kernel)
    B.sync()
    t = time.perf_counter()
    rollouts.generate(model, tok, prompts, **kw)  # warm-up (graph capture, allocator, compile)
    B.sync()
    first = time.perf_counter() - t
    times = []
    for i in range(reps):
        reset_peak()
        t = time.perf_counter()
        rb = rollouts.generate(model, tok, prompts, **{**kw, "seed": i + 1})
        B.sync()
        times.append(time.perf_counter() - t)
    steps = rb.completion_ids.shape[1]
    n = BATCH * steps
    return {"first_call_s": round(first, 2), "times_s": [round(x, 3) for x in times], "new_tokens": n,
            "masked_tokens": int(rb.completion_mask.sum()), "steps": steps,
            "tok_per_s": round(n / min(times)), "ms_per_step": round(1000 * min(times) / steps, 2),
            "peak_GiB": peak_gib(), "info": dict(rb.info)}


def main():
    import bitsandbytes as bnb
    import peft
    import transformers

    R["env"] = {"torch": torch.__version__, "transformers": transformers.__version__, "peft": peft.__version__,
                "bitsandbytes": bnb.__version__, "device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu",
                "batch": BATCH, "prompt": PROMPT, "new_tokens": NEW, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    log("env", R["env"])
    guarded("check_small", check_small)

    cfg = B.C72B if args.big else B.C7B

    def build():
        if args.big:
            m, bt, layers = B.build_72b_layers(B.C72B, args.max_build_s)
            R["setup"]["layers"] = layers
        else:
            m, bt = B.build_model(B.C7B, quant=True)
        R["setup"]["build_s"] = round(bt, 1)
        pm = add_lora(m, LoraSettings(r=16, alpha=32), gradient_checkpointing=False)
        g = torch.Generator(device=DEV).manual_seed(0)
        for n, p in pm.named_parameters():  # a trained-looking adapter, not the B = 0 no-op
            if "lora_B" in n:
                p.data.copy_(torch.randn(p.shape, generator=g, device=DEV, dtype=p.dtype) * 1e-3)
        R["setup"]["mem_after_load_GiB"] = round(torch.cuda.memory_allocated() / 2**30, 2) if DEV == "cuda" else 0
        R["setup"]["lora_dtype"] = str(next(p.dtype for n, p in pm.named_parameters() if "lora_A" in n))
        R["setup"]["embed_dtype"] = str(pm.get_base_model().model.embed_tokens.weight.dtype)
        log(f"built {ARCH} NF4 + LoRA", R["setup"])
        return pm

    pm = guarded("build", build)
    if pm is None:
        return
    vocab = cfg["vocab_size"]
    eos = cfg["eos_token_id"]
    tok = IdTokenizer(eos=eos, pad=0)
    ids = prompts_ids(vocab).to(DEV)
    pm.eval()

    def check7b():
        R["check"]["7b_nf4"] = greedy_agreement(pm, tok, bf16_weights=False)
        R["check"]["7b_nf4_kernel"] = greedy_agreement(pm, tok, bf16_weights=False, nf4_kernel="on")
        if not args.big:
            R["check"]["7b_bf16_packed"] = greedy_agreement(pm, tok, bf16_weights=True)
        log("greedy agreement", {k: v for k, v in R["check"].items() if k.startswith("7b")})

    guarded("check7b", check7b, 40)
    rows = [
        ("ours_bf16", lambda: time_ours(pm, tok, ids, True), 30),
        ("ours_nf4", lambda: time_ours(pm, tok, ids, False), 30),
        # every layer on its 4-bit codes through the NF4 kernel, LoRA in its epilogue: no copy
        ("ours_nf4_kernel", lambda: time_ours(pm, tok, ids, False, nf4_kernel="on"), 30),
        # the copy of as many layers as the free memory holds (72B), or of half of them (7B,
        # where the whole copy fits): between the two rows above
        ("ours_mixed", lambda: time_ours(pm, tok, ids, None, dense_layers=mixed_layers(cfg)), 30),
        # the same copy, the other layers through the NF4 kernel instead of bitsandbytes
        ("ours_mixed_kernel", lambda: time_ours(pm, tok, ids, None, dense_layers=mixed_layers(cfg),
                                                nf4_kernel="on"), 30),
        ("default", lambda: time_hf(pm, ids, False), 60),
        ("static", lambda: time_hf(pm, ids, True), 100),
        ("ours_bf16_compiled", lambda: time_ours(pm, tok, ids, True, compile_step=True), 60),
    ]
    if args.big:  # no room for a bf16 copy; model.generate at 72B would take the whole budget
        rows = [r for r in rows if r[0] in ("ours_nf4", "ours_nf4_kernel", "ours_mixed", "ours_mixed_kernel")]
    rounds: dict = {}
    for n in range(max(1, args.rounds)):  # interleaved: a slow window of the card hits every row alike
        for key, fn, need in rows:
            r = guarded(key, fn, need)
            if r is not None:
                rounds.setdefault(key, []).append(r)
                log(key, f"round {n + 1}", r)
        for key, rs in rounds.items():  # the median round (by tokens/s) stands for the row
            R["speed"][key] = {**sorted(rs, key=lambda r: r["tok_per_s"])[len(rs) // 2],
                               "rounds_tok_per_s": [r["tok_per_s"] for r in rs]}
        dump()


def table():
    S = R["speed"]
    base = S.get("default", {}).get("tok_per_s")
    stat = S.get("static", {}).get("tok_per_s")
    names = {"default": "model.generate (default)", "static": 'model.generate (cache_implementation="static")',
             "ours_nf4": "rollouts.generate, NF4 base through bitsandbytes (CUDA graph)",
             "ours_nf4_kernel": "rollouts.generate, NF4 base through the NF4 kernel, no copy (CUDA graph)",
             "ours_bf16": "rollouts.generate, packed bf16 copy (CUDA graph)",
             "ours_mixed": "rollouts.generate, bf16 copy of some layers, the rest NF4 through bitsandbytes (CUDA graph)",
             "ours_mixed_kernel": "rollouts.generate, bf16 copy of some layers, the rest through the NF4 kernel "
                                  "(CUDA graph)",
             "ours_bf16_compiled": "rollouts.generate, packed bf16 copy, torch.compile + CUDA graph"}
    lines = [f"{R['env'].get('date', '')}, {R['env'].get('device', '')}, torch {R['env'].get('torch')}, "
             f"transformers {R['env'].get('transformers')}; {ARCH} NF4 ({R['setup'].get('layers', 'all')} layers) + "
             f"LoRA r16, batch {BATCH}, prompt {PROMPT}, "
             f"{NEW} new tokens, sampling", "",
             "| method | tokens/s | ms/step | x default | x static | peak GiB | first call s |",
             "|---|---|---|---|---|---|---|"]
    for k in ("default", "static", "ours_nf4", "ours_nf4_kernel", "ours_mixed", "ours_mixed_kernel", "ours_bf16",
              "ours_bf16_compiled"):
        if k not in S:
            lines.append(f"| {names[k]} | {R['errors'].get(k, 'not run')[:80]} | | | | | |")
            continue
        s = S[k]
        xd = f"{s['tok_per_s'] / base:.1f}" if base else "-"
        xs = f"{s['tok_per_s'] / stat:.1f}" if stat else "-"
        lines.append(f"| {names[k]} | {s['tok_per_s']:,} | {s['ms_per_step']} | {xd} | {xs} | {s['peak_GiB']} | "
                     f"{s['first_call_s']} |")
    nf4 = S.get("ours_nf4", {}).get("tok_per_s")
    mixed = S.get("ours_mixed", {})
    if mixed and nf4:
        R["mixed_over_bnb_nf4"] = round(mixed["tok_per_s"] / nf4, 3)
        lines += ["", f"bf16 copy of {mixed['info'].get('dense_layers')} layers, the rest NF4 / NF4 through bitsandbytes "
                  f"(same run): {mixed['tok_per_s'] / nf4:.2f}x tokens/s"]
    kern, copy = S.get("ours_nf4_kernel", {}).get("tok_per_s"), S.get("ours_bf16", {}).get("tok_per_s")
    for name, other in (("NF4 through bitsandbytes", nf4), ("the packed bf16 copy", copy)):
        if kern and other:
            lines.append(f"NF4 kernel / {name} (same run): {kern / other:.2f}x tokens/s")
    mk = S.get("ours_mixed_kernel", {}).get("tok_per_s")
    if mk and mixed:
        R["mixed_kernel_over_mixed"] = round(mk / mixed["tok_per_s"], 3)
        lines.append(f"bf16 copy + NF4 kernel / bf16 copy + bitsandbytes (same run): {mk / mixed['tok_per_s']:.3f}x "
                     "tokens/s")
    for k, s in S.items():
        if len(s.get("rounds_tok_per_s", [])) > 1:
            lines.append(f"{k}: rounds {s['rounds_tok_per_s']} tokens/s")
    lines += ["", f"checks: {json.dumps(R['check'], default=str)[:1500]}", f"errors: {json.dumps(R['errors'])[:1500]}"]
    print("\n".join(lines))


if __name__ == "__main__":
    try:
        main()
    finally:
        R["total_s"] = round(time.perf_counter() - T0, 1)
        dump()
        table()
