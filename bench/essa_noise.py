#!/usr/bin/env python3
"""How noisy is ESSA's fitness? One CMA-ES population, scored on two independent prompt draws.

ESSA ranks its candidates by their mean reward on `essa.prompts_per_generation` training
prompts (greedy, so the only noise is which prompts were drawn). This bench takes the
setup of a user's ESSA quick start on a reasoning-gym task (`--preset essa-quickstart`,
the task's train rows from bench/learning.py, its SFT demonstrations as warm-start data):

    warm start  engine.methods.essa.warm_start.warm_start (SFT, essa.warm_start_steps) or --warm-start <adapter>
    space       SVDSpace(model, essa.alpha); CMA-ES at essa.sigma0, popsize essa.population
    population  the first es.ask() of the run (what generation 1 scores)

and scores every candidate with the engine's own Evaluator on two disjoint draws A and B
of P training prompts, for each P in --prompts (default: 1x, 2x, 4x the preset's
prompts_per_generation). Draws of one P are disjoint; the draws of a larger P extend
those of a smaller one (prefixes of two disjoint pools), which costs nothing extra.

Per P it reports: Spearman rank correlation of the candidates' fitness between A and B
(average ranks for ties; one-sided permutation p-value), how many of CMA-ES's parents
(the top popsize // 2) the two draws share (chance: half), the standard deviation of
fitness across candidates, the binomial standard error of one candidate's fitness
sqrt(p(1-p)/P), the between-candidate signal sd estimated as sqrt(cov(A, B)) (the draws'
noise is independent, so only true differences co-vary), and wall seconds.

Cost: 2 x population x (sum of P) greedy completions; on 2 CPU cores with the preset's
population 12 and P = 16, 32, 64 that is 2,688 completions of <= 24 tokens.

    python bench/essa_noise.py --tiny                     # CPU check, < 1 minute
    python bench/essa_noise.py --out bench/results/<date>-cpu/essa-noise   # ~15-25 min

Writes essa_noise.json and essa_noise.md to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib.util
import json
import os
import platform
import random
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402,F401  (makes edgetune.* importable from this checkout)


def _learning():
    """bench/learning.py as a module (its task generators and data files)."""
    spec = importlib.util.spec_from_file_location("bench_learning", BENCH / "learning.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


# --------------------------------------------------------------------------- statistics


def average_ranks(x) -> np.ndarray:
    """Ranks 1..n of x, tied values sharing the mean of their ranks (as scipy's rankdata)."""
    x = np.asarray(x, dtype=float)
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    sorted_x = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and sorted_x[j + 1] == sorted_x[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2 + 1
        i = j + 1
    return ranks


def pearson(x, y) -> float:
    """Pearson correlation; nan when either side is constant (no ranking at all)."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    dx, dy = x - x.mean(), y - y.mean()
    den = np.sqrt((dx * dx).sum() * (dy * dy).sum())
    return float((dx * dy).sum() / den) if den > 0 else float("nan")


def spearman(x, y) -> float:
    """Spearman's rho: Pearson correlation of average ranks (handles ties)."""
    return pearson(average_ranks(x), average_ranks(y))


def permutation_p(x, y, n: int = 20000, seed: int = 0) -> float:
    """One-sided p-value of Spearman's rho under 'the two rankings are unrelated':
    the share of random pairings of y with x whose rho is at least the observed one."""
    rho = spearman(x, y)
    if not np.isfinite(rho):
        return float("nan")
    rx, ry = average_ranks(x), average_ranks(y)
    rng = np.random.default_rng(seed)
    perms = np.argsort(rng.random((n, len(ry))), axis=1)
    ryp = ry[perms]
    dx = rx - rx.mean()
    dy = ryp - ryp.mean(axis=1, keepdims=True)
    rhos = (dy @ dx) / np.sqrt((dx * dx).sum() * (dy * dy).sum(axis=1))
    return float((np.sum(rhos >= rho - 1e-12) + 1) / (n + 1))


def parents_shared(a, b, mu: int) -> int:
    """Candidates in the top mu of both draws (CMA-ES recombines its top mu; ties broken
    by index, as a stable sort of the fitness does)."""
    top = lambda f: set(np.argsort(-np.asarray(f, dtype=float), kind="stable")[:mu].tolist())  # noqa: E731
    return len(top(a) & top(b))


def noise_stats(a, b, p: int) -> dict:
    """The numbers of one P: ranking agreement, spread across candidates, sampling error."""
    a, b = np.asarray(a, dtype=float), np.asarray(b, dtype=float)
    mean = float(np.concatenate([a, b]).mean())
    per_candidate_se = np.sqrt(np.clip(np.concatenate([a, b]) * (1 - np.concatenate([a, b])), 0, None) / p)
    cov = float(np.cov(a, b)[0, 1]) if len(a) > 1 else float("nan")
    mu = len(a) // 2
    return {
        "prompts": p,
        "spearman": spearman(a, b),
        "spearman_p_one_sided": permutation_p(a, b),
        "pearson": pearson(a, b),
        "parents_shared": parents_shared(a, b, mu),
        "parents": mu,
        "fitness_mean": mean,
        "fitness_sd_across_candidates": float((a.std(ddof=1) + b.std(ddof=1)) / 2) if len(a) > 1 else 0.0,
        "binomial_se_at_mean": float(np.sqrt(mean * (1 - mean) / p)),
        "binomial_se_mean_over_candidates": float(per_candidate_se.mean()),
        "signal_sd_from_covariance": float(np.sqrt(cov)) if cov > 0 else 0.0,
        "covariance_a_b": cov,
        "distinct_fitness_values": int(len(set(a.tolist()) | set(b.tolist()))),
    }


# --------------------------------------------------------------------------- setup


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a functional check on the CPU (< 1 minute)")
    p.add_argument("--task", default="chain_sum", help="a task of bench/learning.py")
    p.add_argument("--preset", default="essa-quickstart")
    p.add_argument("--prompts", default="", help="comma-separated P (default: 1x,2x,4x essa.prompts_per_generation)")
    p.add_argument("--population", type=int, default=0, help="0 = the preset's essa.population")
    p.add_argument("--warm-start-steps", type=int, default=0, help="0 = the preset's essa.warm_start_steps")
    p.add_argument("--warm-start", default="", help="an existing warm-start adapter folder (skips the SFT)")
    p.add_argument("--train-items", type=int, default=0, help="train rows written (default: enough for 2 x max P)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="extra setting on top of the preset")
    p.add_argument("--work", default="", help="data and warm-start folder (default: a new temporary folder)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def build(a, work: Path, log):
    """(cfg, evaluator, train rows, population xs): what generation 1 of the user's run
    sees, built with the engine's own functions."""
    import torch

    from edgetune.engine.core.arch import arch_of
    from edgetune.engine.core.events import EventWriter
    from edgetune.engine.core.runfolder import RunDir
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.planning.effective import copy_budget, decide

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import RunContext, seed_everything
    from edgetune.engine.training.rewards import build_reward

    from edgetune.engine.methods.essa import essa
    from edgetune.engine.methods.essa.population import Evaluator
    from edgetune.engine.methods.essa.space import SVDSpace
    from edgetune.engine.methods.essa.warm_start import warm_start

    from edgetune.engine import data as data_lib

    learning = _learning()
    data = learning.write_task_data(a.task, work / "data", a.train_items, 10, a.seed)
    overrides = [f"data.path={data['train_rl']}", f"data.eval_path={data['eval_rl']}",
                 f"essa.reward=rg:{a.task}", f"essa.warm_start_data={data['train_sft']}",
                 f"run.seed={a.seed}", f"run.runs_dir={work / 'runs'}", *a.sets]
    if a.warm_start:
        overrides.append(f"essa.warm_start={a.warm_start}")
    if a.warm_start_steps:
        overrides.append(f"essa.warm_start_steps={a.warm_start_steps}")
    if a.population:
        overrides.append(f"essa.population={a.population}")
    cfg = resolve(a.preset, overrides=overrides)
    s = cfg.essa
    seed_everything(cfg.run.seed)

    t = time.time()
    run = RunDir(work / "run")
    run.path.mkdir(parents=True, exist_ok=True)
    writer = EventWriter(run.events_path)
    try:
        adapter = warm_start(RunContext(cfg=cfg, run=run, emit=writer))
    finally:
        writer.close()
    if adapter is None:
        raise SystemExit("the warm-start SFT did not finish")
    warm_s = time.time() - t
    log(f"warm start {adapter} ({'given' if s.warm_start else f'{s.warm_start_steps} SFT steps'}, {warm_s:.0f} s)")

    model, tok, _ = essa.load_model(cfg, adapter)
    rl = data_lib.load_rl(cfg.data, cfg.run.seed, tok)
    reward = build_reward(s.reward, s.reward_file)
    space = SVDSpace(model, s.alpha)
    device = model_lib.resolve_device(cfg.model)
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None
    eff = decide(cfg, device, arch_of(model), gpu_free=free, prompt_tokens=rl.report.token_lengths.get("max") or None)
    evaluator = Evaluator(model, tok, space, reward, s, cfg.data.system_prompt, eff.candidates_per_batch,
                               memory_budget=copy_budget(cfg))
    xs = essa.make_es(space.dim, s, cfg.run.seed, space.values()).ask()
    info = {"warm_start_s": round(warm_s, 1), "warm_start_steps": None if s.warm_start else s.warm_start_steps,
            "search_dim": space.dim, "candidates_per_batch": eff.candidates_per_batch, "device": device,
            "train_rows": len(rl.train)}
    return cfg, evaluator, rl.train, xs, info


def draws(rows: list[dict], ps: list[int], seed: int) -> dict[int, tuple[list[dict], list[dict]]]:
    """Two disjoint pools of max(P) rows; draw A / B of each P are their first P rows.
    With fewer than 2 x max(P) rows the pools are two independent samples (they may share rows)."""
    rng = random.Random(seed * 1_000_003 + 7)
    top = max(ps)
    if 2 * top <= len(rows):
        pool = rng.sample(rows, 2 * top)
        a, b = pool[:top], pool[top:]
    else:
        a, b = rng.sample(rows, min(top, len(rows))), rng.sample(rows, min(top, len(rows)))
    return {p: (a[:p], b[:p]) for p in ps}


def tiny_model(out: Path) -> Path:
    """A 2-layer Llama (hidden 64, random weights) with the embedded model's tokenizer and
    chat template, as the tests use: the --tiny check runs in seconds instead of minutes."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    tok = load_tokenizer(str(embedded_model_dir()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


# --------------------------------------------------------------------------- report


def table(result: dict) -> str:
    c = result["config"]
    lines = [f"# ESSA fitness noise ({result['date']})", "",
             f"Machine: {result['machine']}", "", f"Command: `{result['command']}`", "",
             f"Setup: preset `{result['preset']}`, task `{result['task']}` ({result['setup']['train_rows']} train rows), "
             f"warm start {result['setup']['warm_start_steps']} SFT steps, LoRA r={c['lora_r']} on "
             f"{', '.join(c['target_modules'])}, alpha {c['alpha']} (search dim {result['setup']['search_dim']}), "
             f"population N = {c['population']} (first CMA-ES ask at sigma0 {c['sigma0']}), greedy, "
             f"{c['max_new_tokens']} new tokens, reward `{c['reward']}`; the preset scores "
             f"{c['prompts_per_generation']} prompts per generation.", "",
             "Each candidate's fitness (the engine's Evaluator) on two disjoint draws A, B of P training prompts. "
             "Spearman: rank correlation of the N fitnesses between A and B (p: one-sided permutation). "
             "Parents shared: candidates in the top N/2 of both draws (chance: half of N/2). "
             "Signal sd: sqrt(cov(A, B)), the spread of the candidates' true fitness.", "",
             "| P | Spearman (p) | parents shared | mean fitness | sd across candidates | binomial SE of one "
             "candidate | signal sd | wall s |", "|---|---|---|---|---|---|---|---|"]
    for r in result["per_prompts"]:
        rho = "n/a" if not np.isfinite(r["spearman"]) else f"{r['spearman']:+.2f} ({r['spearman_p_one_sided']:.2f})"
        lines.append(f"| {r['prompts']} | {rho} | {r['parents_shared']} / {r['parents']} | {r['fitness_mean']:.3f} | "
                     f"{r['fitness_sd_across_candidates']:.3f} | {r['binomial_se_at_mean']:.3f} | "
                     f"{r['signal_sd_from_covariance']:.3f} | {r['wall_s']:.0f} |")
    lines += ["", "Per-candidate fitness (A / B) is in essa_noise.json."]
    return "\n".join(lines) + "\n"


def machine() -> str:
    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "n/a"
    import torch

    return (f"{platform.machine()}, {os.cpu_count()} cores (load average {load} at the end), "
            f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, torch {torch.__version__}, "
            f"Python {platform.python_version()}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared cores: one thread is faster
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="edgetune-essa-noise-"))
    work.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        # A 2-layer random Llama with the embedded tokenizer, few candidates, prompts and
        # tokens, one SFT step: checks the whole path in seconds, not the numbers.
        a.population = a.population or 4
        a.warm_start_steps = a.warm_start_steps or 1
        a.prompts = a.prompts or "3,6"
        a.sets = [f"model.name={tiny_model(work / 'tiny-model')}", "model.quant=none", "essa.max_new_tokens=6",
                  "sft.batch_size=2", *a.sets]
    from edgetune.engine.core.settings import resolve

    preset_ppg = resolve(a.preset).essa.prompts_per_generation
    ps = [int(x) for x in a.prompts.split(",") if x] if a.prompts else [preset_ppg, 2 * preset_ppg, 4 * preset_ppg]
    a.train_items = a.train_items or max(2 * max(ps) + 10, 40)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{dt.datetime.now(dt.timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"work folder {work}; P = {ps}")
    cfg, evaluator, rows, xs, setup = build(a, work, log)
    s = cfg.essa
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "command": "python " + " ".join(shlex.quote(x) for x in
                                        ["bench/essa_noise.py", *(argv if argv is not None else sys.argv[1:])]),
        "preset": a.preset, "task": a.task, "tiny": a.tiny, "setup": setup,
        "config": {"population": s.population, "sigma0": s.sigma0, "alpha": s.alpha, "reward": str(s.reward),
                   "prompts_per_generation": s.prompts_per_generation, "max_new_tokens": s.max_new_tokens,
                   "evaluation": s.evaluation, "greedy": s.greedy, "lora_r": cfg.lora.r,
                   "target_modules": list(cfg.lora.target_modules), "seed": cfg.run.seed},
        "disjoint_draws": 2 * max(ps) <= len(rows),
        "per_prompts": [],
    }

    def save() -> None:
        result["machine"] = machine()
        (out / "essa_noise.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
        (out / "essa_noise.md").write_text(table(result), encoding="utf-8")

    for p, (rows_a, rows_b) in draws(rows, ps, cfg.run.seed).items():
        t = time.time()
        fa = evaluator.population(xs, rows_a)
        t_a = time.time() - t
        fb = evaluator.population(xs, rows_b)
        wall = time.time() - t
        entry = noise_stats(fa, fb, p)
        entry.update(wall_s=round(wall, 1), wall_s_per_draw=[round(t_a, 1), round(wall - t_a, 1)],
                     fitness_a=fa, fitness_b=fb)
        result["per_prompts"].append(entry)
        save()  # a partial table survives a stop
        log(f"P={p}: spearman {entry['spearman']:+.2f}, sd {entry['fitness_sd_across_candidates']:.3f}, "
            f"SE {entry['binomial_se_at_mean']:.3f}, {wall:.0f} s")
    save()
    print(table(result))
    return result


if __name__ == "__main__":
    main()
