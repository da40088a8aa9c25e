"""SFT: supervised fine-tuning of a LoRA adapter on a 4-bit base. One loop, top to bottom.

Why our own loop and not TRL's SFTTrainer: a run must resume with bit-identical losses,
stream our events, stop gracefully between steps, and switch SEBP on per step; the loop
is 100 lines, which is less than the glue those would take around a Trainer.

Memory/speed trade-offs, each a setting:
- `model.quant: nf4` stores the base in 4 bits (~0.55 byte/param with double quant);
  compute happens in bf16 after dequantising each layer's weight on the fly.
- `model.gradient_checkpointing`: recompute each block's activations in the backward
  (about a third more compute) instead of storing them.
- Precision: on CUDA the forward runs under bf16 autocast (engine/models/model.autocast): LoRA
  factors are kept and updated in fp32, their products run in bf16.
- `sft.optimizer: auto`: fused AdamW (8 bytes of fp32 state per trainable parameter; one
  kernel for all of them). `paged_adamw_8bit` keeps 2 bytes per parameter paged out
  under memory pressure, and slows every step in its per-tensor kernels.
- Loss: logits are computed only at positions with a label (engine/training/lm_loss.py), never
  the full [tokens x vocab] matrix.
- `model.liger`: Liger-Kernel's fused RMSNorm / SwiGLU / RoPE on CUDA (less activation
  memory, fewer elementwise kernels, same math).
- Long sequences: `model.offload_activations` (+ `offload_prefetch`), `model.mlp_chunk_tokens`
  and `model.mask_free_attention` (engine/models/offload.py, engine/models/long_context.py).
- `sft.packing`: rows laid end to end, no padding (engine/data/packing.py); on CUDA attention
  then runs through flex_attention with a block-diagonal mask (`model.attn_implementation`).
- `sft.sebp`: the exact sparsity-exploiting backward (kernels/sebp.py) skips the rows of
  padding tokens in every linear layer's backward (`auto` is off); `sft.sebp_kernel` picks how its
  backward reads those rows.
- `sft.fused_lora`: LoRA's scaled branch accumulated into the base GEMM's output inside the GEMM
  (kernels/lora_fused.py), forward and backward; `auto` is on with CUDA.

Determinism: the order of examples is a pure function of (seed, micro-batch index), and
checkpoints hold optimizer, scheduler and RNG state, so a resumed run continues with the
same losses as one that never stopped.
"""

from __future__ import annotations

import sys
import time

import torch

from edgetune.kernels import lora_fused
from edgetune.kernels import sebp as sebp_lib

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import phases
from edgetune.engine.core.arch import arch_of

from edgetune.engine.planning.effective import decide, liger_off_reason, record

from edgetune.engine.data.packing import collate_packed

from edgetune.engine.models import fsdp, long_context
from edgetune.engine.models import model as model_lib
from edgetune.engine.models.liger import apply as apply_liger

from edgetune.engine.generation.samples import complete_samples, sample_prompts

from edgetune.engine.training import stats
from edgetune.engine.training.lm_loss import causal_lm_loss, label_count, labelled_logprobs
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


