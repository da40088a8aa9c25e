"""DPO: preference tuning of a LoRA adapter on a 4-bit base, from chosen / rejected pairs.

Each pair is two labelled rows with the same prompt (engine/data/pairs.py); a micro-batch's
chosen and rejected rows go through the model in one forward, and the loss compares the
log-probabilities of the two replies (docs/methods.md has the formulas and references):

    sigmoid (DPO)  -log σ(β [(log π(c) - log π_ref(c)) - (log π(r) - log π_ref(r))])
    ipo            ((Δ_c / |c| - Δ_r / |r|) - 1 / 2β)²      Δ = log π - log π_ref
    simpo          -log σ(β (log π(c) / |c| - log π(r) / |r|) - γ)        no reference
    orpo           NLL(c) - β log σ(log odds(c) - log odds(r)), odds(y) = p / (1 - p) with
                   p the per-token mean probability of y                no reference

The reference policy is the same base with the adapter switched off (PEFT's
disable_adapter), or, when the run starts from an adapter (lora.init_from), that starting
adapter: its weights are kept beside the trained ones and swapped in for the reference's
forward. No second model is held in memory; the reference's log-probabilities are computed
under no_grad in the same step, on the same batch. Each loss equals TRL's for the same
inputs (tests/test_dpo.py calls TRL's own code).

Per step the events carry the loss, the reward margin (β Δ_c - β Δ_r; SimPO / ORPO: β times
the mean log-prob of c minus that of r), the preference accuracy (the share of pairs whose
chosen reply wins) and the mean log-probs of the chosen and rejected replies; each
evaluation the same on the held-out pairs, and greedy completions of a few held-out prompts.
Determinism, stop, resume and train-more are those of SFT (engine/training/loop.py).
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.nn.functional as F

from edgetune.kernels import sebp as sebp_lib

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import phases
from edgetune.engine.core.arch import arch_of
from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DPO_REFERENCE_FREE

from edgetune.engine.planning.effective import decide, record

from edgetune.engine.models import model as model_lib

from edgetune.engine.generation.samples import complete_samples, sample_prompts

from edgetune.engine.training.lm_loss import labelled_logprobs
from edgetune.engine.training.loop import (
    RunContext,
    check_finite,
    emit_samples,
    every,
    finish,
    load_checkpoint,
    make_optimizer,
    make_scheduler,
    save_checkpoint,
    save_last_checkpoint,
    seed_everything,
    start_training,
    step_rows,
)

from edgetune.engine import data as data_lib

REFERENCE_FREE = DPO_REFERENCE_FREE


def train(ctx: RunContext) -> dict:
    cfg, s = ctx.cfg, ctx.cfg.dpo
    seed_everything(cfg.run.seed)
    t0 = time.time()
    phases.emit(ctx.emit, "data_check")
    tok = model_lib.load_tokenizer(model_lib.check_model(cfg.model))
    data = data_lib.load_pairs(cfg.data, tok, cfg.run.seed, phases.data_progress(ctx.emit))
    ctx.emit("data", report=data.report.__dict__)
    if not data.train:
        raise DataError("no training pairs left after validation", file=cfg.data.path)
    phases.emit(ctx.emit, "loading")
    model, tok, base_path = model_lib.load(cfg)
    device = model_lib.resolve_device(cfg.model)
    eff = decide(cfg, device, arch_of(model), checkpointed=model_lib.checkpointed_layers(model))
    record(ctx.run, cfg, eff)
    dist.broadcast_params(model.parameters())  # the ranks start from rank 0's adapter
    # kept before a resume loads its checkpoint: the reference is the adapter the run started from
    reference = Reference(model, bool(cfg.lora.init_from) and s.loss_type not in REFERENCE_FREE)
    optimizer = make_optimizer(model.parameters(), eff.optimizer, s.lr, s.weight_decay, device)
    scheduler = make_scheduler(optimizer, s.warmup_steps, ctx.schedule_steps or s.steps)
    start_step = 0
    # The reference policy's log-probs of the held-out replies (each batch's chosen then
    # rejected rows): the reference never changes, so they are computed once a run (by the
    # initial evaluation, where the policy is the reference) and kept in the checkpoints.
    ref_logps = None
    if ctx.resume is not None:
        state = load_checkpoint(ctx.resume, model, optimizer, scheduler)
        start_step, ref_logps = state["step"], state.get("reference_logps")

    pad_id = tok.pad_token_id
    metrics: dict = {}
    picks = sample_prompts([p.chosen for p in data.eval], s.samples) if s.samples else []
    n_eval = -(-len(data.eval) // s.batch_size)

    def held_out(step: int, phase: str | None, sebp) -> bool:
        """Evaluate on the held-out pairs; False when a stop cut it short (a `phase`'s
        evaluation checks for one after each batch)."""
        nonlocal ref_logps
        tick = phases.counter(ctx.emit, phase, n_eval, "batches", ctx.should_stop) if phase else None
        with sebp.lifted():  # the model's own forwards
            out = evaluate(model, data.eval, pad_id, device, s, tick, reference, ref_logps, at_reference=step == 0)
            if out is None:  # stopped during the evaluation
                return False
            m, ref_logps = out
            # at the start the policy is the reference: every reward is 0, so the reward
            # accuracy and margin are 0 by definition and no figure of the base
            metrics.update({(k + "_start" if step == 0 else k): v for k, v in m.items()
                            if not (step == 0 and k in AT_REFERENCE and s.loss_type not in REFERENCE_FREE)})
            ctx.emit("eval", step=step, **m)
            if picks and dist.is_main():
                emit_samples(ctx, step, *complete_samples(model, tok, picks))
        return True

    def kept() -> dict:  # what a checkpoint carries beyond the training state
        return {"reference_logps": ref_logps} if ref_logps is not None else {}

    with sebp_lib.enabled(model, eff.sebp, s.sebp_kernel) as sebp:  # the patch comes off however the loop ends
        if start_step == 0 and data.eval and s.eval_every:
            held_out(0, "initial_eval", sebp)
        progress = start_training(ctx, s.steps, start_step)
        model.train()
        step, stopped = start_step, False
        while step < s.steps:
            if ctx.should_stop():
                stopped = True
                break
            t_step = time.time()
            micro = [[data.train[i] for i in idx]
                     for idx in step_rows(len(data.train), s.batch_size, s.grad_accum, step, cfg.run.seed)]
            m = accumulate(model, micro, pad_id, device, s, sebp, reference)
            grad_norm = float(torch.nn.utils.clip_grad_norm_(
                [p for p in model.parameters() if p.requires_grad], s.max_grad_norm or float("inf")))
            check_finite(step + 1, {"loss": m["loss"], "gradient norm": grad_norm},
                         f"lower dpo.lr (now {s.lr:g}) or dpo.beta (now {s.beta:g})"
                         + ("" if s.max_grad_norm else ", or set dpo.max_grad_norm"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            metrics.update(m)
            if every(cfg.run.log_every, step) or step == s.steps:
                ctx.emit("step", **progress.fields(step), **m, lr=scheduler.get_last_lr()[0], grad_norm=grad_norm,
                         pairs_per_s=round(sum(len(x) for x in micro) / (time.time() - t_step), 2))
            if data.eval and every(s.eval_every, step) and step < s.steps:
                held_out(step, None, sebp)
            if every(cfg.run.checkpoint_every, step) and step < s.steps:
                save_checkpoint(ctx, step, model, optimizer, scheduler, **kept())
        # The final evaluation, once every step is trained. A stop asked for during the last
        # step or this evaluation ends the run here as `stopped`, as one between steps does:
        # its resume, with nothing left to train, evaluates then.
        if not stopped and data.eval and s.eval_every:
            stopped = ctx.should_stop() or not held_out(step, "final_eval", sebp)
        save_last_checkpoint(ctx, stopped, start_step, step, model, optimizer, scheduler, **kept())
    model.eval()
    phases.emit(ctx.emit, "export")
    return finish(ctx, model, tok, base_path, step, metrics, stopped, t0)


def _log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 - exp(x)) for x < 0, accurate at both ends."""
    return torch.where(x > -0.6931471805599453, torch.log(-torch.expm1(x)), torch.log1p(-torch.exp(x)))


