"""F-GRPO: group-relative RL with verifiable rewards and focal group weights (docs/methods.md).

    each step:
        rows   = prompts_per_step prompts (a pure function of seed and step)
        generate_trajectory:
            roll   = rollouts.generate(rows, G each)       adapter on, eval mode, no grad
            r, ok  = reward.score(roll.texts, rows, roll.truncated)
            A      = group_advantages(r) * (1 - p̂) ** gamma  p̂ = share of the group that succeeds
            (focal_normalize: g / its mean over the groups whose rewards differ)
        policy_update, num_iterations times:              one optimizer step each
            (mask_truncated: completions cut at max_new_tokens get A = 0 and leave the loss)
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
  still count them (loss.py), so the update equals the full-batch one. With beta > 0
  they stay (the KL term still pulls them).
- Log-probs come from the decoder's hidden states projected through lm_head only at
  completion tokens, in checkpointed chunks: never the [rows, length, vocab] logits.
- The KL reference is the same model with the adapter switched off
  (`model.disable_adapter()`): no second copy of the base.
- Old log-probs are the sampling-time ones (temperature applied, as here); with top_p < 1
  those are of the truncated nucleus distribution, so ratios start a little below 1.

The held-out evaluation (greedy success, pass@k, the base against the adapter) is the
shared grading (engine/training/grading.py) with fgrpo's `grading()`; the losses are loss.py.

Determinism: prompts and sampling seeds are functions of (seed, step) and checkpoints hold
optimizer, scheduler and RNG state, so a resumed run continues as an uninterrupted one.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from edgetune.kernels import sebp as sebp_lib

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import phases
from edgetune.engine.core.arch import arch_of
from edgetune.engine.core.errors import ConfigError, DataError
from edgetune.engine.core.events import read_events
from edgetune.engine.core.settings import FGRPOSettings

from edgetune.engine.planning.effective import copy_budget, decide, record

from edgetune.engine.models import fsdp
from edgetune.engine.models import model as model_lib

from edgetune.engine.generation.rollouts import RolloutBatch, generate

from edgetune.engine.training.grading import ADAPTER, BASE, compare_held_out, eval_passes, evaluate, prompt_text
from edgetune.engine.training.lm_loss import completion_logprobs
from edgetune.engine.training.loop import (
    RunContext,
    check_finite,
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
from edgetune.engine.training.rewards import Reward, build_reward

from edgetune.engine.methods.fgrpo.loss import focal_weights, group_advantages, policy_loss, success_share

from edgetune.engine import data as data_lib

# Distinct seed streams for the training rollouts (held-out evaluation has its own:
# grading.EVAL_STREAM) and for the rollouts of each rank (rank 0's seed is that of a
# one-process run).
_TRAIN_STREAM, _RANK_STREAM = 1_000_003, 1_000_000_007


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
    sys_prompt = cfg.data.system_prompt

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

    grading = s.grading()

    def held_out_eval(sebp, step: int, key: str, phase: str | None = None, samples: int = s.samples) -> None:
        tick = None
        if phase is not None:
            unit = "prompts" if eval_passes(grading) == 1 else "prompts (greedy, then pass@k samples)"
            tick = phases.counter(ctx.emit, phase, len(held_out) * eval_passes(grading), unit, ctx.should_stop)
        with sebp.lifted():  # generation: the model's own forwards (fast_decode)
            m = evaluate(model, tok, held_out, reward, grading, sys_prompt, cfg.run.seed, tick=tick,
                         memory_budget=copy_budget(cfg), samples=samples, nf4_kernel=eff.nf4_kernel)
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
    with sebp_lib.enabled(model, eff.sebp, s.sebp_kernel) as sebp:  # the patch comes off however the loop ends
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
                traj = generate_trajectory(model, tok, rows, reward, s, sys_prompt, copy_budget(cfg),
                                           seed=cfg.run.seed * _TRAIN_STREAM + step + dist.rank() * _RANK_STREAM,
                                           nf4_kernel=eff.nf4_kernel)
            bad = [e for e in traj.errors if e]
            if bad and warned < 3:
                warned += 1
                more = " (further reward warnings are not shown)" if warned == 3 else ""
                ctx.emit("warning", message=f"reward failed on {len(bad)} of {len(traj.errors)} completions: "
                                            f"{bad[0]}{more}")
            upd = policy_update(model, traj.roll, traj.advantages, s, optimizer, scheduler, sebp)
            check_finite(step + 1, {"loss": upd["loss"], "gradient norm": upd["grad_norm"]},
                         f"lower fgrpo.lr (now {s.lr:g}) or lora.alpha (now {cfg.lora.alpha:g})"
                         + ("" if s.max_grad_norm else ", or set fgrpo.max_grad_norm"))
            step += 1

            cut_shares.append(traj.cut_share)
            if not cut_warned and (msg := cut_warning(cut_shares, s.max_new_tokens)):
                ctx.emit("warning", message=msg)
                cut_warned = True
            metrics.update(reward_mean=float(traj.rewards.mean()), success_rate=float(traj.success.float().mean()))
            if every(cfg.run.log_every, step) or step == s.steps:
                ctx.emit("step", **progress.fields(step), **step_metrics(traj, upd, s, scheduler.get_last_lr()[0],
                                                                        time.time() - t_step))
            if every(s.sample_every, step):
                ctx.emit("sample", step=step, prompt=prompt_text(rows[0]["prompt"]), completion=traj.roll.texts[0],
                         reward=traj.first_reward, answer=str(rows[0].get("answer", "")))
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


# --------------------------------------------------------------------------- one step


@dataclass
class Trajectory:
    """One step's completions, scored and weighed: what `policy_update` learns from.
    rewards, success and weights hold the whole step's completions (every rank's, G per
    prompt, prompt-major); roll and advantages this rank's."""

    roll: RolloutBatch
    rewards: torch.Tensor
    success: torch.Tensor
    weights: torch.Tensor  # each completion's focal weight (its group's)
    advantages: torch.Tensor
    errors: list  # the reward's failure on each completion of the step ("" where it ran)
    cut_share: float  # share of the step's completions cut at max_new_tokens
    completion_tokens: int  # the step's generated tokens, all ranks
    first_reward: float  # the reward of this rank's first completion (the sample event shows it)
    gen_s: float