def train(ctx: RunContext) -> dict:
    cfg, s = ctx.cfg, getattr(ctx.cfg, ctx.cfg.method)  # its settings group (named like its record)
    seed_everything(cfg.run.seed)
    t0 = time.time()

    # Validate the data (needs only the tokenizer) before spending time on the model.
    phases.emit(ctx.emit, "data_check")
    tok = model_lib.load_tokenizer(model_lib.check_model(cfg.model))
    data = data_lib.load_sft(cfg.data, tok, cfg.run.seed, phases.data_progress(ctx.emit))
    ctx.emit("data", report=data.report.__dict__)
    if not data.train:
        from edgetune.engine.core.errors import DataError

        raise DataError("no training rows left after validation", file=cfg.data.path)
    phases.emit(ctx.emit, "loading")
    model, tok, base_path = model_lib.load(cfg)
    device = model_lib.resolve_device(cfg.model)
    eff = decide(cfg, device, arch_of(model), checkpointed=model_lib.checkpointed_layers(model))
    record(ctx.run, cfg, eff)
    liger = apply_liger(model, "on") if eff.liger else \
        f"off ({liger_off_reason(cfg.model.liger, device, cfg.method, arch_of(model))})"
    print(f"liger: {liger}", file=sys.stderr, flush=True)  # -> worker.log
    base = model.get_base_model()
    if base.config._attn_implementation != eff.attn_implementation:
        # packed rows on CUDA: flex_attention (its first step compiles the kernel)
        base.set_attn_implementation(eff.attn_implementation)
    if cfg.model.offload_activations:
        from edgetune.engine.models.offload import enable as offload_activations

        # checkpointed layer inputs wait in pinned host memory (copied back ahead with offload_prefetch)
        offload_activations(model, prefetch=cfg.model.offload_prefetch)
    if cfg.model.mlp_chunk_tokens:
        long_context.chunk_mlp(model, cfg.model.mlp_chunk_tokens)  # the MLP along the sequence in chunks

    dist.broadcast_params(model.parameters())  # the ranks start from rank 0's adapter
    if cfg.model.shard == "fsdp" and dist.enabled():
        fsdp.shard(model)  # each rank keeps 1/N of the base and of the adapter
    optimizer = make_optimizer(model.parameters(), eff.optimizer, s.lr, s.weight_decay, device)
    scheduler = make_scheduler(optimizer, s.warmup_steps, ctx.schedule_steps or s.steps)
    start_step = 0
    # Each held-out demonstration's loss with the adapter off (the before-training figures):
    # measured once a run, by the initial evaluation when the adapter starts at zero (the
    # model at step 0 is the base), kept in the checkpoints for a resumed run's comparison.
    base_losses = None
    if ctx.resume is not None:
        state = load_checkpoint(ctx.resume, model, optimizer, scheduler)
        start_step, base_losses = state["step"], state.get("base_losses")

    pad_id = tok.pad_token_id
    collate = collate_packed if s.packing else data_lib.collate  # packed: one row, no padding
    metrics: dict = {}
    n_eval = eval_batches(len(data.eval), s.batch_size, s.eval_batches)
    compared = data.eval[: n_eval * s.batch_size]  # the held-out demonstrations each evaluation scores
    fresh = not cfg.lora.init_from  # the adapter starts at zero: the model at step 0 is the base
    picks = sample_prompts(data.eval, s.samples) if s.samples else []

    def held_out(phase: str) -> tuple[list[float], list[int]] | None:
        tick = phases.counter(ctx.emit, phase, n_eval, "batches", ctx.should_stop)
        return example_losses(model, compared, pad_id, s.batch_size, device, tick)

    def kept() -> dict:  # what a checkpoint carries beyond the training state
        return {"base_losses": base_losses} if base_losses is not None else {}

    def show_samples(step: int, sebp) -> None:
        if picks and dist.is_main():  # one process writes the events
            with sebp.lifted(), fused.lifted():  # generation: the model's own forwards (SEBP's patch on top first)
                emit_samples(ctx, step, *complete_samples(model, tok, picks))

    def eval_loss(step: int, loss: float, sebp) -> None:  # an evaluation during or after training
        metrics["eval_loss"] = loss
        ctx.emit("eval", step=step, eval_loss=loss)
        show_samples(step, sebp)

    # the patches come off however the loop ends; SEBP's wraps the fused forwards
    with lora_fused.enabled(model, eff.fused_lora) as fused, sebp_lib.enabled(model, eff.sebp, s.sebp_kernel) as sebp:
        if start_step == 0 and data.eval and s.eval_every:
            scored = held_out("initial_eval")
            if scored is not None:  # None: stopped during the evaluation
                loss0 = mean_loss(*scored)
                base_losses = scored[0] if fresh else None
                metrics["eval_loss_start"] = loss0
                ctx.emit("eval", step=0, eval_loss=loss0)
                show_samples(0, sebp)

        progress = start_training(ctx, s.steps, start_step)
        model.train()
        step, stopped, end_losses = start_step, False, None
        while step < s.steps:
            if ctx.should_stop():
                stopped = True
                break
            t_step = time.time()
            batches = []
            for idx in step_rows(len(data.train), s.batch_size, s.grad_accum, step, cfg.run.seed):
                rows = [data.train[i] for i in idx]
                batches.append({key: v.to(device) for key, v in collate(rows, pad_id).items()})
            with long_context.mask_free_attention(model, cfg.model.mask_free_attention):  # the step only
                step_loss, _ = accumulate(model, batches, sebp)
            tokens = int(dist.all_reduce_sum(sum(int(b["attention_mask"].sum()) for b in batches)))
            grad_norm = fsdp.clip_grad_norm(
                [p for p in model.parameters() if p.requires_grad], s.max_grad_norm or float("inf"))
            check_finite(step + 1, {"loss": step_loss, "gradient norm": grad_norm},
                         f"lower sft.lr (now {s.lr:g}) or lora.alpha (now {cfg.lora.alpha:g})"
                         + ("" if s.max_grad_norm else ", or set sft.max_grad_norm"))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            metrics["loss"] = step_loss
            if every(cfg.run.log_every, step) or step == s.steps:
                ctx.emit("step", **progress.fields(step), loss=metrics["loss"], lr=scheduler.get_last_lr()[0],
                         grad_norm=grad_norm, tokens_per_s=round(tokens / (time.time() - t_step), 1))
            if data.eval and every(s.eval_every, step) and step < s.steps:
                eval_loss(step, evaluate(model, data.eval, pad_id, s.batch_size, device, s.eval_batches), sebp)
            if every(cfg.run.checkpoint_every, step) and step < s.steps:
                save_checkpoint(ctx, step, model, optimizer, scheduler, **kept())
        # the final evaluation, once every step is trained: a stop in the last step or in it ends
        # the run `stopped`, as one between steps does (its resume evaluates then)
        if not stopped and data.eval and s.eval_every:
            scored = None if ctx.should_stop() else held_out("final_eval")
            stopped = scored is None
            if not stopped:
                end_losses = scored[0]
                eval_loss(step, mean_loss(*scored), sebp)
        save_last_checkpoint(ctx, stopped, start_step, step, model, optimizer, scheduler, **kept())
    if end_losses is not None and not stopped:  # did it help: the adapter against the base, demonstration by demonstration
        before_after(ctx, model, compared, pad_id, s.batch_size, device, step, end_losses, base_losses)
    model.eval()
    phases.emit(ctx.emit, "export")
    return finish(ctx, model, tok, base_path, step, metrics, stopped, t0)


