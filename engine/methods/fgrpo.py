"""F-GRPO: group-relative RL with verifiable rewards and focal group weights (docs/methods.md).

    each step:
        rows   = prompts_per_step prompts (a pure function of seed and step)
        roll   = rollouts.generate(rows, G each)           adapter on, eval mode, no grad
        r, ok  = reward.score(roll.texts, rows, roll.truncated)
        A      = group_advantages(r) * (1 - p̂) ** gamma    p̂ = share of the group that succeeds
        (focal_normalize: g / its mean over the groups whose rewards differ)
        (mask_truncated: completions cut at max_new_tokens get A = 0 and leave the loss)
        num_iterations times:                             one optimizer step each
            for each micro-batch of the rows with A != 0:
                logp = log-probs of the completion tokens under the current policy
                loss = policy_loss(logp, roll.logprobs, A, ...)  ratio against sampling log-probs
                loss.backward()
            clip, optimizer.step()

Memory/speed trade-offs:
- Rollouts decode with a KV cache at inference memory; the backward batch is rebuilt from
  the sampled ids in `micro_batch_size` rows, each trimmed to its own longest prompt and
  completion, so activation memory is bounded by the micro-batch, not the rollout batch.
- Rows whose advantage is exactly zero (groups all right or all wrong) are dropped from
  the backward when beta = 0: their gradient is exactly zero, and the loss normalisers
  still count them (grpo_loss.py), so the update equals the full-batch one. With beta > 0
  they stay (the KL term still pulls them).
- Log-probs come from the decoder's hidden states projected through lm_head only at
  completion tokens, in checkpointed chunks: never the [rows, length, vocab] logits.
- The KL reference is the same model with the adapter switched off
  (`model.disable_adapter()`): no second copy of the base.
- Old log-probs are the sampling-time ones (temperature applied, as here); with top_p < 1
  those are of the truncated nucleus distribution, so ratios start a little below 1.

Determinism: prompts and sampling seeds are functions of (seed, step) and checkpoints hold
optimizer, scheduler and RNG state, so a resumed run continues as an uninterrupted one.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, replace
from pathlib import Path

import torch

from edgetune.kernels import sebp as sebp_lib

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import phases
from edgetune.engine.core.errors import ConfigError, DataError
from edgetune.engine.core.events import read_events
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.settings import Config, FGRPOSettings

from edgetune.engine.planning.effective import copy_budget, decide, record
from edgetune.engine.planning.planner import arch_of

from edgetune.engine.models import fsdp
from edgetune.engine.models import model as model_lib

from edgetune.engine.generation.rollouts import RolloutBatch, generate

from edgetune.engine.training import stats
from edgetune.engine.training.grpo_loss import focal_weights, group_advantages, policy_loss, success_share
from edgetune.engine.training.lm_loss import completion_logprobs
from edgetune.engine.training.loop import (
    RunContext,
    check_finite,
    check_seed,
    emit_samples,
    every,
    finish,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    micro_batch_indices,
    save_checkpoint,
    save_last_checkpoint,
    seed_everything,
    start_training,
)
from edgetune.engine.training.passk import mean_pass_at_k, pass_at_k
from edgetune.engine.training.rewards import Reward, build_reward

from edgetune.engine import data as data_lib

# Distinct streams for the seeds of training rollouts and held-out evaluation, and for
# the rollouts of each rank (rank 0's seed is that of a one-process run).
_TRAIN_STREAM, _EVAL_STREAM, _RANK_STREAM = 1_000_003, 7_919, 1_000_000_007

# Completions cut at max_new_tokens rarely hold their answer, earn no reward and, once a whole
# group is cut, teach nothing: a run whose rollouts stay cut has stopped learning. On the learning
# benchmark such runs lost their held-out success (gcd) or gained little (count_bits): warn once
# when CUT_SHARE or more of every one of the last CUT_STEPS steps' completions were cut.
CUT_STEPS, CUT_SHARE = 4, 0.9


def cut_warning(cut_shares: list[float], cap: int) -> str | None:
    """The warning for a run whose recent rollouts hit the cap; cut_shares: one per step so far."""
    last = cut_shares[-CUT_STEPS:]
    if len(last) < CUT_STEPS or min(last) < CUT_SHARE:
        return None
    return (f"{100 * sum(last) / len(last):.0f}% of the completions of the last {CUT_STEPS} steps hit "
            f"fgrpo.max_new_tokens={cap} and earn no reward, so these steps teach little: raise "
            f"fgrpo.max_new_tokens, or ask for a shorter answer in the prompt or data.system_prompt")


# --------------------------------------------------------------------------- evaluation


class _Stopped(Exception):
    pass


def eval_passes(s: FGRPOSettings, greedy: bool = True) -> int:
    return int(greedy) + int(s.eval_k > 0)


@torch.no_grad()
def evaluate(model, tok, rows: list[dict], reward: Reward, s: FGRPOSettings, system_prompt: str = "",
             seed: int = 0, greedy: bool = True, tick=None, memory_budget: int | None = None,
             samples: int = 0) -> dict | None:
    """Held-out metrics: success_rate (greedy, one completion per prompt), and pass@1 /
    pass@k from n = 2k samples per prompt at the training temperature (eval_k > 0).
    The sampling seed is fixed, so before/after compare on the same random numbers.
    out["per_prompt"] holds each metric's value on each prompt, in the rows' order: the
    paired comparison of two systems on the same prompts (engine/training/stats.py).

    Rows are decoded in chunks of one training rollout batch (a size the run already
    fits); `tick(prompts_done)` before each chunk (counting over both passes) and None
    when it returns True: a stop asked for during a long evaluation ends it there.
    memory_budget: rollouts.generate's (effective.copy_budget). samples: out["samples"] holds
    the first that many prompts with their greedy completion and answer (emit_samples)."""
    out: dict = {"prompts": len(rows)}
    prompts = [r["prompt"] for r in rows]
    chunk_rows = max(1, s.prompts_per_step * s.num_generations)

    def chunks(per_prompt: int, offset: int) -> dict:
        # The same chunks with or without progress: sampled metrics depend on them.
        size = {"batch_size": max(per_prompt, chunk_rows // per_prompt * per_prompt), "memory_budget": memory_budget}
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
            out["samples"] = ([_prompt_text(p) for p in prompts[:samples]], roll.texts[:samples],
                              [str(r.get("answer", "")) for r in rows[:samples]])
    if s.eval_k > 0:
        n = 2 * s.eval_k
        roll = generate(model, tok, prompts, num_generations=n, max_new_tokens=s.max_new_tokens,
                        temperature=s.temperature, top_p=s.top_p, seed=seed * _EVAL_STREAM + 1,
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


# What grades a held-out prompt, read from the group of the config's method when it has them
# (an ESSA config grades with essa.reward at essa.max_new_tokens); the rest from fgrpo.
GRADING = ("reward", "reward_file", "max_new_tokens", "temperature", "eval_prompts")


def grading_settings(cfg: Config) -> FGRPOSettings:
    """The held-out evaluation's settings for a config of any method with a reward; a
    one-line ConfigError for a method without one (its data has no answers to grade)."""
    record = RECORDS[cfg.method]
    if not record.rewards:
        raise ConfigError(f"{record.label} runs have no held-out prompts to grade: `edgetune eval` grades methods "
                          f"with a reward ({', '.join(m.label for m in RECORDS.values() if m.rewards)})")
    group = getattr(cfg, cfg.method)
    return replace(cfg.fgrpo, **{k: getattr(group, k) for k in GRADING if hasattr(group, k)})


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


def held_out_rows(cfg: Config, tok, s: FGRPOSettings) -> list[dict]:
    """The config's held-out prompts, the first s.eval_prompts of them (0 = all)."""
    data = data_lib.load_rl(cfg.data, cfg.run.seed, tok)
    rows = data.eval[: s.eval_prompts] if s.eval_prompts else data.eval
    if not rows:
        raise DataError("no held-out rows to evaluate on (set data.eval_fraction or data.eval_path)",
                        file=cfg.data.path)
    return rows


