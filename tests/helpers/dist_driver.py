"""One SFT backward and one F-GRPO update on fixed inputs, in one process or as each
rank of a torchrun job: `python dist_driver.py OUT MODEL_DIR` writes OUT/world-<N>.pt
(rank 0) with the SFT loss, label count and LoRA gradients, and the LoRA weights and
metrics after the F-GRPO update. tests/test_distributed.py compares the files."""

import sys

import torch


def inputs(tok_pad: int):
    g = torch.Generator().manual_seed(1)
    from edgetune.engine import data as data_lib

    rows = []
    for length in (4, 60, 7, 41, 5, 90, 12, 3):
        ids = torch.randint(3, 1000, (length,), generator=g).tolist()
        rows.append(data_lib.SFTExample(ids, [-100] * (length // 3) + ids[length // 3:]))
    return rows


def rollouts(model, pad: int, P: int = 4, G: int = 4):
    """A fixed rollout batch of P prompts x G completions, left-padded prompts, completions
    of different lengths, and sampling log-probs near the model's own."""
    from edgetune.engine.generation.rollouts import RolloutBatch

    from edgetune.engine.training.lm_loss import completion_logprobs

    g = torch.Generator().manual_seed(2)
    B, Lp, Lc = P * G, 7, 9
    prompt_ids = torch.randint(3, 1000, (B, Lp), generator=g)
    prompt_mask = torch.ones(B, Lp, dtype=torch.long)
    for i in range(B):
        cut = (i // G) % 3  # the G rows of a prompt share its padding
        prompt_ids[i, :cut] = pad
        prompt_mask[i, :cut] = 0
    completion_ids = torch.randint(3, 1000, (B, Lc), generator=g)
    completion_mask = torch.ones(B, Lc, dtype=torch.long)
    for i in range(B):
        n = 2 + (i * 5) % (Lc - 1)
        completion_ids[i, n:] = pad
        completion_mask[i, n:] = 0
    with torch.no_grad():
        logp = completion_logprobs(model, prompt_ids, prompt_mask, completion_ids, completion_mask)
    logp = (logp + 0.05 * torch.randn(logp.shape, generator=g)) * completion_mask
    adv = torch.randn(B, generator=g)
    adv[G:2 * G] = 0  # one group all right or all wrong: dropped from the backward
    roll = RolloutBatch(prompt_ids, prompt_mask, completion_ids, completion_mask, logp, [""] * B,
                        [i // G for i in range(B)], [False] * B)
    return roll, adv, G


def whole(t):
    """A tensor, or a sharded DTensor gathered whole (every rank calls it)."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t.detach().clone()


def main(out: str, model_dir: str, shard: str = "none") -> None:
    """`shard` fsdp: the base sharded across the ranks (engine/models/fsdp.py); gradients and
    weights are gathered whole before they are written."""
    from edgetune.engine.core import distributed as dist
    from edgetune.engine.core.settings import FGRPOSettings, resolve

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import make_optimizer, make_scheduler, seed_everything

    from edgetune.engine.methods.fgrpo.fgrpo import policy_update
    from edgetune.engine.methods.sft.sft import accumulate

    from edgetune.engine import data as data_lib

    dist.init()
    seed_everything(0)
    cfg = resolve(overrides={"model": {"name": model_dir, "quant": "nf4", "gradient_checkpointing": False},
                             "lora": {"r": 8, "alpha": 16}})
    model, tok, _ = model_lib.load(cfg)
    torch.manual_seed(0)
    with torch.no_grad():  # B away from zero, so every factor has a gradient
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.05)
    if shard == "fsdp" and dist.enabled():
        from edgetune.engine.models import fsdp

        fsdp.shard(model)
    params = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
    result = {"world": dist.world()}

    # SFT: this rank's share of the 8 rows, in micro-batches of 3.
    rows = inputs(tok.pad_token_id)
    mine = [rows[i] for i in dist.shard(len(rows))]
    batches = [data_lib.collate(mine[i:i + 3], tok.pad_token_id) for i in range(0, len(mine), 3)]
    model.train()
    loss, n = accumulate(model, batches)
    result["sft"] = {"loss": loss, "labels": n, "grads": {k: whole(p.grad) for k, p in params}}
    model.zero_grad(set_to_none=True)

    # F-GRPO: this rank's prompts' groups of one fixed rollout batch, two optimizer steps.
    roll, adv, G = rollouts(model, tok.pad_token_id)
    share = dist.shard(len(adv) // G)
    rows_here = torch.arange(share.start * G, share.stop * G)
    local = type(roll)(*(getattr(roll, f)[rows_here] if torch.is_tensor(getattr(roll, f)) else
                         [getattr(roll, f)[i] for i in rows_here.tolist()]
                         for f in ("prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "logprobs",
                                   "texts", "prompt_index", "truncated")))
    s = FGRPOSettings(micro_batch_size=3, num_iterations=2, loss_type="dapo", lr=1e-2)
    opt = make_optimizer(model.parameters(), "adamw", s.lr, 0.0, "cpu")
    sched = make_scheduler(opt, 0, 4)
    metrics = policy_update(model, local, adv[rows_here], s, opt, sched)
    result["fgrpo"] = {"metrics": metrics, "weights": {k: whole(p) for k, p in params}}
    if shard == "fsdp" and dist.enabled():  # what a sharded resume loads: whole tensors back into shards
        from edgetune.engine.models import fsdp

        saved, saved_opt = fsdp.adapter_state(model), fsdp.optimizer_state(opt)
        with torch.no_grad():
            for _, p in params:
                p.zero_()
        fsdp.load_adapter(model, {k.replace(".default", ""): v for k, v in saved.items()})
        again = make_optimizer(model.parameters(), "adamw", s.lr, 0.0, "cpu")
        fsdp.load_optimizer_state(again, saved_opt)
        result["reloaded"] = {"weights": {k: whole(p) for k, p in params},
                              "optimizer": fsdp.optimizer_state(again)["state"], "saved_optimizer": saved_opt["state"]}
    if dist.is_main():
        torch.save(result, f"{out}/world-{dist.world()}{'-fsdp' if shard == 'fsdp' else ''}.pt")
    dist.shutdown()


if __name__ == "__main__":
    main(*sys.argv[1:])
