"""`model.shard: fsdp`: the 4-bit base sharded across the ranks (FSDP-QLoRA with FSDP2).

Each decoder layer is one `torch.distributed.fsdp.fully_shard` unit: a rank keeps 1/N of
its NF4 weights (bitsandbytes stores them packed in one dtype, `bnb_4bit_quant_storage`,
so FSDP can cut them like any tensor) and of its LoRA factors. A layer's forward
all-gathers its weights, runs, and frees them again (the backward gathers them once more);
the LoRA gradients are reduce-scattered, so each rank updates only its shard of the
adapter with its shard of the optimizer state. The decoder stack is the root unit (the
final norm); the embeddings and the head stay whole on every rank: the sparse loss
(engine/training/lm_loss.py) calls the head outside the model's forward, and a tied head shares
the embedding's weight.

Checkpoints and the final adapter are written whole (every rank gathers the adapter and
the optimizer state, rank 0 writes them), in the same format as a one-process run, so a
run resumes on any number of ranks, sharded or not.

Ranks must run the same forwards and backwards (each one all-gathers): SFT's `accumulate`
and F-GRPO's `policy_update` pad a rank with fewer micro-batches with zero-weight ones,
and rollouts decode with the plain loop until every rank's rows are done
(engine/generation/decoding.decode_plain, lockstep). ESSA is refused (its record's `fsdp` in engine/core/methods.py).
"""

from __future__ import annotations

import torch


def is_sharded(model) -> bool:
    from torch.distributed.fsdp import FSDPModule

    return any(isinstance(m, FSDPModule) for m in model.modules())


def shard(model):
    """Shard the decoder layers of a loaded PEFT model across the process group's ranks,
    then the decoder stack (the root). Returns the model (changed in place)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from transformers.modeling_layers import GradientCheckpointingLayer

    from edgetune.engine.core import distributed as dist

    device = "cuda" if torch.cuda.is_available() else "cpu"
    mesh = init_device_mesh(device, (dist.world(),))
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    decoder = base.get_decoder() if hasattr(base, "get_decoder") else base.model
    head = base.get_output_embeddings()
    for layer in [m for m in decoder.modules() if isinstance(m, GradientCheckpointingLayer)]:
        fully_shard(layer, mesh=mesh)
    whole = {decoder.get_input_embeddings().weight, head.weight}  # used outside the decoder's forward
    fully_shard(decoder, mesh=mesh, ignored_params=whole)
    for m in model.modules():
        if isinstance(m, FSDPModule):
            # sum, not mean: the loss is already scaled by the step's label tokens over all
            # ranks (engine/methods/sft/sft.accumulate), as the data-parallel all_reduce sums
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def _full(t):
    """A DTensor's whole value on every rank (a collective), on the CPU; other values as they are."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        return t.detach().full_tensor().cpu()
    return t.detach().cpu() if torch.is_tensor(t) else t


def adapter_state(model) -> dict | None:
    """{parameter name: whole tensor} of the trainable parameters on every rank (a
    collective: every rank calls it), for `save_pretrained(state_dict=...)`; None when the
    model is not sharded (PEFT reads its own weights)."""
    if not is_sharded(model):
        return None
    return {n: _full(p) for n, p in model.named_parameters() if p.requires_grad}


def optimizer_state(optimizer) -> dict:
    """optimizer.state_dict() with every sharded state tensor gathered whole (a collective),
    the format a one-process run saves."""
    sd = optimizer.state_dict()
    sd["state"] = {i: {k: _full(v) for k, v in s.items()} for i, s in sorted(sd["state"].items())}
    return sd


def load_adapter(model, weights: dict, adapter: str = "default") -> None:
    """Load a saved adapter's whole tensors (PEFT names, without the adapter name) into
    the sharded parameters: each rank keeps its shard."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    from edgetune.engine.core.errors import CheckpointError

    with torch.no_grad():
        for n, p in model.named_parameters():
            if not p.requires_grad:
                continue
            key = n.replace(f".{adapter}", "")
            if key not in weights:
                raise CheckpointError(f"adapter_model.safetensors: no tensor {key}")
            full = weights[key].detach().to(p.dtype)
            p.copy_(distribute_tensor(full.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) else full.to(p.device))


def load_optimizer_state(optimizer, sd: dict) -> None:
    """Load a whole optimizer state (as optimizer_state or a one-process run saved it)
    into an optimizer over sharded parameters."""
    from torch.distributed.tensor import DTensor, distribute_tensor

    params = [p for g in optimizer.param_groups for p in g["params"]]
    state = {}
    for i, s in sd["state"].items():
        p = params[int(i)]
        state[i] = {k: distribute_tensor(v.to(p.device), p.device_mesh, p.placements)
                    if isinstance(p, DTensor) and torch.is_tensor(v) and v.shape == p.shape else v
                    for k, v in s.items()}
    optimizer.load_state_dict({**sd, "state": state})


def clip_grad_norm(params, max_norm: float) -> float:
    """torch's clip_grad_norm_ over (possibly sharded) gradients; the whole norm as a float."""
    from torch.distributed.tensor import DTensor

    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    return float(norm.full_tensor() if isinstance(norm, DTensor) else norm)