def pair_losses(loss_type: str, beta: float, gamma: float, pc, pr, nc, nr, rc=None, rr=None):
    """Per-pair loss and the two rewards from summed log-probs of the chosen (pc) and rejected
    (pr) replies, their token counts (nc, nr) and the reference's sums (rc, rr; unused by the
    reference-free losses). ORPO's NLL term is added by the caller (a mean over tokens)."""
    if loss_type in ("sigmoid", "ipo"):
        dc, dr = pc - rc, pr - rr
        if loss_type == "sigmoid":
            loss = -F.logsigmoid(beta * (dc - dr))
        else:
            loss = (dc / nc.clamp(min=1) - dr / nr.clamp(min=1) - 1 / (2 * beta)) ** 2
        return loss, beta * dc.detach(), beta * dr.detach()
    ac, ar = pc / nc.clamp(min=1), pr / nr.clamp(min=1)
    if loss_type == "simpo":
        loss = -F.logsigmoid(beta * (ac - ar) - gamma)
    elif loss_type == "orpo":
        loss = -beta * F.logsigmoid((ac - ar) - (_log1mexp(ac) - _log1mexp(ar)))
    else:
        raise ValueError(loss_type)
    return loss, beta * ac.detach(), beta * ar.detach()


class Reference:
    """The reference policy: the base with the adapter off, or the adapter the run started
    from (its weights kept here, swapped in for the forward and the trained ones back after)."""

    def __init__(self, model, starting_adapter: bool):
        self.model = model
        self.params = [p for p in model.parameters() if p.requires_grad] if starting_adapter else []
        self.start = [p.detach().clone() for p in self.params]

    @contextlib.contextmanager
    def policy(self):
        if not self.params:
            with self.model.disable_adapter():
                yield
            return
        trained = [p.detach().clone() for p in self.params]
        try:
            with torch.no_grad():
                for p, w in zip(self.params, self.start):
                    p.copy_(w)
            yield
        finally:
            with torch.no_grad():
                for p, w in zip(self.params, trained):
                    p.copy_(w)