def grade_rows(cfg: Config, s: FGRPOSettings, model, tok, rows: list[dict], progress=None,
               samples: int = 0) -> dict | None:
    """`evaluate` of a loaded model on `rows` with s's reward, the config's system prompt
    and seed; `progress(prompts_done, total)` as it advances (True back: stop, and None
    is returned)."""
    check_seed(cfg.run.seed)  # its sampling streams come from it
    reward = build_reward(s.reward, s.reward_file)
    total = len(rows) * eval_passes(s)
    tick = (lambda done: progress(done, total)) if progress is not None else None
    metrics = evaluate(model, tok, rows, reward, s, cfg.data.system_prompt, cfg.run.seed, tick=tick,
                       memory_budget=copy_budget(cfg), samples=samples)
    return None if metrics is None else {"reward_fn": reward.name, **metrics}


def evaluate_adapter(cfg: Config, adapter_path: str | None, progress=None) -> dict:
    """`edgetune eval`: held-out F-GRPO metrics of an adapter folder or a run folder
    ("" = the base alone), with each metric per prompt (`per_prompt`).
    `progress(prompts_done, total)` as the evaluation advances."""
    s = grading_settings(cfg)
    check_seed(cfg.run.seed)
    model, tok, adapter_path = eval_model(cfg, adapter_path)
    out = grade_rows(cfg, s, model, tok, held_out_rows(cfg, tok, s), progress)
    return {"adapter": adapter_path, **out}


