#!/usr/bin/env python3
"""F-GRPO and ESSA on the Qwen2.5-72B architecture, inside 80 GB of one GPU.

Model: random-init Qwen2.5-72B architecture (hidden 8192, intermediate 29568, 80 layers,
64 heads, 8 KV heads, vocab 152064), built decoder layer by decoder layer on the GPU and
quantised to NF4 as each layer is made (bench/essa.build_nf4_model: never whole in bf16,
never written to disk). The process is held to 80 GB of the card
(torch.cuda.set_per_process_memory_fraction): anything that would need more fails here
as it would on an 80 GB card.

  fgrpo   one F-GRPO step as engine/methods/fgrpo/fgrpo.py runs it (bench/fgrpo_gpu.py's loop): LoRA
          r=16 on all 7 projections, gradient checkpointing, SEBP; 8 prompts x 8
          completions, 128-token prompts, 256 new tokens, DAPO loss, micro-batch 8, update
          included. Rewards are seeded coin flips (a random-init model solves nothing).
  essa    one ESSA generation as engine/methods/essa/essa.py runs it: LoRA r=8 on q, k, v, o (the
          same base, its F-GRPO adapter unloaded), population 16, 32 prompts x 64 tokens,
          64 new tokens, greedy, batched evaluation with the candidates per pass (K) the
          memory planner fits into 80 GB.
Each part runs twice on the same model: its rollouts as the engine decodes them by default
(NF4 through bitsandbytes, a bf16 copy of the layers that fit), then with model.nf4_kernel
on (every layer on its 4-bit codes through kernels/nf4_matmul.py, no copy): the rows "...,
NF4 kernel". Each part: seconds, peak allocated / reserved, and the planner's prediction for the same
settings (within 15% is the target), compared with the peak less the bf16 copy of base
layers that rollouts take from free memory for speed (which the planner does not count;
its size is reported as copy_GiB).

    python bench/big72b_methods.py --tiny            # CPU, tiny config: the plumbing (the
                                                     # kernel under Triton's interpreter)
    PYTHONPATH=$PWD/.gpu-site python bench/big72b_methods.py   # GPU: $OUT/big72b_methods.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

if "--tiny" in sys.argv:  # the NF4 kernel on the CPU: Triton's interpreter (read when triton loads)
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
import _common as C  # noqa: E402  (edgetune importable)
from essa import TINY, IdTokenizer, add_random_lora, build_nf4_model, id_reward, info_evaluator  # noqa: E402

QWEN25_72B = dict(hidden_size=8192, intermediate_size=29568, num_hidden_layers=80, num_attention_heads=64,
                  num_key_value_heads=8, vocab_size=152064, max_position_embeddings=32768, rope_theta=1e6,
                  rms_norm_eps=1e-6, tie_word_embeddings=False)
CARD_LIMIT = 80e9  # bytes: an 80 GB card

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--time-limit", type=float, default=560.0)
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

T0 = time.perf_counter()
DEV = "cuda" if torch.cuda.is_available() and not args.tiny else "cpu"
DTYPE = torch.bfloat16 if DEV == "cuda" else torch.float32
ARCH = TINY if args.tiny else QWEN25_72B
FG = dict(prompts=2, group=4, prompt_len=8, new_tokens=8) if args.tiny else \
    dict(prompts=8, group=8, prompt_len=128, new_tokens=256)
ES = dict(population=4, prompts=3, prompt_len=8, new_tokens=6, rank=8) if args.tiny else \
    dict(population=16, prompts=32, prompt_len=64, new_tokens=64, rank=8)
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"arch": ARCH, "fgrpo_settings": FG, "essa_settings": ES, "card_limit_bytes": CARD_LIMIT,
           "planner": [], "errors": {}, "notes": []}
BUDGET = C.Budget("big72b_methods", args.time_limit, OUT / "big72b_methods.json", R, T0)
log, section = BUDGET.log, BUDGET.section


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def peaks() -> dict:
    if DEV != "cuda":
        return {}
    return {"peak_alloc": torch.cuda.max_memory_allocated(), "peak_alloc_GiB": C.gib(torch.cuda.max_memory_allocated()),
            "peak_reserved_GiB": C.gib(torch.cuda.max_memory_reserved())}


def reset_peak():
    import gc

    gc.collect()
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def copy_bytes(model, info: dict) -> int:
    """Bytes of the opportunistic bf16 copy a generate call took (its `dense_layers`, or
    all layers with `bf16_weights`): memory taken because it was free, which the planner
    does not count, so it is taken off the measured peak for the planner's row."""
    from edgetune.engine.generation import fast_decode as fd

    if not info.get("bf16_weights"):
        return 0
    per_layer = fd.layer_copy_bytes(model)
    n = info.get("dense_layers")
    return sum(per_layer if n is None else per_layer[:n])


