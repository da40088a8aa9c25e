"""Activation offload: keep the checkpointed layer inputs in pinned host memory.

With gradient checkpointing a decoder keeps one [tokens, hidden] tensor per layer until
the backward: 80 x 32,768 x 8,192 x 2 bytes = 43 GB for a 72B model on one 32k-token
sequence, more than the 4-bit weights leave of an 80 GB card. `enable(model)` swaps each
layer's checkpoint function for one that

- copies the layer's input to pinned host memory on a side CUDA stream (overlapping the
  copy with the next layers' forward; the GPU copy is freed as soon as that copy is done),
- runs the layer without building a graph,
- in the backward, copies the input back (host -> device: short next to the recompute
  and backward of the same layer), recomputes the layer
  with gradients and back-propagates through it (the reentrant checkpoint scheme).

Costs: host RAM = the sum of the layer inputs (pinned, reused by PyTorch's host caching
allocator across steps), one extra host->device copy per layer per step; GPU memory for
activations drops from L layer inputs to about two. RNG state (dropout) and autocast
state are replayed in the recompute, so gradients equal those of plain checkpointing.

The decoder's input must require grad (engine/models/model.add_lora enables input grads when
checkpointing), or no gradient would reach the LoRA weights inside the layer.
On the CPU there is no separate host memory: the input is kept as is (plain reentrant
checkpointing), which is what the CPU tests exercise.
"""

from __future__ import annotations

import torch


class HostStash:
    """Asynchronous device -> pinned host copies, and the way back."""

    def __init__(self):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None

    def save(self, t: torch.Tensor):
        if t.device.type != "cuda":
            return (t, None, None)
        host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
        self.stream.wait_stream(torch.cuda.current_stream(t.device))
        with torch.cuda.stream(self.stream):
            host.copy_(t, non_blocking=True)
        t.record_stream(self.stream)  # the allocator reuses t's memory only after the copy
        done = torch.cuda.Event()
        done.record(self.stream)
        return (host, done, t.device)

    @staticmethod
    def load(slot) -> torch.Tensor:
        t, done, device = slot
        if done is None:
            return t
        torch.cuda.current_stream(device).wait_event(done)
        return t.to(device, non_blocking=True)


class _OffloadedCheckpoint(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run, stash, hidden, *rest):
        ctx.run, ctx.stash, ctx.rest = run, stash, rest
        ctx.slot = stash.save(hidden.detach())
        ctx.device = hidden.device
        ctx.cpu_rng = torch.get_rng_state()
        ctx.cuda_rng = torch.cuda.get_rng_state(hidden.device) if hidden.is_cuda else None
        ctx.autocast = (torch.is_autocast_enabled(hidden.device.type),
                        torch.get_autocast_dtype(hidden.device.type))
        with torch.no_grad():
            out = run(hidden, *rest)
        ctx.tuple_out = isinstance(out, tuple)
        return out

    @staticmethod
    def backward(ctx, *grads):
        hidden = HostStash.load(ctx.slot).detach().requires_grad_(True)
        devices = [ctx.device] if ctx.cuda_rng is not None else []
        with torch.random.fork_rng(devices=devices):
            torch.set_rng_state(ctx.cpu_rng)
            if devices:
                torch.cuda.set_rng_state(ctx.cuda_rng, ctx.device)
            enabled, dtype = ctx.autocast
            with torch.enable_grad(), torch.autocast(ctx.device.type, dtype=dtype, enabled=enabled):
                out = ctx.run(hidden, *ctx.rest)
        outs = out if ctx.tuple_out else (out,)
        pairs = [(o, g) for o, g in zip(outs, grads)
                 if torch.is_tensor(o) and o.requires_grad and g is not None]
        torch.autograd.backward([o for o, _ in pairs], [g for _, g in pairs])
        ctx.slot = None
        return (None, None, hidden.grad) + (None,) * len(ctx.rest)


def offloaded_checkpoint(stash: HostStash):
    """A drop-in for transformers' `_gradient_checkpointing_func(fn, *args)`."""

    def checkpoint_fn(fn, hidden, *rest):
        if not hidden.requires_grad:
            raise RuntimeError("activation offload needs the decoder input to require grad "
                               "(model.enable_input_require_grads())")
        return _OffloadedCheckpoint.apply(fn, stash, hidden, *rest)

    return checkpoint_fn


def enable(model) -> int:
    """Route every checkpointed decoder layer of `model` (PEFT or plain HF) through the
    offloading checkpoint. Gradient checkpointing must be on. Returns the layer count."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = offloaded_checkpoint(HostStash())
    n = 0
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m._gradient_checkpointing_func = fn
            n += 1
    if n == 0:
        raise RuntimeError("model.offload_activations needs model.gradient_checkpointing: true")
    return n
