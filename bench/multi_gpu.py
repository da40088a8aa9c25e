#!/usr/bin/env python3
"""Data-parallel scaling on one machine: the same global work on 1 GPU and on N GPUs
(torchrun, NCCL; NCCL_NVLS_ENABLE=0), through the engine's own distributed code paths.

Model: the Qwen2.5-7B architecture with random weights in NF4, built on each rank's GPU
one decoder layer at a time (bench/essa.py's build_nf4_model); LoRA r=16 on all linear
projections. Measured in one torchrun job per GPU count (the model is built once a rank):

  SFT     16 rows x 1,024 tokens a step (batch 8 x grad_accum 2 on one GPU; 8 rows a rank
          on two), gradient checkpointing, engine.methods.sft.sft.accumulate (label count and LoRA
          gradients all-reduced) + clip + fused AdamW: global tokens/s
  ESSA    population 16, 16 prompts x 64 new tokens, greedy; engine.methods.essa.population.population_fitness
          (each rank scores its share, one all_gather): candidates/min, batched (K = the
          rank's share in one pass) and sequential (population 8, one candidate at a time)
  F-GRPO  8 prompts x 8 completions x 256 new tokens a step (each rank whole groups of its
          prompts), rewards all-gathered, engine.methods.fgrpo.fgrpo.policy_update (gradients
          all-reduced): steps/min

    python bench/multi_gpu.py                 # GPU: 1 vs 2 GPUs; JSON in $OUT (or bench/results/<date>-h200x2/)
    python bench/multi_gpu.py --tiny          # CPU: a tiny model, 1 vs 2 processes over gloo (a functional check)

Each ratio is N-GPU over 1-GPU from the same invocation.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tiny", action="store_true", help="tiny model on the CPU (gloo): checks that everything runs")
    p.add_argument("--gpus", type=int, default=2, help="the N compared with 1")
    p.add_argument("--only", default="sft,essa,fgrpo", help="which benches (comma-separated)")
    p.add_argument("--out", default=os.environ.get("OUT") or "")
    p.add_argument("--job-timeout", type=float, default=290, help="seconds for each torchrun job")
    p.add_argument("--rank-job", action="store_true", help=argparse.SUPPRESS)  # one torchrun job's rank
    return p.parse_args(argv)


# --------------------------------------------------------------------------- one rank


def rank_job(a) -> None:
    sys.path.insert(0, str(HERE))
    sys.path.insert(0, str(HERE.parent))
    import torch
    from essa import QWEN25_7B, TINY, IdTokenizer, build_nf4_model, id_reward

    from edgetune.engine.core import distributed as dist
    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.models.model import add_lora

    dist.init()
    cuda = torch.cuda.is_available() and not a.tiny
    dev = dist.device("cuda") if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    if not cuda:
        torch.set_num_threads(1)
    arch = TINY if a.tiny else QWEN25_7B
    W, me = dist.world(), dist.rank()

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def timed(fn) -> float:
        dist.barrier()
        sync()
        t = time.perf_counter()
        fn()
        sync()
        dist.barrier()
        return time.perf_counter() - t

    def peaks() -> list:
        mine = round(torch.cuda.max_memory_allocated() / 2**30, 2) if cuda else None
        return dist.all_gather_object(mine)

    torch.manual_seed(0)
    t0 = time.time()
    model = build_nf4_model(arch, dev, dtype)
    model = add_lora(model, LoraSettings(r=16, alpha=32, target_modules="all-linear"), gradient_checkpointing=True)
    dist.broadcast_params(model.parameters())
    R: dict = {"world": W, "device": torch.cuda.get_device_name(dev) if cuda else "cpu", "torch": torch.__version__,
               "arch": "tiny" if a.tiny else "Qwen2.5-7B (random init, NF4)", "build_s": round(time.time() - t0, 1),
               "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE")}
    only = set(a.only.split(","))

    def dump():  # after each bench: a later one that fails leaves the earlier figures
        if me == 0:
            Path(a.out).mkdir(parents=True, exist_ok=True)
            (Path(a.out) / f"multi_gpu_w{W}.json").write_text(json.dumps(R, indent=1, default=str))

    dump()
    g = torch.Generator().manual_seed(1)
    vocab = arch["vocab_size"]

    if "sft" in only:
        from edgetune.engine.training.loop import make_optimizer

        from edgetune.engine.methods.sft.sft import accumulate

        rows, seq, bs = (4, 16, 2) if a.tiny else (16, 1024, 8)
        ids = torch.randint(1, vocab, (rows, seq), generator=g)
        mine = list(dist.shard(rows))
        opt = make_optimizer(model.parameters(), "adamw", 1e-5, 0.0, dev)
        params = [p for p in model.parameters() if p.requires_grad]
        model.train()

        def step():
            batches = [{"input_ids": ids[mine[i:i + bs]].to(dev), "labels": ids[mine[i:i + bs]].to(dev),
                        "attention_mask": torch.ones(len(mine[i:i + bs]), seq, dtype=torch.long, device=dev)}
                       for i in range(0, len(mine), bs)]
            loss, _ = accumulate(model, batches)
            torch.nn.utils.clip_grad_norm_(params, 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss

        for _ in range(2):
            timed(step)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        times = [timed(step) for _ in range(3 if a.tiny else 6)]
        s = statistics.median(times)
        R["sft"] = {"global_rows": rows, "seq": seq, "micro_batch": bs, "rows_per_rank": len(mine),
                    "s_per_step": round(s, 4), "steps_s": [round(t, 4) for t in times],
                    "tokens_per_s": round(rows * seq / s, 1), "peak_gib_per_rank": peaks()}
        del opt
        model.zero_grad(set_to_none=True)
        if me == 0:
            print("sft", json.dumps(R["sft"]), flush=True)
        dump()

    if "essa" in only:
        from edgetune.engine.core.settings import ESSASettings

        from edgetune.engine.methods.essa.essa import make_es
        from edgetune.engine.methods.essa.population import Evaluator, population_fitness
        from edgetune.engine.methods.essa.space import SVDSpace

        model.eval()
        with torch.no_grad():  # a warm start stands in: B away from zero
            for n, p in model.named_parameters():
                if "lora_B" in n:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(2)) * 0.02)
        space = SVDSpace(model)
        P, L, T = (3, 8, 6) if a.tiny else (16, 64, 64)
        prompts = torch.randint(1, vocab, (P, L), generator=g).tolist()
        data = [{"prompt": p, "answer": ""} for p in prompts]
        tok = IdTokenizer()
        R["essa"] = {"prompts": P, "prompt_len": L, "new_tokens": T}
        for mode, pop in (("batched", 6 if a.tiny else 16), ("sequential", 4 if a.tiny else 8)):
            s = ESSASettings(population=pop, sigma0=0.05, max_new_tokens=T, greedy=True, prompts_per_generation=P,
                             evaluation=mode)
            share = len(dist.shard(pop))
            ev = Evaluator(model, tok, space, id_reward, s, candidates_per_batch=share)
            xs = make_es(space.dim, s, seed=0, values=space.values()).ask()
            # warm-up, this rank alone: kernels; the fast loop's graph for the full prompt batch
            ev.population(xs[:1], data) if mode == "sequential" else ev.population(xs[:2], data[:2])
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            fits = []
            dt = timed(lambda: fits.append(population_fitness(ev, xs, data, None)))
            R["essa"][mode] = {"population": pop, "candidates_per_rank": share, "s_per_generation": round(dt, 3),
                               "candidates_per_min": round(60 * pop / dt, 1), "fitness": fits[0],
                               "peak_gib_per_rank": peaks()}
            if me == 0:
                print("essa", mode, json.dumps(R["essa"][mode]), flush=True)
            dump()
        space.restore()

    if "fgrpo" in only:
        from edgetune.engine.core.settings import FGRPOSettings

        from edgetune.engine.generation.rollouts import generate

        from edgetune.engine.training.loop import make_optimizer, make_scheduler

        from edgetune.engine.methods.fgrpo.fgrpo import policy_update
        from edgetune.engine.methods.fgrpo.loss import focal_weights, group_advantages

        n_prompts, G, L, T = (2, 4, 8, 8) if a.tiny else (8, 8, 128, 256)
        s = FGRPOSettings(num_generations=G, prompts_per_step=n_prompts, max_new_tokens=T, temperature=0.9,
                          loss_type="dapo", gamma=1.0, lr=1e-5, micro_batch_size=8)
        opt = make_optimizer(model.parameters(), "adamw", s.lr, 0.0, dev)
        sched = make_scheduler(opt, 0, 100)
        prompts = torch.randint(1, vocab, (n_prompts, L), generator=g).tolist()
        mine = [prompts[i] for i in dist.shard(n_prompts)]
        tok = IdTokenizer()
        parts: dict = {"gen": [], "train": []}

        def step(k=[0]):
            k[0] += 1
            t = time.perf_counter()
            roll = generate(model, tok, mine, num_generations=G, max_new_tokens=T, temperature=s.temperature,
                            seed=1000 * k[0] + me)
            sync()
            parts["gen"].append(time.perf_counter() - t)
            coin = torch.Generator().manual_seed(k[0] * 7 + me)
            local = (torch.rand(roll.completion_ids.shape[0], generator=coin) < 0.4).float().tolist()
            gathered = dist.all_gather_object(local)
            r = torch.tensor(sum(gathered, []), device=roll.logprobs.device)
            first = sum(len(x) for x in gathered[:me])
            adv = group_advantages(r, G, s.scale_rewards) * focal_weights(r, G, s.gamma, success=r.bool())
            upd = policy_update(model, roll, adv[first:first + len(local)], s, opt, sched)
            parts["train"].append(upd["train_s"])

        timed(step)
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        parts = {"gen": [], "train": []}
        times = [timed(step) for _ in range(2 if a.tiny else 3)]
        sm = statistics.median(times)
        R["fgrpo"] = {"prompts": n_prompts, "group": G, "prompt_len": L, "new_tokens": T,
                      "prompts_per_rank": len(mine), "s_per_step": round(sm, 3), "steps_s": [round(t, 3) for t in times],
                      "steps_per_min": round(60 / sm, 2), "rank0_gen_s": [round(t, 3) for t in parts["gen"]],
                      "rank0_train_s": [round(t, 3) for t in parts["train"]], "peak_gib_per_rank": peaks()}
        if me == 0:
            print("fgrpo", json.dumps(R["fgrpo"]), flush=True)

    R["done"] = True
    dump()
    dist.shutdown()


# --------------------------------------------------------------------------- driver


def planner_sft(a) -> dict:
    """The planner's allocated peak of one GPU for the SFT bench's shape (16 rows x 1,024
    tokens a step, micro-batches of 8; NF4, LoRA r16 on every projection, checkpointing) on
    1 and on N GPUs: what `edgetune estimate --gpus N` says."""
    sys.path.insert(0, str(HERE.parent))
    import tempfile

    from essa import QWEN25_7B, TINY

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning import planner

    arch = TINY if a.tiny else QWEN25_7B
    d = Path(tempfile.mkdtemp(prefix="arch-"))
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2", **arch}))
    rows, seq, bs = (4, 16, 2) if a.tiny else (16, 1024, 8)
    cfg = resolve(overrides=["method=sft", f"model.name={d}", "model.quant=nf4", "lora.r=16", "lora.alpha=32",
                             "model.gradient_checkpointing=true", "sft.optimizer=adamw", f"sft.batch_size={bs}",
                             f"sft.grad_accum={rows // bs}", f"data.max_seq_len={seq}"])
    return {str(w): round(planner.estimate(cfg, device="cuda", gpu_total=141 * 2**30, detect_gpu=False,
                                           gpus=w)["allocated_peak"] / 2**30, 2) for w in (1, a.gpus)}


def main(argv=None) -> dict:
    a = parse(argv)
    if a.rank_job:
        rank_job(a)
        return {}
    if not a.out:
        a.out = str(HERE / "results" / f"{time.strftime('%Y-%m-%d')}-{'cpu-tiny' if a.tiny else 'h200x2'}")
    env = dict(os.environ, NCCL_NVLS_ENABLE="0", PYTHONUNBUFFERED="1")
    env.setdefault("OMP_NUM_THREADS", "1")
    res: dict = {"date": time.strftime("%Y-%m-%d %H:%M"), "command": " ".join([sys.executable] + sys.argv)}
    for w in (1, a.gpus):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(w),
               str(Path(__file__).resolve()), "--rank-job", "--only", a.only, "--out", a.out] + \
              (["--tiny"] if a.tiny else [])
        print("+", " ".join(cmd), flush=True)
        t = time.time()
        try:
            rc = subprocess.run(cmd, env=env, timeout=a.job_timeout).returncode
        except subprocess.TimeoutExpired:
            rc = "timeout"
        f = Path(a.out) / f"multi_gpu_w{w}.json"
        res[f"w{w}"] = json.loads(f.read_text()) if f.is_file() else {}
        res[f"w{w}"].update(job_s=round(time.time() - t, 1), exit=rc)
    one, n = res["w1"], res[f"w{a.gpus}"]
    ratios = {}
    if "sft" in one and "sft" in n:
        ratios["sft_tokens_per_s"] = round(n["sft"]["tokens_per_s"] / one["sft"]["tokens_per_s"], 3)
    for mode in ("batched", "sequential"):
        if mode in one.get("essa", {}) and mode in n.get("essa", {}):
            ratios[f"essa_{mode}_candidates_per_min"] = round(
                n["essa"][mode]["candidates_per_min"] / one["essa"][mode]["candidates_per_min"], 3)
            ratios[f"essa_{mode}_same_fitness"] = n["essa"][mode]["fitness"] == one["essa"][mode]["fitness"]
    if "fgrpo" in one and "fgrpo" in n:
        ratios["fgrpo_steps_per_min"] = round(n["fgrpo"]["steps_per_min"] / one["fgrpo"]["steps_per_min"], 3)
    res["ratios"] = ratios
    res["planner_sft_allocated_peak_gib"] = planner_sft(a)
    for w in (1, a.gpus):
        peaks = res[f"w{w}"].get("sft", {}).get("peak_gib_per_rank")
        if peaks and peaks[0] is not None:
            res[f"w{w}"]["sft"]["planner_vs_measured"] = round(
                res["planner_sft_allocated_peak_gib"][str(w)] / max(peaks) - 1, 3)
    (Path(a.out) / "multi_gpu.json").write_text(json.dumps(res, indent=1, default=str))
    print(json.dumps(ratios, indent=1))
    return res


if __name__ == "__main__":
    main()
