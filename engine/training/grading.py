"""Grading completions, for every method: greedy success and mean reward, pass@1 / pass@k
from sampled completions (engine/training/passk.py), each per prompt so that two systems
(the base and an adapter, or two adapters) compare on the same prompts with a paired test
(engine/training/stats.py). What grades a run is its method's settings' `grading()`
(engine/core/settings/grading.py's GradingSettings): F-GRPO's loop grades its held-out prompts with
its own at fgrpo.eval_every and at the end; `edgetune eval` (engine/run/evaluation.py) grades
held-out prompts and task files with the config's, on an adapter folder or the base.
"""

from __future__ import annotations

import copy
from dataclasses import asdict, replace
from pathlib import Path

import torch

from edgetune.engine.core.errors import ConfigError, DataError
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings import Config, GradingSettings

from edgetune.engine.planning.effective import copy_budget, rollout_nf4_kernel

from edgetune.engine.models import model as model_lib

from edgetune.engine.generation.rollouts import generate

from edgetune.engine.training import stats
from edgetune.engine.training.loop import check_seed
from edgetune.engine.training.passk import mean_pass_at_k, pass_at_k
from edgetune.engine.training.rewards import Reward, build_reward

from edgetune.engine import data as data_lib

# The seed stream of the graded samples, apart from training's rollouts
# (engine/methods/fgrpo/fgrpo.py): grading changes no training random number.
EVAL_STREAM = 7_919


class _Stopped(Exception):
    pass