# The metrics two systems' held-out evaluations are compared on, prompt by prompt: greedy
# success (0/1 per prompt: exact McNemar) and the mean reward (paired bootstrap).
COMPARED = ("success_rate", "reward")
BASE, ADAPTER = "the base", "the adapter"  # the two systems of a run's own comparison


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


# --------------------------------------------------------------------------- one step


def _rows_of(roll: RolloutBatch, idx: torch.Tensor) -> tuple:
    return (roll.prompt_ids[idx], roll.prompt_mask[idx], roll.completion_ids[idx], roll.completion_mask[idx])


def policy_update(model, roll: RolloutBatch, adv: torch.Tensor, s: FGRPOSettings, optimizer, scheduler,
                  sebp=None) -> dict:
    """num_iterations optimizer steps on one rollout batch; returns token-weighted metrics.

    On several ranks `roll` and `adv` are this rank's rows: the loss is normalised by the
    rows and completion tokens of all ranks, and the gradients are summed over the ranks
    before each optimizer step, so the update is the one of the whole batch."""
    N_here = adv.numel()
    N = int(dist.all_reduce_sum(N_here))
    mask = roll.completion_mask
    if s.mask_truncated:  # cut rows: no tokens in the loss nor in its normaliser, no advantage
        cut = torch.tensor(roll.truncated, dtype=torch.bool, device=mask.device)
        mask = mask * (~cut).to(mask.dtype)[:, None]
        adv = adv.masked_fill(cut.to(adv.device), 0.0)
    num_tokens = dist.all_reduce_sum(float(mask.sum()))
    # beta = 0: zero-advantage rows give exactly zero gradient (see the module docstring).
    keep = (adv != 0).nonzero().view(-1) if s.beta == 0 else torch.arange(N_here, device=adv.device)
    kept = int(dist.all_reduce_sum(keep.numel()))
    out = {"dropped": N - kept, "loss": 0.0, "kl": 0.0, "clip_ratio": 0.0, "ratio": 1.0,
           "grad_norm": 0.0, "train_tokens": 0, "train_s": 0.0}
    if kept == 0:  # nothing to learn from: no update, but the schedule keeps time
        for _ in range(s.num_iterations):
            scheduler.step()
        return out
    t = time.time()
    mb = s.micro_batch_size if s.micro_batch_size > 0 else max(N_here, 1)
    chunks = [(keep[i : i + mb], 1.0) for i in range(0, keep.numel(), mb)]
    sharded = fsdp.is_sharded(model)
    if sharded:  # every forward and backward is a collective: as many chunks on every rank
        most = int(dist.all_reduce_max(len(chunks)))
        chunks += [(keep[:1] if keep.numel() else torch.arange(1, device=adv.device), 0.0)] * (most - len(chunks))
    ref = []
    if s.beta != 0:
        with torch.no_grad(), model.disable_adapter():
            for c, _ in chunks:
                with model_lib.autocast(model):
                    ref.append(completion_logprobs(model, *_rows_of(roll, c), temperature=s.temperature))
    params = [p for p in model.parameters() if p.requires_grad]
    model.train()
    sums = {"kl": 0.0, "clip_ratio": 0.0, "ratio": 0.0, "tokens": 0.0}
    loss_total, norms = 0.0, []
    for _ in range(s.num_iterations):
        for j, (c, weight) in enumerate(chunks):
            rows = _rows_of(roll, c)
            with model_lib.autocast(model):
                logp = completion_logprobs(model, *rows, temperature=s.temperature, sebp=sebp)
            loss, m = policy_loss(logp, roll.logprobs[c].float(), adv[c], mask[c].float(), s.loss_type,
                                  s.epsilon, s.epsilon_high, ref_logp=ref[j] if ref else None, beta=s.beta,
                                  max_completion_length=s.max_new_tokens, num_sequences=N,
                                  num_tokens=num_tokens)
            if weight == 0:  # a padding chunk: the collectives only
                (loss * 0.0).backward()
                continue
            loss.backward()
            loss_total += float(loss.detach())
            for k in ("kl", "clip_ratio", "ratio"):
                sums[k] += m[k] * m["tokens"]
            sums["tokens"] += m["tokens"]
            out["train_tokens"] += int(rows[1].sum() + rows[3].sum())
        if not sharded:  # sharded: FSDP reduce-scattered them in each backward
            dist.all_reduce_grads(params)
        norms.append(fsdp.clip_grad_norm(params, s.max_grad_norm or float("inf")))
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)
    if dist.enabled():  # each rank's loss is its share of the whole batch's: they add up
        parts = dist.all_gather_object([loss_total, out["train_tokens"], *sums.values()])
        loss_total, out["train_tokens"], *rest = [sum(v) for v in zip(*parts)]
        sums = dict(zip(sums, rest))
    denom = max(sums["tokens"], 1.0)
    out.update(loss=loss_total / s.num_iterations, kl=sums["kl"] / denom, clip_ratio=sums["clip_ratio"] / denom,
               ratio=sums["ratio"] / denom, grad_norm=sum(norms) / len(norms), train_s=time.time() - t)
    return out


