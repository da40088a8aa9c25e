"""Scoring a generation's candidates, `essa.evaluation`: sequential (each candidate written
into the LoRA weights in turn: the memory of inference with one adapter) or batched (K
candidates share one generate call, each LoRA layer applying candidate k's factors to its
rows: engine/generation/multilora.py). On several ranks each scores its share of the
population (`population_fitness`).
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import torch

from edgetune.engine.core import distributed as dist
from edgetune.engine.core.settings import ESSASettings

from edgetune.engine.generation.multilora import batched_lora
from edgetune.engine.generation.rollouts import generate

from edgetune.engine.methods.essa import fitness
from edgetune.engine.methods.essa.space import SVDSpace


class Evaluator:
    """Scores candidates (offset vectors) by the mean reward of their completions."""

    def __init__(self, model, tokenizer, space: SVDSpace, reward, s: ESSASettings, system_prompt: str = "",
                 candidates_per_batch: int = 0, fast: bool | None = None, memory_budget: int | None = None,
                 warn=None, nf4_kernel: str = "off"):
        self.model, self.tok, self.space, self.reward, self.s = model, tokenizer, space, reward, s
        self.memory_budget = memory_budget  # rollouts.generate's (effective.copy_budget)
        self.nf4_kernel = nf4_kernel  # rollouts.generate's (Effective.nf4_kernel)
        self.system_prompt = system_prompt
        self.k = candidates_per_batch
        self.warn = warn  # warn(message): a line for the run's events (a smaller batch after an OOM)
        self.fast = fast  # rollouts' decode loop choice (None: the fast loop on CUDA when supported)

    def _generate(self, prompts, seed, fast):
        s = self.s
        return generate(self.model, self.tok, prompts, max_new_tokens=s.max_new_tokens, greedy=s.greedy,
                        temperature=s.temperature, seed=seed, system_prompt=self.system_prompt, fast=fast,
                        memory_budget=self.memory_budget, nf4_kernel=self.nf4_kernel)

    def _fitness(self, rows, seed, fast, k: int = 1, kind: str | None = None) -> list[float]:
        """Fitness (`essa.fitness`, or `kind`) of the k candidates whose rows are the k
        candidate-major blocks of rows (k > 1: inside batched_lora)."""
        kind, n = kind or self.s.fitness, len(rows)
        with_reward, score = fitness.parts(kind)
        rewards = gold = None
        if with_reward:
            out = self._generate([r["prompt"] for r in rows] * k, seed, fast)
            rewards = [self.reward(out.texts[j * n:(j + 1) * n], rows, out.truncated[j * n:(j + 1) * n])[0]
                       for j in range(k)]
        if score is not None:
            batch = fitness.gold_batch(self.tok, rows, self.s.gold_template, self.system_prompt,
                                            next(self.model.parameters()).device,
                                            answer_tokens=score == "gold_margin")
            score_rows = fitness.gold_margin if score == "gold_margin" else fitness.gold_logprob
            lp = score_rows(self.model, batch, copies=k)
            gold = [lp[j * n:(j + 1) * n] for j in range(k)]
        return [fitness.combine(kind, None if rewards is None else rewards[j], None if gold is None else gold[j])
                for j in range(k)]

    @torch.inference_mode()
    def one(self, x, rows: list[dict], seed: int | None = None, kind: str | None = None) -> float:
        """Fitness of candidate x on rows (written into the LoRA weights, which keep it);
        kind="reward": its mean reward, whatever `essa.fitness` says."""
        self.space.write(x)
        return self._fitness(rows, seed, self.fast, 1, kind)[0]

    def population(self, xs, rows: list[dict], seed: int | None = None, on_candidate=None) -> list[float]:
        """Fitness of every candidate; on_candidate(index, fitness, seconds) as each is known."""
        if self.s.evaluation == "batched":
            return self._batched(xs, rows, seed, on_candidate)
        fits = []
        for i, x in enumerate(xs):
            t = time.time()
            fits.append(self.one(x, rows, seed))
            if on_candidate:
                on_candidate(i, fits[-1], time.time() - t)
        return fits

    @torch.inference_mode()
    def _batched(self, xs, rows, seed, on_candidate) -> list[float]:
        n, p = len(xs), len(rows)
        fits: list[float] = []
        start = 0
        while start < n:
            k = self.k if self.k > 0 else n
            chunk = xs[start:start + k]
            kk = len(chunk)
            t = time.time()
            stacks = self.space.stacked(np.asarray(chunk))
            # candidate-major rows: candidate j owns rows j*p .. j*p+p-1
            row_candidate = torch.arange(kk).repeat_interleave(p)
            # The decode loop is picked as for sequential evaluation (fast=None: the CUDA-graph
            # loop on CUDA). Its graph and packed factors live for one generate call, so each
            # chunk's new stacks are read afresh.
            try:
                with batched_lora(self.space.modules, stacks, row_candidate, self.space.adapter):
                    chunk_fits = self._fitness(rows, seed, self.fast, kk)
            except torch.OutOfMemoryError:
                if kk == 1:
                    raise
                chunk_fits = None  # handled below, outside the except: its traceback holds the chunk's tensors
            if chunk_fits is None:
                # K was sized from the memory free when the run started (engine/planning/effective.py);
                # another process may hold some of it since. Each candidate's rows are its own,
                # so fewer candidates a batch change no fitness, only the speed: halve K for the
                # rest of the run and score this chunk again.
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                self.k = max(1, kk // 2)
                if self.warn:
                    self.warn(f"out of GPU memory scoring {kk} ESSA candidates in one batch: continuing with "
                              f"{self.k} a batch (essa.candidates_per_batch={self.k} starts there)")
                continue
            secs = (time.time() - t) / kk
            for j in range(kk):
                fits.append(chunk_fits[j])
                if on_candidate:
                    on_candidate(start + j, fits[-1], secs)
            start += kk
        return fits


def population_fitness(evaluator: "Evaluator", xs, rows, seed, on_candidate=None) -> list[float]:
    """Fitness of every candidate of a generation. On several ranks each scores its share
    (engine/core/distributed.shard: uneven splits work) and one all_gather of (index, fitness,
    seconds) gives every rank the whole list; the same gather checks that every rank asked
    the same population (their CMA-ES states would have drifted apart otherwise)."""
    if not dist.enabled():
        return evaluator.population(xs, rows, seed, on_candidate)
    mine = dist.shard(len(xs))
    local: list = []
    evaluator.population([xs[i] for i in mine], rows, seed,
                         lambda j, f, secs: local.append((mine[j], float(f), float(secs))))
    digest = hashlib.sha1(np.ascontiguousarray(np.asarray(xs, dtype=np.float64)).tobytes()).hexdigest()
    parts = dist.all_gather_object((digest, local))
    if any(d != parts[0][0] for d, _ in parts):
        raise RuntimeError("ranks asked different CMA-ES populations (their search states differ)")
    results = sorted(r for _, part in parts for r in part)
    assert [i for i, _, _ in results] == list(range(len(xs)))
    if on_candidate:
        for i, f, secs in results:
            on_candidate(i, f, secs)
    return [f for _, f, _ in results]