def forward_pairs(model, pairs, pad_id: int, device: str, s, sebp=None, reference: Reference | None = None,
                  ref: torch.Tensor | None = None, is_reference: bool = False) -> dict:
    """Log-probs of a micro-batch's chosen and rejected rows, in one forward (and, for the
    losses that have one, the reference policy's under no_grad, unless `ref` gives them or
    the policy `is_reference`, as at the start of a run, when its own forward gives them)."""
    rows = [p.chosen for p in pairs] + [p.rejected for p in pairs]
    batch = {k: v.to(device) for k, v in data_lib.collate(rows, pad_id).items()}
    if sebp is not None and torch.is_grad_enabled():
        sebp.set_active_rows(batch["attention_mask"].bool())
    if ref is None and not is_reference and s.loss_type not in REFERENCE_FREE:  # first: swapping weights after the policy's forward would spoil its backward
        with torch.no_grad(), (reference or Reference(model, False)).policy(), model_lib.autocast(model):
            ref = labelled_logprobs(model, batch)[0]
    with model_lib.autocast(model):
        logps, counts = labelled_logprobs(model, batch)
    b = len(pairs)
    if ref is None and is_reference:
        ref = logps.detach()
    out = {"pc": logps[:b], "pr": logps[b:], "nc": counts[:b], "nr": counts[b:]}
    if ref is not None and s.loss_type not in REFERENCE_FREE:
        ref = ref.to(logps.device)
        out.update(rc=ref[:b], rr=ref[b:])
    return out


