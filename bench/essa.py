#!/usr/bin/env python3
"""ESSA population evaluation on one GPU: sequential vs batched (multi-LoRA) candidates.

Model: the Qwen2.5-7B architecture (hidden 3584, intermediate 18944, 28 layers, 28 heads,
4 KV heads, vocab 152064) with random weights, built on the device one decoder layer at a
time and quantised to NF4 right away, so neither the bf16 model nor any file of it ever
exists whole. LoRA r=8 on q, k, v, o with random non-zero factors stands in for a warm
start (throughput does not depend on what the weights say).

Measured greedy, every row generating exactly --new-tokens (EOS is an id the model cannot
emit), first with the same decode loop (engine/generation/rollouts.py, plain loop) in every mode:
  sequential  candidates one after another (P rows each); timed on a few candidates,
              seconds per generation = population x seconds per candidate
  batched     K candidates x P rows in one generate call, per-row adapters
  plain       the same K x P rows through the same model with its one adapter (what any
              batched inference of this model costs), and with the adapter switched off
then through the rollouts' static / CUDA-graph loop (engine/generation/fast_decode.py), when it
supports the model (what every mode gets by default on CUDA):
  fast loop   sequential candidates, plain inference of the K x P rows with one adapter,
              and batched candidates (per-row stacked factors in the packed step)
Reported: candidates/min, s/generation, peak GPU memory per mode, generated tokens/s of
batched vs plain inference on the same loop (target >= 0.8x on the fast loop), batched vs
sequential candidates/min, and that batched and sequential fitness agree.

    python bench/essa.py --tiny        # CPU, tiny config: checks that everything runs
    python bench/essa.py               # GPU: writes $OUT/essa.json, prints a table (~2-4 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # edgetune.* without installing

QWEN25_7B = dict(hidden_size=3584, intermediate_size=18944, num_hidden_layers=28, num_attention_heads=28,
                 num_key_value_heads=4, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                 rms_norm_eps=1e-6, tie_word_embeddings=False)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=512, max_position_embeddings=512, tie_word_embeddings=False)
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj"]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny config on the CPU (a functional check)")
    p.add_argument("--population", type=int, default=None, help="candidates per generation (default 32; tiny 6)")
    p.add_argument("--k", type=int, default=0, help="candidates per batched forward (0 = the population)")
    p.add_argument("--prompts", type=int, default=None, help="prompts per generation P (default 16; tiny 3)")
    p.add_argument("--prompt-len", type=int, default=None, help="prompt tokens (default 64; tiny 8)")
    p.add_argument("--new-tokens", type=int, default=None, help="generated tokens (default 64; tiny 6)")
    p.add_argument("--sequential-candidates", type=int, default=None,
                   help="candidates timed in sequential mode (default 4; tiny 2)")
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    a = p.parse_args(argv)
    small, big = (6, 3, 8, 6, 2), (32, 16, 64, 64, 4)
    for name, t, b in zip(("population", "prompts", "prompt_len", "new_tokens", "sequential_candidates"), small, big):
        if getattr(a, name) is None:
            setattr(a, name, t if a.tiny else b)
    return a


# --------------------------------------------------------------------------- model


def build_nf4_model(arch: dict, device: str, dtype):
    """Random-init Qwen2 in NF4, decoder layer by decoder layer on `device`: peak extra
    memory is one layer in `dtype` (~0.5 GB at 7B), never the whole model."""
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, Qwen2Config

    cfg = Qwen2Config(**arch, use_cache=True, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation="sdpa")

    def init_(module):
        module.to_empty(device=device)
        for name, p in module.named_parameters():
            with torch.no_grad():
                if p.dim() == 1:  # biases 0, norm weights 1
                    p.zero_() if name.endswith("bias") else p.fill_(1.0)
                else:
                    p.normal_(0.0, 0.02)

    for layer in model.model.layers:
        init_(layer)
        for parent in list(layer.modules()):
            for cname, lin in list(parent.named_children()):
                if type(lin) is not torch.nn.Linear:
                    continue
                q = bnb.nn.Linear4bit(lin.in_features, lin.out_features, bias=lin.bias is not None,
                                      compute_dtype=dtype, compress_statistics=True, quant_type="nf4",
                                      device="meta")
                q.weight = bnb.nn.Params4bit(lin.weight.data, requires_grad=False, compress_statistics=True,
                                             quant_type="nf4", module=q).to(device)  # quantises here
                if lin.bias is not None:
                    q.bias = torch.nn.Parameter(lin.bias.data, requires_grad=False)
                setattr(parent, cname, q)
    for part in (model.model.embed_tokens, model.model.norm, model.lm_head):
        init_(part)
    model.model.rotary_emb = type(model.model.rotary_emb)(config=model.config).to(device)
    meta = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.device.type == "meta"]
    assert not meta, f"left on meta: {meta[:3]}"
    model.is_loaded_in_4bit = True  # PEFT then wraps the Linear4bit layers with its bnb LoRA layer
    return model.eval()


def add_random_lora(model, rank: int, seed: int = 0):
    from peft import LoraConfig, get_peft_model

    model = get_peft_model(model, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=TARGETS, lora_dropout=0.0))
    g = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_" in n:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)
    return model.eval()


class IdTokenizer:
    """What the rollouts need from a tokenizer, for a model without one: token-id prompts
    in, completions decoded as space-separated ids. EOS is -1, which no model emits, so
    every row generates exactly max_new_tokens."""

    eos_token_id = -1
    pad_token_id = 0
    chat_template = None

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(str(t) for t in r) for r in rows]


def id_reward(completions, rows, truncated=None):
    """A reward that depends on every generated id (so equal fitness ~ equal text)."""
    return [sum(int(t) % 7 for t in c.split()) / (7 * max(1, len(c.split()))) for c in completions], \
        [None] * len(completions)


# --------------------------------------------------------------------------- measuring


def info_evaluator():
    """An ESSA Evaluator that keeps the rollouts' info of its last generate call (which
    decode path the batched candidates took: packed, graph, capture time)."""
    from edgetune.engine.methods.essa.population import Evaluator

    class InfoEvaluator(Evaluator):
        last_info: dict = {}

        def _generate(self, prompts, seed, fast):
            out = super()._generate(prompts, seed, fast)
            self.last_info = out.info
            return out

    return InfoEvaluator


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def peak_reset(device):
    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()


def peak_gib(device):
    return round(torch.cuda.max_memory_allocated() / 2**30, 2) if device == "cuda" else 0.0


def main(argv=None) -> dict:
    a = parse_args(argv)
    from edgetune.engine.core.settings import ESSASettings

    from edgetune.engine.generation.rollouts import generate

    from edgetune.engine.methods.essa.essa import make_es
    from edgetune.engine.methods.essa.population import Evaluator
    from edgetune.engine.methods.essa.space import SVDSpace

    device = "cuda" if torch.cuda.is_available() and not a.tiny else "cpu"
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    if device == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    arch = TINY if a.tiny else QWEN25_7B
    R: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "device": torch.cuda.get_device_name(0) if device == "cuda"
               else platform.processor() or "cpu", "torch": torch.__version__, "arch": arch,
               "settings": {k: v for k, v in vars(a).items() if k != "out"}}
    t0 = time.time()
    model = add_random_lora(build_nf4_model(arch, device, dtype), a.rank)
    sync(device)
    R["build_s"] = round(time.time() - t0, 1)
    R["memory_after_load_gib"] = round(torch.cuda.memory_allocated() / 2**30, 2) if device == "cuda" else 0.0
    print(f"built in {R['build_s']} s, {R['memory_after_load_gib']} GiB", flush=True)

    tok = IdTokenizer()
    space = SVDSpace(model)
    R["search_dim"] = space.dim
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, arch["vocab_size"], (a.prompts, a.prompt_len), generator=g).tolist()
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    k = a.k or a.population
    s = ESSASettings(population=a.population, sigma0=0.05, max_new_tokens=a.new_tokens, greedy=True,
                     prompts_per_generation=a.prompts)
    xs = make_es(space.dim, s, seed=0, values=space.values()).ask()
    n_seq = min(a.sequential_candidates, a.population)

    def gen_tokens(n_rows):
        return n_rows * a.new_tokens

    # warm-up: kernels, allocator, cuBLAS handles (not timed)
    seq_eval = Evaluator(model, tok, space, id_reward, s, fast=False)  # plain loop rows: fast=False throughout
    seq_eval.population(xs[:1], rows[:2])

    def timed(evaluator, cands):
        """(fitness, seconds) of one evaluator over `cands` on every row, peak memory reset first."""
        peak_reset(device)
        sync(device)
        t = time.time()
        fit = evaluator.population(cands, rows)
        sync(device)
        return fit, time.time() - t

    def one_at_a_time(per_cand: float) -> dict:
        return {"s_per_candidate": round(per_cand, 3), "candidates_per_min": round(60 / per_cand, 1),
                "s_per_generation": round(per_cand * a.population, 2),
                "gen_tokens_per_s": round(gen_tokens(a.prompts) / per_cand, 1), "peak_gib": peak_gib(device)}

    # -- sequential
    fit_seq, dt = timed(seq_eval, xs[:n_seq])
    R["sequential"] = {"candidates_timed": n_seq, **one_at_a_time(dt / n_seq)}
    print("sequential", R["sequential"], flush=True)

    # -- batched
    s_b = ESSASettings(**{**s.__dict__, "evaluation": "batched"})
    bat_eval = Evaluator(model, tok, space, id_reward, s_b, candidates_per_batch=k, fast=False)
    bat_eval.population(xs[:2], rows[:2])  # warm-up of the batched path
    fit_bat, dt = timed(bat_eval, xs)
    R["batched"] = {"k": k, "rows_per_forward": k * a.prompts, "s_per_generation": round(dt, 2),
                    "candidates_per_min": round(60 * a.population / dt, 1),
                    "gen_tokens_per_s": round(gen_tokens(a.population * a.prompts) / dt, 1),
                    "peak_gib": peak_gib(device)}
    R["fitness_equal_on_sequential_candidates"] = bool(np.allclose(fit_bat[:n_seq], fit_seq, atol=0.0))
    R["fitness_max_abs_diff"] = float(np.max(np.abs(np.array(fit_bat[:n_seq]) - np.array(fit_seq))))
    print("batched", R["batched"], "fitness equal:", R["fitness_equal_on_sequential_candidates"], flush=True)

    # -- numerics: one prefill forward, batched vs one candidate at a time (greedy texts of a
    # random-init model sit on near-ties, so bf16 rounding alone can change them)
    ids = torch.tensor(prompts[:2], device=device)
    with torch.inference_mode():
        ref = []
        for x in xs[:2]:
            space.write(x)
            ref.append(model(input_ids=ids).logits[:, -1].float())
        from edgetune.engine.generation.multilora import batched_lora

        with batched_lora(space.modules, space.stacked(np.asarray(xs[:2])), torch.arange(2).repeat_interleave(2)):
            got = model(input_ids=ids.repeat(2, 1)).logits[:, -1].float()
    ref = torch.cat(ref)
    R["prefill_logits_max_abs_diff"] = float((got - ref).abs().max())
    R["prefill_logits_max_abs"] = float(ref.abs().max())

    # -- plain batched inference of the same rows (one adapter; then none)
    space.restore()
    plain_prompts = [r["prompt"] for r in rows] * min(k, a.population)
    chunks = -(-a.population // k)  # the batched run made this many generate calls
    for name, ctx in (("plain_lora", None), ("plain_base", "off")):
        peak_reset(device)
        sync(device)
        t = time.time()
        with torch.inference_mode():
            if ctx == "off":
                with model.disable_adapter():
                    for _ in range(chunks):
                        generate(model, tok, plain_prompts, max_new_tokens=a.new_tokens, greedy=True, fast=False)
            else:
                for _ in range(chunks):
                    generate(model, tok, plain_prompts, max_new_tokens=a.new_tokens, greedy=True, fast=False)
        sync(device)
        dt = time.time() - t
        R[name] = {"rows": len(plain_prompts), "calls": chunks, "s": round(dt, 2),
                   "gen_tokens_per_s": round(gen_tokens(len(plain_prompts) * chunks) / dt, 1),
                   "peak_gib": peak_gib(device)}
        print(name, R[name], flush=True)
    # -- the rollouts' fast loop (static KV cache, CUDA graph, packed bf16 weights): what
    # sequential and batched ESSA and plain inference get by default on CUDA.
    from edgetune.engine.generation import fast_decode

    InfoEvaluator = info_evaluator()

    ok, why = fast_decode.supported(model, torch.device(device), require_cuda=False)
    R["fast_loop"] = {"supported": ok, "why_not": why}
    if ok:
        try:
            fast_eval = Evaluator(model, tok, space, id_reward, s, fast=True)
            fast_eval.population(xs[:1], rows[:2])  # warm-up / graph capture
            fit_fast, dt = timed(fast_eval, xs[:n_seq])
            R["fast_loop"]["fitness_max_abs_diff_vs_plain_loop"] = float(np.max(np.abs(np.array(fit_fast) - fit_seq)))
            R["fast_loop"]["sequential"] = one_at_a_time(dt / n_seq)
            space.restore()
            with torch.inference_mode():
                generate(model, tok, plain_prompts[:2], max_new_tokens=a.new_tokens, greedy=True, fast=True)
                peak_reset(device)
                sync(device)
                t = time.time()
                for _ in range(chunks):
                    generate(model, tok, plain_prompts, max_new_tokens=a.new_tokens, greedy=True, fast=True)
                sync(device)
            dt = time.time() - t
            R["fast_loop"]["plain_lora"] = {"rows": len(plain_prompts), "s": round(dt, 2),
                                            "gen_tokens_per_s": round(gen_tokens(len(plain_prompts) * chunks) / dt, 1),
                                            "peak_gib": peak_gib(device)}
            # batched candidates, per-row stacked factors in the fast loop's packed step
            fast_bat = InfoEvaluator(model, tok, space, id_reward, s_b, candidates_per_batch=k, fast=True)
            fast_bat.population(xs[:2], rows[:2])  # warm-up of the per-row path
            fit_fb, dt = timed(fast_bat, xs)
            info = fast_bat.last_info
            R["fast_loop"]["batched"] = {
                "k": k, "rows_per_forward": k * a.prompts, "s_per_generation": round(dt, 2),
                "candidates_per_min": round(60 * a.population / dt, 1),
                "gen_tokens_per_s": round(gen_tokens(a.population * a.prompts) / dt, 1), "peak_gib": peak_gib(device),
                "packed": info.get("packed"), "graph": info.get("graph"), "graph_error": info.get("graph_error"),
                "capture_s": round(info.get("capture_s", 0.0), 2)}
            R["fast_loop"]["batched_fitness_max_abs_diff_vs_sequential"] = float(
                np.max(np.abs(np.array(fit_fb[:n_seq]) - np.array(fit_fast))))
            fb, fl = R["fast_loop"]["batched"], R["fast_loop"]
            fl["batched_vs_plain_lora"] = round(fb["gen_tokens_per_s"] / fl["plain_lora"]["gen_tokens_per_s"], 3)
            fl["batched_vs_sequential_candidates_per_min"] = round(
                fb["candidates_per_min"] / fl["sequential"]["candidates_per_min"], 2)
            fl["batched_vs_plain_loop_sequential_candidates_per_min"] = round(
                fb["candidates_per_min"] / R["sequential"]["candidates_per_min"], 2)
        except Exception as e:  # noqa: BLE001 - report it, keep the rest of the numbers
            R["fast_loop"]["error"] = f"{type(e).__name__}: {e}"[:500]
        print("fast loop", R["fast_loop"], flush=True)

    R["batched_vs_plain_lora"] = round(R["batched"]["gen_tokens_per_s"] / R["plain_lora"]["gen_tokens_per_s"], 3)
    R["batched_vs_plain_base"] = round(R["batched"]["gen_tokens_per_s"] / R["plain_base"]["gen_tokens_per_s"], 3)
    R["batched_vs_sequential_candidates_per_min"] = round(
        R["batched"]["candidates_per_min"] / R["sequential"]["candidates_per_min"], 2)
    R["total_s"] = round(time.time() - t0, 1)

    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "essa.json").write_text(json.dumps(R, indent=1))
    print(table(R))
    return R


def table(R: dict) -> str:
    st = R["settings"]
    lines = [
        f"ESSA population evaluation, {'tiny CPU check' if st['tiny'] else 'Qwen2.5-7B arch, NF4'}, {R['device']}, "
        f"{R['date']}: population {st['population']}, P={st['prompts']} prompts x {st['prompt_len']} tokens, "
        f"{st['new_tokens']} new tokens, greedy, LoRA r={st['rank']} on q,k,v,o (search dim {R['search_dim']})",
        "",
        "| mode | candidates/min | s/generation | generated tokens/s | peak GiB |",
        "|---|---|---|---|---|",
    ]
    for name in ("sequential", "batched"):
        m = R[name]
        lines.append(f"| {name}{' (K=' + str(m['k']) + ')' if name == 'batched' else ''} | {m['candidates_per_min']} "
                     f"| {m['s_per_generation']} | {m['gen_tokens_per_s']} | {m['peak_gib']} |")
    for name in ("plain_lora", "plain_base"):
        m = R[name]
        lines.append(f"| {name.replace('_', ' ')} ({m['rows']} rows) | | | {m['gen_tokens_per_s']} | {m['peak_gib']} |")
    fl = R.get("fast_loop", {})
    for name in ("sequential", "batched", "plain_lora"):
        if name in fl:
            m = fl[name]
            k = f" (K={m['k']})" if name == "batched" else ""
            lines.append(f"| {name.replace('_', ' ')}{k} via rollouts' fast loop | {m.get('candidates_per_min', '')} | "
                         f"{m.get('s_per_generation', '')} | {m['gen_tokens_per_s']} | {m['peak_gib']} |")
    if "batched" in fl:
        fb = fl["batched"]
        lines.append(f"\nfast loop: batched / plain inference (one LoRA) tokens/s: {fl['batched_vs_plain_lora']} "
                     f"(target >= 0.8); batched / sequential candidates per minute: "
                     f"{fl['batched_vs_sequential_candidates_per_min']}x (vs sequential on the plain loop: "
                     f"{fl['batched_vs_plain_loop_sequential_candidates_per_min']}x); packed: {fb['packed']}, "
                     f"graph: {fb['graph']} {fb['graph_error']}, capture {fb['capture_s']} s; batched vs sequential "
                     f"fitness max diff {fl['batched_fitness_max_abs_diff_vs_sequential']}")
    if "plain_lora" in fl:
        lines.append(f"batched (plain loop) / plain inference via the fast loop, tokens/s: "
                     f"{R['batched']['gen_tokens_per_s'] / fl['plain_lora']['gen_tokens_per_s']:.3f}")
    if fl.get("error") or not fl.get("supported", True):
        lines.append(f"\nfast loop: {fl.get('error') or fl.get('why_not')}")
    lines += ["",
              f"plain loop: batched / plain inference tokens/s: {R['batched_vs_plain_lora']} (one LoRA), "
              f"{R['batched_vs_plain_base']} (no LoRA)",
              f"plain loop: batched / sequential candidates per minute: "
              f"{R['batched_vs_sequential_candidates_per_min']}x",
              f"batched fitness == sequential fitness on the same candidates: "
              f"{R['fitness_equal_on_sequential_candidates']} (max diff {R['fitness_max_abs_diff']}); "
              f"last-position logits, batched vs sequential: max abs diff {R['prefill_logits_max_abs_diff']:.3g} "
              f"(logits up to {R['prefill_logits_max_abs']:.3g})",
              f"build {R['build_s']} s, total {R['total_s']} s"]
    return "\n".join(lines)


if __name__ == "__main__":
    main()