def eval_passes(s: GradingSettings, greedy: bool = True) -> int:
    return int(greedy) + int(s.eval_k > 0)


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], reward: Reward, s: GradingSettings, system_prompt: str = "",
             seed: int = 0, greedy: bool = True, tick=None, memory_budget: int | None = None,
             samples: int = 0, nf4_kernel: str = "off") -> dict | None:
    """Held-out metrics: success_rate (greedy, one completion per prompt), and pass@1 /
    pass@k from n = 2k samples per prompt at the training temperature (eval_k > 0).
    The sampling seed is fixed, so before/after compare on the same random numbers.
    out["per_prompt"] holds each metric's value on each prompt, in the rows' order: the
    paired comparison of two systems on the same prompts (engine/training/stats.py).

    Rows are decoded in chunks of s.batch_rows (one training rollout batch: a size the
    run already fits); `tick(prompts_done)` before each chunk (counting over both passes) and None
    when it returns True: a stop asked for during a long evaluation ends it there.
    memory_budget, nf4_kernel: rollouts.generate's (effective.copy_budget,
    Effective.nf4_kernel). samples: out["samples"] holds
    the first that many prompts with their greedy completion and answer (emit_samples)."""
    out: dict = {"prompts": len(rows)}
    prompts = [r["prompt"] for r in rows]
    chunk_rows = max(1, s.batch_rows)

    def chunks(per_prompt: int, offset: int) -> dict:
        # The same chunks with or without progress: sampled metrics depend on them.
        size = {"batch_size": max(per_prompt, chunk_rows // per_prompt * per_prompt), "memory_budget": memory_budget,
                "nf4_kernel": nf4_kernel}
        if tick is None:
            return size

        def on_chunk(idx):
            if tick(offset + idx[0] // per_prompt):
                raise _Stopped
        return {**size, "on_chunk": on_chunk}

    try:
        return _evaluate(model, tok, rows, prompts, reward, s, system_prompt, seed, greedy, out, chunks, tick,
                         samples)
    except _Stopped:
        return None


def _evaluate(model, tok, rows, prompts, reward, s, system_prompt, seed, greedy, out, chunks, tick, samples):
    done, per = 0, {}
    if greedy:
        roll = generate(model, tok, prompts, max_new_tokens=s.max_new_tokens, greedy=True,
                        system_prompt=system_prompt, **chunks(1, 0))
        done = len(rows)
        sc = reward.score(roll.texts, rows, roll.truncated, threshold=s.success_threshold)
        out["success_rate"] = sum(sc.success) / len(rows)
        out["reward"] = sum(sc.rewards) / len(rows)
        per["success_rate"] = [int(bool(x)) for x in sc.success]
        per["reward"] = [float(x) for x in sc.rewards]
        if samples:
            out["samples"] = ([prompt_text(p) for p in prompts[:samples]], roll.texts[:samples],
                              [str(r.get("answer", "")) for r in rows[:samples]])
    if s.eval_k > 0:
        n = 2 * s.eval_k
        roll = generate(model, tok, prompts, num_generations=n, max_new_tokens=s.max_new_tokens,
                        temperature=s.temperature, top_p=s.top_p, seed=seed * EVAL_STREAM + 1,
                        system_prompt=system_prompt, **chunks(n, done))
        sc = reward.score(roll.texts, [rows[i] for i in roll.prompt_index], roll.truncated,
                          threshold=s.success_threshold)
        counts = [(n, sum(sc.success[i * n : (i + 1) * n])) for i in range(len(rows))]
        out["pass@1"] = mean_pass_at_k(counts, 1)
        out[f"pass@{s.eval_k}"] = mean_pass_at_k(counts, s.eval_k)
        per["pass@1"] = [pass_at_k(n, c, 1) for n, c in counts]
        per[f"pass@{s.eval_k}"] = [pass_at_k(n, c, s.eval_k) for n, c in counts]
        done += len(rows)
    if tick is not None:
        tick(done)
    out["per_prompt"] = per
    return out


def grading_settings(cfg: Config) -> GradingSettings:
    """How the config's runs are graded: its method's settings' `grading()`."""
    return getattr(cfg, cfg.method).grading()


def held_out_grading(cfg: Config) -> GradingSettings:
    """The grading of the config's held-out prompts, for a method with a reward; a one-line
    ConfigError for a method without one (its data has no answers to grade)."""
    record = RECORDS[cfg.method]
    if not record.rewards:
        raise ConfigError(f"{record.label} runs have no held-out prompts to grade: `edgetune eval` grades methods "
                          f"with a reward ({', '.join(m.label for m in RECORDS.values() if m.rewards)})")
    return grading_settings(cfg)


def eval_model(cfg: Config, adapter_path: str | None):
    """(model, tokenizer, adapter folder or None) an evaluation grades: the config's base
    with the adapter of an adapter folder or a run folder ("" = the base alone, for a
    before/after comparison in the same precision), in eval mode."""
    cfg = copy.deepcopy(cfg)
    if adapter_path:
        if (Path(adapter_path) / "adapter" / "adapter_config.json").is_file():  # a run folder
            adapter_path = str(Path(adapter_path) / "adapter")
        if not (Path(adapter_path) / "adapter_config.json").is_file():
            raise ConfigError(f"not an adapter folder (no adapter_config.json): {adapter_path}")
        cfg.lora = replace(cfg.lora, init_from=str(adapter_path))
    cfg.model = replace(cfg.model, gradient_checkpointing=False)
    model, tok, _ = model_lib.load(cfg)
    model.eval()
    return model, tok, adapter_path or None


def held_out_rows(cfg: Config, tok, s: GradingSettings) -> list[dict]:
    """The config's held-out prompts, the first s.eval_prompts of them (0 = all)."""
    data = data_lib.load_rl(cfg.data, cfg.run.seed, tok)
    rows = data.eval[: s.eval_prompts] if s.eval_prompts else data.eval
    if not rows:
        raise DataError("no held-out rows to evaluate on (set data.eval_fraction or data.eval_path)",
                        file=cfg.data.path)
    return rows


def grade_rows(cfg: Config, s: GradingSettings, model, tok, rows: list[dict], progress=None,
               samples: int = 0) -> dict | None:
    """`evaluate` of a loaded model on `rows` with s's reward, the config's system prompt
    and seed; `progress(prompts_done, total)` as it advances (True back: stop, and None
    is returned)."""
    check_seed(cfg.run.seed)  # its sampling streams come from it
    reward = build_reward(s.reward, s.reward_file)
    total = len(rows) * eval_passes(s)
    tick = (lambda done: progress(done, total)) if progress is not None else None
    device = str(next(model.parameters()).device)
    metrics = evaluate(model, tok, rows, reward, s, cfg.data.system_prompt, cfg.run.seed, tick=tick,
                       memory_budget=copy_budget(cfg), samples=samples,
                       nf4_kernel=rollout_nf4_kernel(cfg.model.nf4_kernel, device))
    return None if metrics is None else {"reward_fn": reward.name, **metrics}


def evaluate_adapter(cfg: Config, adapter_path: str | None, progress=None) -> dict:
    """The held-out metrics of an adapter folder or a run folder ("" = the base alone), with
    each metric per prompt (`per_prompt`). `progress(prompts_done, total)` as the
    evaluation advances."""
    s = held_out_grading(cfg)
    check_seed(cfg.run.seed)
    model, tok, adapter_path = eval_model(cfg, adapter_path)
    out = grade_rows(cfg, s, model, tok, held_out_rows(cfg, tok, s), progress)
    return {"adapter": adapter_path, **out}


# The metrics two systems' held-out evaluations are compared on, prompt by prompt: greedy
# success (0/1 per prompt: exact McNemar) and the mean reward (paired bootstrap).
COMPARED = ("success_rate", "reward")
BASE, ADAPTER = stats.BASE, stats.ADAPTER  # the two systems of a run's own comparison


def held_out_scores(per_prompt: dict) -> dict:
    """Each metric of an evaluation's `per_prompt` with its 95% interval: Wilson for the
    0/1 greedy success, the bootstrap for the means (reward, pass@k per prompt)."""
    out = {}
    for metric, values in per_prompt.items():
        ci = stats.wilson(sum(values), len(values)) if metric == "success_rate" else stats.bootstrap_mean(values)
        out[metric] = asdict(ci)
    return out


def compare_held_out(a: str, a_per_prompt: dict, b: str, b_per_prompt: dict) -> list[dict]:
    """System b against system a on the same held-out prompts, one dict per metric of
    COMPARED that both have: the paired test's fields and the answer in words."""
    out = []
    for metric in COMPARED:
        xa, xb = a_per_prompt.get(metric), b_per_prompt.get(metric)
        if xa is None or xb is None:
            continue
        c = (stats.compare_proportions if metric == "success_rate" else stats.compare_means)(xa, xb)
        out.append({"a": a, "b": b, "metric": metric, **c.dict(), "words": stats.in_words(c, a, b)})
    return out


def prompt_text(prompt) -> str:
    """A prompt as it is shown: its text, or a chat's turns one a line."""
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