def accumulate(model, micro: list[list], pad_id: int, device: str, s, sebp=None, reference=None) -> dict:
    """Backward of one optimizer step's micro-batches; the gradient is that of the step's
    mean pair loss (plus, for ORPO, the NLL of all chosen tokens of the step), whatever the
    split into micro-batches and ranks. Returns the step's metrics."""
    n_pairs = int(dist.all_reduce_sum(sum(len(m) for m in micro)))
    n_chosen = int(dist.all_reduce_sum(sum(sum(1 for y in p.chosen.labels[1:] if y != data_lib.IGNORE)
                                           for m in micro for p in m)))
    sums = {"loss": 0.0, "margin": 0.0, "accuracy": 0.0, "logps_chosen": 0.0, "logps_rejected": 0.0}
    for pairs in micro:
        f = forward_pairs(model, pairs, pad_id, device, s, sebp, reference)
        loss, cr, rr = pair_losses(s.loss_type, s.beta, s.simpo_gamma, f["pc"], f["pr"], f["nc"], f["nr"],
                                   f.get("rc"), f.get("rr"))
        total = loss.sum() / max(n_pairs, 1)
        if s.loss_type == "orpo":
            total = total - f["pc"].sum() / max(n_chosen, 1)
        total.backward()
        sums["loss"] += float(total.detach())
        sums["margin"] += float((cr - rr).sum())
        sums["accuracy"] += float((cr > rr).float().sum())
        sums["logps_chosen"] += float(f["pc"].detach().sum())
        sums["logps_rejected"] += float(f["pr"].detach().sum())
    dist.all_reduce_grads(model.parameters())
    out = {k: dist.all_reduce_sum(v) for k, v in sums.items()}
    return {"loss": out["loss"], **{k: out[k] / max(n_pairs, 1) for k in sums if k != "loss"}}


# The held-out figures that are 0 by definition while the policy is the reference (at the
# start of a run of a loss with a reference): every reward is 0 there.
AT_REFERENCE = ("eval_accuracy", "eval_margin")


@torch.no_grad()
def evaluate(model, pairs, pad_id: int, device: str, s, tick=None, reference=None, ref_logps=None,
             at_reference: bool = False) -> tuple[dict, list | None] | None:
    """Held-out figures, means over the pairs (docs/methods.md names them): the loss; the
    reward accuracy (the share of pairs whose chosen reply's reward is above the rejected
    one's; ties, as at the start where every reward is 0, do not count); the reward margin;
    and the share of pairs whose chosen reply the model itself finds likelier (a higher
    summed log-probability; the base's own preference at the start).

    `ref_logps`: the reference's log-probs of each batch's rows, as a previous call returned
    them (None: computed here); `at_reference`: the policy is the reference (the start of a
    run), so one forward gives both. Returns (figures, the reference's log-probs), or None
    when `tick(batches_done)` asks to stop."""
    was_training = model.training
    model.eval()
    sums = {"eval_loss": 0.0, "eval_accuracy": 0.0, "eval_margin": 0.0, "eval_prefers_chosen": 0.0}
    chosen_tokens = 0
    with_reference = s.loss_type not in REFERENCE_FREE
    refs = []
    for b, i in enumerate(range(0, len(pairs), s.batch_size)):
        part = pairs[i : i + s.batch_size]
        given = ref_logps[b] if ref_logps is not None and b < len(ref_logps) else None
        f = forward_pairs(model, part, pad_id, device, s, reference=reference, ref=given, is_reference=at_reference)
        if with_reference:
            refs.append(torch.cat([f["rc"], f["rr"]]).float().cpu())
        loss, cr, rr = pair_losses(s.loss_type, s.beta, s.simpo_gamma, f["pc"], f["pr"], f["nc"], f["nr"],
                                   f.get("rc"), f.get("rr"))
        sums["eval_loss"] += float(loss.sum())
        if s.loss_type == "orpo":
            sums.setdefault("nll", 0.0)
            sums["nll"] += float(-f["pc"].sum())
            chosen_tokens += int(f["nc"].sum())
        sums["eval_accuracy"] += float((cr > rr).float().sum())
        sums["eval_prefers_chosen"] += float((f["pc"] > f["pr"]).float().sum())
        sums["eval_margin"] += float((cr - rr).sum())
        if tick is not None and tick(b + 1):
            model.train(was_training)
            return None
    model.train(was_training)
    n = max(len(pairs), 1)
    out = {k: v / n for k, v in sums.items() if k != "nll"}
    if "nll" in sums:
        out["eval_loss"] += sums["nll"] / max(chosen_tokens, 1)
    return out, refs if with_reference else None