# --------------------------------------------------------------------------- the loop


def train(ctx: RunContext) -> dict:
    cfg, s = ctx.cfg, ctx.cfg.fgrpo
    seed_everything(cfg.run.seed)
    t0 = time.time()
    if s.loss_type == "cispo" and s.epsilon_high < 1:
        ctx.emit("warning", message=f"cispo caps the ratio at fgrpo.epsilon_high={s.epsilon_high} (an absolute "
                                    "value, e.g. 5.0, not a clip width): most tokens will be capped")

    if s.prompts_per_step < dist.world():
        raise ConfigError(f"fgrpo.prompts_per_step ({s.prompts_per_step}) must be at least the number of ranks "
                          f"({dist.world()}): each rank samples whole groups of its own prompts")
    reward = build_reward(s.reward, s.reward_file)  # a bad reward fails before the model loads
    phases.emit(ctx.emit, "loading")
    model, tok, base_path = model_lib.load(cfg)
    device = model_lib.resolve_device(cfg.model)
    eff = decide(cfg, device, arch_of(model), checkpointed=model_lib.checkpointed_layers(model))
    record(ctx.run, cfg, eff)
    phases.emit(ctx.emit, "data_check")
    data = data_lib.load_rl(cfg.data, cfg.run.seed, tok, phases.data_progress(ctx.emit))
    ctx.emit("data", report=data.report.__dict__)
    if not data.train:
        raise DataError("no training rows left after validation", file=cfg.data.path)
    held_out = data.eval[: s.eval_prompts] if s.eval_prompts else data.eval
    G, sys_prompt = s.num_generations, cfg.data.system_prompt

    dist.broadcast_params(model.parameters())  # the ranks start from rank 0's adapter
    if cfg.model.shard == "fsdp" and dist.enabled():
        fsdp.shard(model)  # each rank keeps 1/N of the base and of the adapter
    optimizer = make_optimizer(model.parameters(), eff.optimizer, s.lr, 0.0, device)
    scheduler = make_scheduler(optimizer, s.warmup_steps * s.num_iterations,
                               (ctx.schedule_steps or s.steps) * s.num_iterations)
    start_step = 0
    metrics: dict = {}
    if ctx.resume is not None:
        state = load_checkpoint(ctx.resume, model, optimizer, scheduler)
        start_step, metrics = state["step"], dict(state.get("metrics", {}))

    per_prompt: dict = {}  # each evaluation's outcomes per prompt, by its key: the paired comparison

    def held_out_eval(sebp, step: int, key: str, phase: str | None = None, samples: int = s.samples) -> None:
        tick = None
        if phase is not None:
            unit = "prompts" if eval_passes(s) == 1 else "prompts (greedy, then pass@k samples)"
            tick = phases.counter(ctx.emit, phase, len(held_out) * eval_passes(s), unit, ctx.should_stop)
        with sebp.lifted():  # generation: the model's own forwards (fast_decode)
            m = evaluate(model, tok, held_out, reward, s, sys_prompt, cfg.run.seed, tick=tick,
                         memory_budget=copy_budget(cfg), samples=samples)
        if m is None:  # stopped during the evaluation
            return
        shown = m.pop("samples", None)
        per_prompt[key] = m.pop("per_prompt")
        for k, v in m.items():
            if k != "prompts":
                metrics[f"{k}_{key}"] = v
        ctx.emit("eval", step=step, **m)
        if shown:  # the greedy completions the evaluation made
            emit_samples(ctx, step, *shown)

    # The base model's held-out figures (`*_start`) are measured after training, with the
    # adapter switched off, so the first step comes right after loading: the same figures
    # as before it (the adapter starts at zero, and evaluation samples from its own seeded
    # generator, apart from training's). A run that has them already (trained further, or
    # resumed after it measured them) keeps those: its events hold an evaluation at step 0.
    had = any(e["type"] == "eval" and e.get("step") == 0 for e in read_events(ctx.run.events_path)) \
        if dist.is_main() else None
    base_due = held_out and not dist.broadcast_object(had)
    with sebp_lib.enabled(model, eff.sebp) as sebp:  # the patch comes off however the loop ends
        progress = start_training(ctx, s.steps, start_step)
        step, stopped, warned = start_step, False, 0
        cut_shares: list[float] = []  # per step, for cut_warning (once a run)
        cut_warned = False
        while step < s.steps:
            if ctx.should_stop():
                stopped = True
                break
            t_step = time.time()
            rows = [data.train[i] for i in micro_batch_indices(len(data.train), s.prompts_per_step, step, cfg.run.seed)]
            rows = [rows[i] for i in dist.shard(len(rows))]  # this rank's prompts (all of them on one)
            with sebp.lifted():  # generation: the model's own forwards (fast_decode)
                roll = generate(model, tok, [r["prompt"] for r in rows], num_generations=G,
                                max_new_tokens=s.max_new_tokens, temperature=s.temperature, top_p=s.top_p,
                                seed=cfg.run.seed * _TRAIN_STREAM + step + dist.rank() * _RANK_STREAM,
                                system_prompt=sys_prompt, memory_budget=copy_budget(cfg))
            gen_s = time.time() - t_step
            row_of = [rows[i] for i in roll.prompt_index]
            sc = reward.score(roll.texts, row_of, roll.truncated, threshold=s.success_threshold)
            # Every rank gets the whole step's scores (a few numbers per completion): the
            # advantages are computed over all of them, then each rank takes its rows.
            parts = dist.all_gather_object((sc.rewards, sc.success, roll.truncated, sc.errors))
            first = sum(len(p[0]) for p in parts[:dist.rank()])
            all_rewards, all_success, all_truncated, all_errors = (sum((list(p[k]) for p in parts), [])
                                                                   for k in range(4))
            bad = [e for e in all_errors if e]
            if bad and warned < 3:
                warned += 1
                more = " (further reward warnings are not shown)" if warned == 3 else ""
                ctx.emit("warning", message=f"reward failed on {len(bad)} of {len(all_errors)} completions: "
                                            f"{bad[0]}{more}")
            r = torch.tensor(all_rewards, dtype=torch.float32, device=roll.logprobs.device)
            ok = torch.tensor(all_success, device=r.device)
            g = focal_weights(r, G, s.gamma, success=ok, normalize=s.focal_normalize)
            adv = group_advantages(r, G, s.scale_rewards) * g
            upd = policy_update(model, roll, adv[first:first + len(sc.rewards)], s, optimizer, scheduler, sebp)
            check_finite(step + 1, {"loss": upd["loss"], "gradient norm": upd["grad_norm"]},
                         f"lower fgrpo.lr (now {s.lr:g}) or lora.alpha (now {cfg.lora.alpha:g})"
                         + ("" if s.max_grad_norm else ", or set fgrpo.max_grad_norm"))
            step += 1

            p_hat = success_share(ok, G)
            cut_shares.append(sum(all_truncated) / max(len(all_truncated), 1))  # the step event's truncated
            if not cut_warned and (msg := cut_warning(cut_shares, s.max_new_tokens)):
                ctx.emit("warning", message=msg)
                cut_warned = True
            gen_tokens = int(dist.all_reduce_sum(int(roll.completion_mask.sum())))
            metrics.update(reward_mean=float(r.mean()), success_rate=float(ok.float().mean()))
            if every(cfg.run.log_every, step) or step == s.steps:
                ctx.emit("step", **progress.fields(step), reward_mean=float(r.mean()),
                         reward_std=float(r.std()) if r.numel() > 1 else 0.0, success_rate=float(ok.float().mean()),
                         all_correct=float((p_hat == 1).float().mean()), all_wrong=float((p_hat == 0).float().mean()),
                         focal_weight=float(g.view(-1, G)[:, 0].mean()), dropped=upd["dropped"],
                         # no KL term at fgrpo.beta = 0: none measured (not a flat 0 that looks like one)
                         loss=upd["loss"], kl=upd["kl"] if s.beta > 0 else None, clip_ratio=upd["clip_ratio"],
                         ratio=upd["ratio"],
                         grad_norm=upd["grad_norm"], lr=scheduler.get_last_lr()[0],
                         completion_len=gen_tokens / max(len(all_rewards), 1),
                         truncated=cut_shares[-1],
                         gen_tokens_per_s=round(gen_tokens / max(gen_s, 1e-9), 1),
                         train_tokens_per_s=round(upd["train_tokens"] / max(upd["train_s"], 1e-9), 1),
                         tokens_per_s=round(gen_tokens / (time.time() - t_step), 1),
                         gen_s=round(gen_s, 2), train_s=round(upd["train_s"], 2))
            if every(s.sample_every, step):
                ctx.emit("sample", step=step, prompt=_prompt_text(rows[0]["prompt"]), completion=roll.texts[0],
                         reward=sc.rewards[0], answer=str(rows[0].get("answer", "")))
            if held_out and every(s.eval_every, step) and step < s.steps:
                held_out_eval(sebp, step, "last")
            if every(cfg.run.checkpoint_every, step) and step < s.steps:
                save_checkpoint(ctx, step, model, optimizer, scheduler, metrics=metrics)
        save_last_checkpoint(ctx, stopped, start_step, step, model, optimizer, scheduler, metrics=metrics)
        if held_out and not stopped:
            held_out_eval(sebp, step, "end", "final_eval")
            if base_due and not ctx.should_stop():
                with model.disable_adapter():  # the samples shown stay the adapter's
                    held_out_eval(sebp, 0, "start", "base_eval", samples=0)
        if "start" in per_prompt and "end" in per_prompt:  # did it help: paired on the same prompts
            for c in compare_held_out(BASE, per_prompt["start"], ADAPTER, per_prompt["end"]):
                ctx.emit("comparison", step=step, **c)
    model.eval()
    phases.emit(ctx.emit, "export")
    return finish(ctx, model, tok, base_path, step, metrics, stopped, t0)


def _prompt_text(prompt) -> str:
    if isinstance(prompt, str):
        return prompt
    return "\n".join(f"{m.get('role')}: {m.get('content')}" for m in prompt)