def generate_trajectory(model, tok, rows: list[dict], reward: Reward, s: FGRPOSettings, system_prompt: str,
                        memory_budget: int | None, seed: int, nf4_kernel: str = "off") -> Trajectory:
    """G completions of each of this rank's prompts, their rewards and success, and the
    focal group-relative advantages of this rank's rows. Every rank gets the whole step's
    scores (a few numbers per completion): the advantages are computed over all of them,
    then each rank takes its rows."""
    G, t = s.num_generations, time.time()
    # On the CPU the sampling log-probs come from the layers the update computes with: the
    # fp32 copy's differ from bitsandbytes' bf16-rounded NF4 outputs, and the policy ratio
    # would carry that difference.
    cuda = next(model.parameters()).device.type == "cuda"
    roll = generate(model, tok, [r["prompt"] for r in rows], num_generations=G, max_new_tokens=s.max_new_tokens,
                    temperature=s.temperature, top_p=s.top_p, seed=seed, system_prompt=system_prompt,
                    memory_budget=memory_budget, nf4_kernel=nf4_kernel, fast=None if cuda else False)
    gen_s = time.time() - t
    sc = reward.score(roll.texts, [rows[i] for i in roll.prompt_index], roll.truncated, threshold=s.success_threshold)
    parts = dist.all_gather_object((sc.rewards, sc.success, roll.truncated, sc.errors))
    first = sum(len(p[0]) for p in parts[:dist.rank()])
    rewards, success, truncated, errors = (sum((list(p[k]) for p in parts), []) for k in range(4))
    r = torch.tensor(rewards, dtype=torch.float32, device=roll.logprobs.device)
    ok = torch.tensor(success, device=r.device)
    g = focal_weights(r, G, s.gamma, success=ok, normalize=s.focal_normalize)
    adv = group_advantages(r, G, s.scale_rewards) * g
    return Trajectory(roll, r, ok, g, adv[first:first + len(sc.rewards)], errors,
                      cut_share=sum(truncated) / max(len(truncated), 1),
                      completion_tokens=int(dist.all_reduce_sum(int(roll.completion_mask.sum()))),
                      first_reward=sc.rewards[0], gen_s=gen_s)


def step_metrics(traj: Trajectory, upd: dict, s: FGRPOSettings, lr: float, step_s: float) -> dict:
    """The step event's figures: the rollouts' rewards and groups, the update's loss and
    ratios, the speeds."""
    r, ok, G = traj.rewards, traj.success, s.num_generations
    p_hat = success_share(ok, G)
    return dict(reward_mean=float(r.mean()), reward_std=float(r.std()) if r.numel() > 1 else 0.0,
                success_rate=float(ok.float().mean()), all_correct=float((p_hat == 1).float().mean()),
                all_wrong=float((p_hat == 0).float().mean()), focal_weight=float(traj.weights.view(-1, G)[:, 0].mean()),
                dropped=upd["dropped"], loss=upd["loss"],
                # no KL term at fgrpo.beta = 0: none measured (not a flat 0 that looks like one)
                kl=upd["kl"] if s.beta > 0 else None, clip_ratio=upd["clip_ratio"], ratio=upd["ratio"],
                grad_norm=upd["grad_norm"], lr=lr, completion_len=traj.completion_tokens / max(r.numel(), 1),
                truncated=traj.cut_share, gen_tokens_per_s=round(traj.completion_tokens / max(traj.gen_s, 1e-9), 1),
                train_tokens_per_s=round(upd["train_tokens"] / max(upd["train_s"], 1e-9), 1),
                tokens_per_s=round(traj.completion_tokens / step_s, 1),
                gen_s=round(traj.gen_s, 2), train_s=round(upd["train_s"], 2))


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