def less(peak: int | None, copied: int) -> int | None:
    return None if peak is None else peak - copied


def planned(method: str, sets: list[str]) -> dict:
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning import planner

    cfg = resolve(overrides=[f"method={method}", f"model.name={FOLDER}", "model.quant=nf4", *sets])
    return planner.estimate(cfg, device="cuda", detect_gpu=False)


FOLDER = C.arch_folder(ARCH)
FG_SETS = ["lora.r=16", "lora.alpha=32", "model.gradient_checkpointing=true", f"data.max_seq_len={FG['prompt_len']}",
           f"fgrpo.prompts_per_step={FG['prompts']}", f"fgrpo.num_generations={FG['group']}",
           f"fgrpo.max_new_tokens={FG['new_tokens']}", "fgrpo.micro_batch_size=8"]
ES_SETS = [f"lora.r={ES['rank']}", f"lora.alpha={2 * ES['rank']}", "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]",
           "model.gradient_checkpointing=false", f"data.max_seq_len={ES['prompt_len']}",
           f"essa.population={ES['population']}", f"essa.prompts_per_generation={ES['prompts']}",
           f"essa.max_new_tokens={ES['new_tokens']}", "essa.evaluation=batched", f"essa.warm_start={FOLDER}"]


def essa_k() -> int:
    """Candidates per batched pass: the most (population, halves of it) whose planned total
    fits the 80 GB card; the engine's own rule reads half the free memory, which on this
    141 GB card would be more than an 80 GB card has."""
    k = ES["population"]
    while k > 1:
        if planned("essa", ES_SETS + [f"essa.candidates_per_batch={k}"])["total"] <= CARD_LIMIT:
            break
        k //= 2
    return k


def build():
    if DEV == "cuda":
        total = torch.cuda.get_device_properties(0).total_memory
        torch.cuda.set_per_process_memory_fraction(min(1.0, CARD_LIMIT / total))
        R["memory_fraction"] = round(CARD_LIMIT / total, 4)
    t = time.perf_counter()
    model = build_nf4_model(ARCH, DEV, DTYPE)
    if DEV == "cpu":  # keep the storage bitsandbytes keeps on CUDA (the NF4 kernel's): no CPU repack
        for m in model.modules():
            if type(m).__name__ == "Linear4bit":
                m.support_avx512bf16_for_cpu = False
    sync()
    R["build_s"] = round(time.perf_counter() - t, 1)
    R["mem_after_build_GiB"] = C.gib(torch.cuda.memory_allocated()) if DEV == "cuda" else None
    log(f"built in {R['build_s']} s, {R['mem_after_build_GiB']} GiB")
    return model


def kernel_on_cpu(nf4_kernel: str) -> bool | None:
    """--tiny: the kernel rows take the fast decode loop on the CPU too (the engine's default
    keeps it to CUDA), so that the plumbing of the NF4 kernel path runs; else the default."""
    return True if args.tiny and nf4_kernel != "off" else None