def before_after(ctx, model, examples, pad_id: int, batch_size: int, device: str, step: int, end: list[float],
                 start: list[float] | None) -> None:
    """The held-out demonstrations' loss with the adapter (`end`, the final evaluation's) and
    with it switched off (`start`, the initial evaluation's; measured here when the run
    has none), compared pair by pair (paired bootstrap, lower is better): a `comparison` event."""
    if start is None:
        tick = phases.counter(ctx.emit, "base_eval", -(-len(examples) // batch_size), "batches", ctx.should_stop)
        with model.disable_adapter():
            scored = example_losses(model, examples, pad_id, batch_size, device, tick)
        start = None if scored is None else scored[0]
    if start is not None:
        ctx.emit("comparison", step=step, **stats.compare_losses(start, end, stats.BASE, stats.ADAPTER, "loss",
                                                                 "demonstrations"))


def accumulate(model, batches: list[dict], sebp=None) -> tuple[float, int]:
    """Backward of one optimizer step's micro-batches: every label token of the step weighs
    the same, so the gradient is that of the mean loss over the step's label tokens whatever
    the split (batch_size 8 equals 4 x grad_accum 2 even when the micro-batches hold very
    different numbers of tokens; dividing each micro-batch's mean by grad_accum would
    over-weigh the tokens of a short one). Returns (that mean loss, label tokens).
    `sebp`: the handle of kernels/sebp.enabled (or None).

    On several ranks `batches` are this rank's share of the step: the label tokens are
    counted over all ranks (one all_reduce) and the gradients summed over them (one more),
    so every rank ends with the gradient of the whole step, as one process would.

    A sharded base (engine/models/fsdp.py) reduce-scatters the gradients in each backward, and
    every forward and backward is a collective: a rank with fewer micro-batches than
    another runs zero-weight ones, so the ranks stay in step."""
    total = int(dist.all_reduce_sum(sum(label_count(b["labels"]) for b in batches)))
    sharded = fsdp.is_sharded(model)
    padded = [(b, 1.0) for b in batches]
    if sharded:
        most = int(dist.all_reduce_max(len(batches)))
        padded += [(batches[-1] if batches else _filler(model), 0.0)] * (most - len(batches))
    loss_sum = 0.0
    for batch, weight in padded:
        if sebp is not None:
            sebp.set_active_rows(batch["attention_mask"].bool())
        with model_lib.autocast(model):
            loss, n = causal_lm_loss(model, batch)
        (loss * (weight * n / max(total, 1))).backward()
        loss_sum += weight * loss.item() * n
    if not sharded:
        dist.all_reduce_grads(model.parameters())
    return dist.all_reduce_sum(loss_sum) / max(total, 1), total


def _filler(model) -> dict:
    """A one-label batch for a rank with no rows in a step (a sharded base's ranks must all
    run the forward and backward); its loss is weighed zero."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 2, dtype=torch.long, device=device)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.new_tensor([[-100, 0]])}


def eval_batches(n_examples: int, batch_size: int, max_batches: int = 0) -> int:
    n = -(-n_examples // batch_size)
    return min(n, max_batches) if max_batches else n


@torch.no_grad()
def example_losses(model, examples, pad_id: int, batch_size: int, device: str,
                   tick=None) -> tuple[list[float], list[int]] | None:
    """Each example's mean token loss (its labelled tokens) and its number of labelled
    tokens; `tick(batches_done)` after each batch, and None when it returns True."""
    was_training = model.training
    model.eval()
    out: tuple[list[float], list[int]] | None = ([], [])
    for b, s in enumerate(range(0, len(examples), batch_size)):
        batch = {k: v.to(device) for k, v in data_lib.collate(examples[s : s + batch_size], pad_id).items()}
        with model_lib.autocast(model):
            sums, counts = labelled_logprobs(model, batch)
        out[0].extend((-sums.float() / counts.clamp(min=1)).tolist())
        out[1].extend(counts.tolist())
        if tick is not None and tick(b + 1):
            out = None
            break
    model.train(was_training)
    return out


def mean_loss(losses: list[float], tokens: list[int]) -> float:
    """The token-weighted mean of example_losses' result: the loss over all their labelled
    tokens, as `evaluate` computes it."""
    return sum(x * n for x, n in zip(losses, tokens)) / max(sum(tokens), 1)


@torch.no_grad()
def evaluate(model, examples, pad_id: int, batch_size: int, device: str, max_batches: int = 0,
             tick=None) -> float | None:
    """Token-weighted mean loss over the held-out examples; `tick(batches_done)` after each
    batch, and None when it returns True (a stop was asked for between batches)."""
    was_training = model.training
    model.eval()
    total, count = 0.0, 0
    for b, s in enumerate(range(0, len(examples), batch_size)):
        if max_batches and b >= max_batches:
            break
        batch = {k: v.to(device) for k, v in data_lib.collate(examples[s : s + batch_size], pad_id).items()}
        with model_lib.autocast(model):
            loss, n = causal_lm_loss(model, batch)
        total += loss.item() * n
        count += n
        if tick is not None and tick(b + 1):
            model.train(was_training)
            return None
    model.train(was_training)
    return total / max(count, 1)
