"""ESSA: CMA-ES over the singular values of a warm-start LoRA adapter (docs/methods.md).

    warm start (an adapter folder, or a short SFT run first)
    space = SVDSpace(adapter)                     # frozen U, V; search the top singular values
    es = cma.CMAEvolutionStrategy(0, sigma0)      # offsets to those values, x = 0 = warm start
    each generation:
        xs = es.ask()                             # population of offset vectors
        rows = the generation's mini-batch        # shared by every candidate
        fitness[i] = mean reward of candidate i's completions on rows (or, essa.fitness,
                     the gold answer's log-probability or greedy margin: fitness.py)
        es.tell(xs, -fitness)                     # CMA-ES minimises

Population evaluation (population.py), `essa.evaluation`:
- sequential (default): write candidate i into the LoRA weights in place, generate,
  score, next. Memory is that of inference with one adapter: no gradients, no
  optimizer state, no saved activations (torch.inference_mode).
- batched: K candidates share one generate call of K·P rows; each LoRA layer applies
  candidate k's factors to its rows (engine/generation/multilora.py). The 4-bit base matmuls run
  once for all K·P rows, so on a GPU K candidates cost little more than one until the
  batch is compute-bound. Costs: K adapters' factors (~20 MB each at 7B, rank 8) and the
  KV cache of K·P rows. With greedy decoding both modes give the same fitness. Both
  modes decode on the rollouts' fast loop when it applies (fast=None: on CUDA, known
  layout): batched candidates run there as stacked per-row factors in its packed step
  (engine/generation/fast_decode.py), one CUDA graph per chunk of K candidates. K is sized from the
  GPU memory free at the start (engine/planning/effective.py); a chunk that runs out of memory later
  (another process took some) is scored again at half K, with a warning event.

The warm start (warm_start.py) is an adapter folder or a short SFT run inside the ESSA run's
folder; the search space over its singular values is space.py.

A checkpoint holds the CMA-ES search as a replayable log (state.py; no pickle), the best
candidate so far and the RNG states (cma samples from numpy's global
generator), so a resumed run continues exactly.
The mini-batch of generation g is a pure function of (seed, g) for the same reason.
The exported adapter is the CMA-ES mean (`essa.export: mean`, less noise-selected than a
single best evaluation) or the best candidate seen, with its offsets written into an
ordinary PEFT adapter.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch

from edgetune.engine.core import phases
from edgetune.engine.core.arch import arch_of
from edgetune.engine.core.errors import ConfigError, DataError
from edgetune.engine.core.settings import ESSASettings

from edgetune.engine.planning.effective import copy_budget, decide, record

from edgetune.engine.models import model as model_lib

from edgetune.engine.training.loop import (
    RunContext,
    check_finite,
    every,
    finish,
    read_state,
    save_checkpoint,
    seed_everything,
    set_rng_state,
    start_training,
)
from edgetune.engine.training.rewards import build_reward

from edgetune.engine.methods.essa import fitness
from edgetune.engine.methods.essa.population import Evaluator, population_fitness
from edgetune.engine.methods.essa.space import SVDSpace
from edgetune.engine.methods.essa.state import SearchLog
from edgetune.engine.methods.essa.warm_start import warm_start

from edgetune.engine import data as data_lib


def train(ctx: RunContext) -> dict:
    cfg, s = ctx.cfg, ctx.cfg.essa
    seed = cfg.run.seed
    seed_everything(seed)
    t0 = time.time()

    if fitness.parts(s.fitness)[1] == "gold_margin":  # refused before minutes of warm start, not after
        tok = model_lib.load_tokenizer(model_lib.resolve_model_path(cfg.model.name))
        if not getattr(tok, "is_fast", False):  # the answer's tokens are found by character offsets
            raise ConfigError(f"essa.fitness {s.fitness} needs a fast tokenizer (a tokenizer.json) to find the "
                              f"answer's tokens; {cfg.model.name} has a slow one: use gold_logprob or reward")
    if not s.warm_start:
        phases.emit(ctx.emit, "warm_start")
    adapter = warm_start(ctx)
    if adapter is None:  # stopped during the warm start: nothing of ESSA to save yet
        ctx.emit("stopped", step=0, adapter=None, metrics={}, elapsed=round(time.time() - t0, 2))
        return {}
    phases.emit(ctx.emit, "loading")
    model, tok, base_path = load_model(cfg, adapter)
    phases.emit(ctx.emit, "data_check")
    data = data_lib.load_rl(cfg.data, seed, tok, phases.data_progress(ctx.emit))
    ctx.emit("data", report=data.report.__dict__)
    if not data.train:
        raise DataError("no training prompts left after validation", file=cfg.data.path)
    reward = build_reward(s.reward, s.reward_file)
    space = SVDSpace(model, s.alpha)

    device = model_lib.resolve_device(cfg.model)
    free = torch.cuda.mem_get_info()[0] if device.startswith("cuda") else None
    longest = data.report.token_lengths.get("max") or None
    eff = decide(cfg, device, arch_of(model), gpu_free=free, prompt_tokens=longest)
    record(ctx.run, cfg, eff)
    evaluator = Evaluator(model, tok, space, reward, s, cfg.data.system_prompt, eff.candidates_per_batch,
                          memory_budget=copy_budget(cfg), warn=lambda m: ctx.emit("warning", message=m),
                          nf4_kernel=eff.nf4_kernel)
    held_out = data.eval[: s.eval_prompts]  # eval_prompts 0 = no held-out evaluation

    es, log = make_es(space.dim, s, seed, space.values()), SearchLog()
    gen, best_x, best_f = 0, np.zeros(space.dim), -math.inf
    metrics: dict = {"search_dim": space.dim}
    if ctx.resume is not None:
        state = read_state(ctx.resume)
        es, log = SearchLog.replay(es, state["search"], str(ctx.resume))
        gen, best_x, best_f = state["step"], state["best_x"].numpy(), float(state["best_fitness"])
        metrics.update(state.get("metrics", {}))
        set_rng_state(state["rng"])

    def export_x():
        return es.result.xfavorite if s.export == "mean" else best_x

    def held_out_reward(x, phase: str | None = None) -> float | None:
        """Mean held-out reward of x; with a phase, in chunks of one generation's prompts
        with progress, and None when a stop is asked for between chunks."""
        if not held_out:
            return float("nan")
        if phase is None:
            return evaluator.one(x, held_out, kind="reward")
        n = max(1, s.prompts_per_generation)
        tick = phases.counter(ctx.emit, phase, len(held_out), "prompts", ctx.should_stop)
        total = 0.0
        for i in range(0, len(held_out), n):
            part = held_out[i:i + n]
            total += evaluator.one(x, part, kind="reward") * len(part)
            if tick(i + len(part)):
                return None
        return total / len(held_out)

    if gen == 0 and held_out:
        r0 = held_out_reward(np.zeros(space.dim), "initial_eval")
        if r0 is not None:
            metrics["reward_start"] = r0
            ctx.emit("eval", step=0, reward=r0, candidate="warm_start")

    progress = start_training(ctx, s.generations, gen)
    stopped = False
    while gen < s.generations:
        if ctx.should_stop():
            stopped = True
            break
        t_gen = time.time()
        xs = log.ask(es)
        check_finite(gen + 1, {f"candidate {i}'s offset": float(np.sum(x)) for i, x in enumerate(xs)},
                     f"the search diverged (sigma {float(es.sigma):g}); lower essa.sigma0 (now {s.sigma0:g})",
                     unit="generation")
        rows = minibatch(data.train, s.prompts_per_generation, seed, gen)
        sample_seed = None if s.greedy else seed * 7919 + gen  # common random numbers for all candidates

        def on_candidate(i, f, secs, g=gen):
            ctx.emit("candidate", generation=g + 1, index=i, fitness=f, seconds=round(secs, 3))

        fits = population_fitness(evaluator, xs, rows, sample_seed, on_candidate)
        check_finite(gen + 1, {f"candidate {i}'s fitness": f for i, f in enumerate(fits)},
                     f"the model's outputs diverged under this candidate; lower essa.sigma0 (now {s.sigma0:g})",
                     unit="generation")
        log.tell(es, xs, [-f for f in fits])
        i_best = int(np.argmax(fits))
        if fits[i_best] > best_f:
            best_f, best_x = float(fits[i_best]), np.array(xs[i_best])
        gen += 1
        metrics.update(fitness_best=float(np.max(fits)), fitness_mean=float(np.mean(fits)), best_so_far=best_f)
        if every(cfg.run.log_every, gen) or gen == s.generations:
            ctx.emit("step", **progress.fields(gen), best=metrics["fitness_best"], mean=metrics["fitness_mean"],
                     std=float(np.std(fits)), sigma=float(es.sigma), best_so_far=best_f,
                     seconds=round(time.time() - t_gen, 2))
        if held_out and every(s.eval_every, gen) and gen < s.generations:
            metrics["reward"] = held_out_reward(export_x())
            ctx.emit("eval", step=gen, reward=metrics["reward"], candidate=s.export)
        if every(cfg.run.checkpoint_every, gen) and gen < s.generations:
            _checkpoint(ctx, gen, model, space, export_x(), log, best_x, best_f, metrics)

    last = ctx.run.last_checkpoint()
    if stopped and gen > 0 and (last is None or last[0] != gen):  # resume exactly here
        _checkpoint(ctx, gen, model, space, export_x(), log, best_x, best_f, metrics)
    if held_out and not stopped:
        r = held_out_reward(export_x(), "final_eval")
        if r is not None:
            metrics["reward"] = r
            ctx.emit("eval", step=gen, reward=r, candidate=s.export)
    space.write(export_x())  # the adapter `finish` saves
    metrics["best_fitness"] = best_f
    phases.emit(ctx.emit, "export")
    return finish(ctx, model, tok, base_path, gen, metrics, stopped, t0)


# --------------------------------------------------------------------------- CMA-ES


def make_es(dim: int, s: ESSASettings, seed: int, values: np.ndarray | None = None):
    """CMA-ES over `dim` offsets; `values` (SVDSpace.values(), needed for essa.step
    relative) sets each offset's initial step to sigma0 times its singular value."""
    import cma

    opts = {
        "popsize": s.population,
        # cma reads seed 0 / None as "seed from the clock"; keep runs reproducible.
        "seed": seed + 1,
        "verbose": -9, "verb_log": 0, "verb_disp": 0,  # no outcmaes/ files, no prints
    }
    if s.step == "relative":
        if values is None or len(values) != dim:
            raise ValueError("essa.step relative needs the searched singular values")
        if not np.max(values) > 0:
            raise ConfigError("essa.step relative: the warm start's searched singular values are all 0, so "
                              "no step can move them (use essa.step absolute, or a warm start that trained)")
        # cma's per-coordinate multipliers of sigma0; a value of exactly 0 would freeze its offset
        opts["CMA_stds"] = np.maximum(values, 1e-6 * np.max(values))
    return cma.CMAEvolutionStrategy(np.zeros(dim), s.sigma0, opts)


def minibatch(rows: list[dict], n: int, seed: int, generation: int) -> list[dict]:
    """The prompts every candidate of `generation` is scored on (same for a resumed run)."""
    rng = random.Random(seed * 1_000_003 + generation)
    if n >= len(rows):
        return list(rows)
    return rng.sample(rows, n)


def load_model(cfg, adapter: Path):
    """The base (quantised as configured) with the warm-start adapter, unmerged."""
    model, tok, base_path = model_lib.load_base(cfg.model)
    lora = replace(cfg.lora, init_from=str(adapter))
    model = model_lib.add_lora(model, lora, gradient_checkpointing=False)
    model.eval()
    return model, tok, base_path


def _checkpoint(ctx, gen, model, space, x, log, best_x, best_f, metrics) -> Path:
    """The exported candidate as the checkpoint's adapter (handy to try), and the search
    state to resume from; the warm start itself stays in its own folder."""
    space.write(x)
    return save_checkpoint(ctx, gen, model, search=log.state(), best_x=torch.from_numpy(np.asarray(best_x)),
                           best_fitness=best_f, metrics=dict(metrics))