def fgrpo_step(base, nf4_kernel: str = "off", key: str = "fgrpo"):
    from edgetune.kernels import sebp as sebp_lib

    from edgetune.engine.core.settings import FGRPOSettings, LoraSettings

    from edgetune.engine.models.model import add_lora

    from edgetune.engine.generation.rollouts import generate

    from edgetune.engine.training.loop import make_optimizer, make_scheduler

    from edgetune.engine.methods.fgrpo.fgrpo import policy_update
    from edgetune.engine.methods.fgrpo.loss import focal_weights, group_advantages

    model = add_lora(base, LoraSettings(r=16, alpha=32, target_modules="all-linear"), gradient_checkpointing=True)
    with sebp_lib.enabled(model, DEV == "cuda") as sebp:
        s = FGRPOSettings(num_generations=FG["group"], prompts_per_step=FG["prompts"], max_new_tokens=FG["new_tokens"],
                          temperature=0.9, loss_type="dapo", gamma=1.0, lr=1e-5, steps=1, micro_batch_size=8)
        opt = make_optimizer(model.parameters(), "auto", s.lr, 0.0, DEV)
        sched = make_scheduler(opt, 0, s.steps)
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(1, ARCH["vocab_size"], (FG["prompt_len"],), generator=g).tolist()
                   for _ in range(FG["prompts"])]
        reset_peak()
        t = time.perf_counter()
        with sebp.lifted():
            roll = generate(model, IdTokenizer(), prompts, num_generations=s.num_generations,
                            max_new_tokens=s.max_new_tokens, temperature=s.temperature, seed=0,
                            nf4_kernel=nf4_kernel, fast=kernel_on_cpu(nf4_kernel))
        sync()
        gen_s = time.perf_counter() - t
        gen_peak = peaks()
        copied = copy_bytes(model, roll.info)
        r = (torch.rand(roll.completion_ids.shape[0], generator=g) < 0.4).float().to(roll.logprobs.device)
        adv = group_advantages(r, s.num_generations, s.scale_rewards) * focal_weights(r, s.num_generations, s.gamma,
                                                                                       success=r.bool())
        upd = policy_update(model, roll, adv, s, opt, sched, sebp)
        sync()
        gen_tokens = int(roll.completion_mask.sum())
        R[key] = {"gen_s": round(gen_s, 2), "gen_tokens": gen_tokens,
                      "gen_tokens_per_s": round(gen_tokens / gen_s, 1),
                      "train_s": round(upd["train_s"], 2), "train_tokens": upd["train_tokens"],
                      "step_s": round(time.perf_counter() - t, 2), "loss": upd["loss"], "grad_norm": upd["grad_norm"],
                      "rollout_path": roll.info, "generation_peak": gen_peak, "copy_GiB": C.gib(copied), **peaks()}
        log(f"{key} {R[key]}")
        name = "72B F-GRPO step" + (", NF4 kernel" if nf4_kernel != "off" else "")
        R["planner"].append(C.compare(name, planned("fgrpo", FG_SETS), less(R[key].get("peak_alloc"), copied)))
    del opt, sched, roll, adv
    for p in model.parameters():
        p.grad = None
    return model.unload()  # the NF4 base again, LoRA layers removed


