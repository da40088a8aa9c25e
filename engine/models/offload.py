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

With `prefetch` (model.offload_prefetch) the copies back are double-buffered: the backward
of layer i, as it starts, has layer i-1's input copied back on the side stream, so that
copy runs beside layer i's recompute and backward instead of before layer i-1's; two
inputs are on the GPU at a time. Each saved input knows the one saved before it in the
same forward (the layer whose backward comes next). On the CPU the same bookkeeping runs
on the tensors themselves, or on copies of them when the stash is made with
`copies=True` (what the CPU test of the prefetch order uses).
"""

from __future__ import annotations

import torch


class _Slot:
    """One saved layer input: its host copy, the event of that copy, and once fetched back,
    the device tensor and the event of the copy back."""

    __slots__ = ("host", "done", "device", "fetched", "ready", "prev")

    def __init__(self, host, done, device, prev):
        self.host, self.done, self.device, self.prev = host, done, device, prev
        self.fetched = self.ready = None


class HostStash:
    """Asynchronous device -> pinned host copies, and the way back (double-buffered with
    `prefetch`). `copies`: keep CPU tensors as copies (default: as they are)."""

    def __init__(self, prefetch: bool = False, copies: bool = False):
        self.stream = torch.cuda.Stream() if torch.cuda.is_available() else None
        self.prefetch, self.copies = prefetch, copies
        self.last = None  # the slot saved last in this forward: the previous layer of the next one
        self.prefetched = 0  # inputs that were already back when their backward started

    def save(self, t: torch.Tensor) -> _Slot:
        prev = self.last if self.prefetch else None
        if t.device.type != "cuda":
            slot = _Slot(t.clone() if self.copies else t, None, None, prev)
        else:
            host = torch.empty(t.shape, dtype=t.dtype, layout=t.layout, pin_memory=True)
            self.stream.wait_stream(torch.cuda.current_stream(t.device))
            with torch.cuda.stream(self.stream):
                host.copy_(t, non_blocking=True)
            t.record_stream(self.stream)  # the allocator reuses t's memory only after the copy
            done = torch.cuda.Event()
            done.record(self.stream)
            slot = _Slot(host, done, t.device, prev)
        if self.prefetch:
            self.last = slot
        return slot

    def _fetch(self, slot: _Slot) -> None:
        """Start copying `slot` back (on the side stream for a CUDA tensor)."""
        if slot.fetched is not None:
            return
        if slot.done is None:
            slot.fetched = slot.host.clone() if self.copies else slot.host
            return
        with torch.cuda.stream(self.stream):
            self.stream.wait_event(slot.done)
            slot.fetched = slot.host.to(slot.device, non_blocking=True)
            slot.ready = torch.cuda.Event()
            slot.ready.record(self.stream)

    def load(self, slot: _Slot) -> torch.Tensor:
        """The saved input on its device again; with prefetch, the previous layer's input
        starts coming back too."""
        self.last = None  # a backward has begun: the next forward starts a new chain
        if slot.fetched is not None:
            self.prefetched += 1
        elif slot.done is None:
            slot.fetched = slot.host.clone() if self.copies else slot.host
        elif self.prefetch:
            self._fetch(slot)
        else:  # the copy back on the compute stream, after the copy out
            torch.cuda.current_stream(slot.device).wait_event(slot.done)
            slot.fetched = slot.host.to(slot.device, non_blocking=True)
        t = slot.fetched
        if slot.ready is not None:  # copied back on the side stream: used and freed on this one
            stream = torch.cuda.current_stream(slot.device)
            stream.wait_event(slot.ready)
            t.record_stream(stream)
        if slot.prev is not None:
            self._fetch(slot.prev)  # the next layer of the backward, beside this one's recompute
        slot.host = slot.fetched = slot.prev = None
        return t


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
        hidden = ctx.stash.load(ctx.slot).detach().requires_grad_(True)
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


def enable(model, prefetch: bool = False, stash: HostStash | None = None) -> int:
    """Route every checkpointed decoder layer of `model` (PEFT or plain HF) through the
    offloading checkpoint (`prefetch`: double-buffered copies back, model.offload_prefetch).
    Gradient checkpointing must be on. Returns the layer count."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = offloaded_checkpoint(stash or HostStash(prefetch))
    n = 0
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and m.gradient_checkpointing:
            m._gradient_checkpointing_func = fn
            n += 1
    if n == 0:
        raise RuntimeError("model.offload_activations needs model.gradient_checkpointing: true")
    return n