def essa_generation(base, nf4_kernel: str = "off", key: str = "essa"):
    import numpy as np

    from edgetune.engine.core.settings import ESSASettings

    from edgetune.engine.methods.essa.essa import make_es
    from edgetune.engine.methods.essa.space import SVDSpace

    model = add_random_lora(base, ES["rank"])
    space = SVDSpace(model)
    k = essa_k()
    g = torch.Generator().manual_seed(1)
    prompts = torch.randint(1, ARCH["vocab_size"], (ES["prompts"], ES["prompt_len"]), generator=g).tolist()
    rows = [{"prompt": p, "answer": ""} for p in prompts]
    s = ESSASettings(population=ES["population"], sigma0=0.05, max_new_tokens=ES["new_tokens"], greedy=True,
                     prompts_per_generation=ES["prompts"], evaluation="batched")
    es = make_es(space.dim, s, seed=0, values=space.values())
    xs = es.ask()
    while True:
        ev = info_evaluator()(model, IdTokenizer(), space, id_reward, s, candidates_per_batch=k,
                              nf4_kernel=nf4_kernel, fast=kernel_on_cpu(nf4_kernel))
        ev.population(xs[:2], rows[:2])  # warm-up of the batched path (kernels, allocator), not timed
        reset_peak()
        t = time.perf_counter()
        try:
            fit = ev.population(xs, rows)
            break
        except torch.OutOfMemoryError:
            if k == 1:
                raise
            R["notes"].append(f"ESSA: K = {k} ran out of the 80 GB (planner said it fits); halved")
            k //= 2
            reset_peak()
    es.tell(xs, [-f for f in fit])
    sync()
    dt = time.perf_counter() - t
    new = ES["population"] * ES["prompts"] * ES["new_tokens"]
    R[key] = {"k": k, "passes": -(-ES["population"] // k), "search_dim": space.dim, "s_per_generation": round(dt, 2),
                 "candidates_per_min": round(60 * ES["population"] / dt, 1), "gen_tokens_per_s": round(new / dt, 1),
                 "fitness_mean": float(np.mean(fit)), "rollout_path": ev.last_info, **peaks()}
    copied = copy_bytes(model, ev.last_info)
    R[key]["copy_GiB"] = C.gib(copied)
    log(f"{key} {R[key]}")
    name = "72B ESSA generation" + (" NF4 kernel" if nf4_kernel != "off" else "")
    R["planner"].append(C.compare(f"{name}, K = {k}", planned("essa", ES_SETS + [f"essa.candidates_per_batch={k}"]),
                                  less(R[key].get("peak_alloc"), copied)))
    model.unload()  # the NF4 base again, for the next part


def table() -> str:
    out = [f"72B NF4 ({'tiny CPU check' if args.tiny else 'Qwen2.5-72B arch, random init'}), process held to "
           f"{CARD_LIMIT / 1e9:.0f} GB; build {R.get('build_s')} s, {R.get('mem_after_build_GiB')} GiB after it", "",
           "| part | seconds | generated tokens/s | peak allocated GiB | peak reserved GiB | planner GiB | error |",
           "|---|---|---|---|---|---|---|"]
    plan = {row["name"].split(", K =")[0]: row for row in R["planner"]}
    for key, how in (("fgrpo", ""), ("fgrpo_kernel", ", NF4 kernel")):
        f = R.get(key)
        if f:
            p = plan.get("72B F-GRPO step" + how, {})
            out.append(f"| F-GRPO step{how} ({FG['prompts']} x {FG['group']} x {FG['new_tokens']} new tokens; "
                       f"generation {f['gen_s']} s + update {f['train_s']} s) | {f['step_s']} | "
                       f"{f['gen_tokens_per_s']} | {f.get('peak_alloc_GiB')} | {f.get('peak_reserved_GiB')} | "
                       f"{p.get('predicted_GiB')} | {p.get('error')} |")
    for key, how in (("essa", ""), ("essa_kernel", ", NF4 kernel")):
        e = R.get(key)
        if e:
            p = plan.get("72B ESSA generation" + how.replace(",", ""), {})
            out.append(f"| ESSA generation{how} (population {ES['population']}, {ES['prompts']} prompts x "
                       f"{ES['new_tokens']} new tokens, K = {e['k']} per pass, {e['passes']} passes) | "
                       f"{e['s_per_generation']} | {e['gen_tokens_per_s']} | {e.get('peak_alloc_GiB')} | "
                       f"{e.get('peak_reserved_GiB')} | {p.get('predicted_GiB')} | {p.get('error')} |")
    if R["errors"]:
        out.append(f"errors: {json.dumps(R['errors'])[:1500]}")
    return "\n".join(out)


def main():
    if DEV == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    base = section("build", build)
    if base is None:
        return
    base = section("fgrpo", lambda: fgrpo_step(base), need_s=30 if args.tiny else 200) or base
    base = section("fgrpo_kernel", lambda: fgrpo_step(base, "on", "fgrpo_kernel"),
                   need_s=30 if args.tiny else 150) or base
    section("essa", lambda: essa_generation(base), need_s=20 if args.tiny else 100)
    section("essa_kernel", lambda: essa_generation(base, "on", "essa_kernel"), need_s=20 if args.tiny else 80)
    R["table"] = table()
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    BUDGET.dump()
    print("\n" + R["table"], flush=True)


if __name__ == "__main__":
    main()
