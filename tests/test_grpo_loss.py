"""Our GRPO-family losses against TRL's own code (trl 1.16, `GRPOTrainer._compute_loss`).

TRL's loss is a method of the trainer; building a real trainer needs a model, a dataset
and an accelerator. `_compute_loss` only reads a few attributes, so the test calls the
unbound method on a stand-in `self` (a SimpleNamespace) whose
`_get_per_token_logps_and_entropies` returns our fixed random log-probs, and compares
the loss and its gradient with respect to those log-probs. TRL's advantage code sits
inline in `_generate_and_score_completions`; the test reproduces those few lines with
TRL's own `nanstd`.
"""

from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch

from edgetune.engine.methods.fgrpo.loss import focal_weights, group_advantages, policy_loss, success_share

trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")
from trl.trainer.utils import nanstd  # noqa: E402


def trl_advantages(rewards, G, scale):
    """The lines of TRL's `_generate_and_score_completions` that turn rewards into advantages."""
    mean = torch.nanmean(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    if scale in ("group", "none"):
        std = nanstd(rewards.view(-1, G), dim=1).repeat_interleave(G, dim=0)
    else:
        std = nanstd(rewards).expand_as(rewards)
    adv = rewards - mean
    if scale != "none":
        adv = adv / (std + 1e-4)
    return adv


class _Accel:
    num_processes = 1

    @staticmethod
    def reduce(x, reduction="sum"):
        return x

    @staticmethod
    def gather(x):
        return x

    gather_for_metrics = gather


def trl_loss(loss_type, logp, old_logp, ref_logp, adv, mask, prompt_len, beta, eps, eps_high, max_len):
    logp_for_trl = logp.detach().clone().requires_grad_(True)
    B, T = mask.shape
    stand_in = SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logp_for_trl, torch.zeros(B, T), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=beta,
        args=SimpleNamespace(use_bias_correction_kl=False, delta=None, steps_per_generation=1),
        loss_type=loss_type,
        epsilon_low=eps,
        epsilon_high=eps_high,
        use_vllm=False,
        vllm_importance_sampling_correction=False,
        model=SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        max_completion_length=max_len,
        accelerator=_Accel(),
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list), "eval": defaultdict(list)},
    )
    inputs = {
        "prompt_ids": torch.ones(B, prompt_len, dtype=torch.long),
        "prompt_mask": torch.ones(B, prompt_len, dtype=torch.long),
        "completion_ids": torch.ones(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": adv,
        "old_per_token_logps": old_logp,
        "ref_per_token_logps": ref_logp,
        "num_items_in_batch": mask.sum(),
    }
    loss = trl_grpo.GRPOTrainer._compute_loss(stand_in, None, inputs)
    loss.backward()
    return loss.detach(), logp_for_trl.grad, stand_in._metrics["train"]


def random_batch(seed, B=4, G=4, T=7):
    g = torch.Generator().manual_seed(seed)
    n = B * G
    old = -torch.rand(n, T, generator=g, dtype=torch.float64) * 3
    # Up to +-0.4 nats off the sampling policy, so both clip sides trigger.
    logp = old + (torch.rand(n, T, generator=g, dtype=torch.float64) - 0.5) * 0.8
    ref = old + (torch.rand(n, T, generator=g, dtype=torch.float64) - 0.5) * 0.6
    lengths = torch.randint(1, T + 1, (n,), generator=g)
    mask = (torch.arange(T)[None, :] < lengths[:, None]).double()
    rewards = torch.randint(0, 2, (n,), generator=g).double()
    rewards[:G] = 1.0  # one all-right group
    rewards[G : 2 * G] = 0.0  # one all-wrong group
    return logp, old, ref, mask, rewards, G


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_advantages_match_trl(scale):
    g = torch.Generator().manual_seed(1)
    rewards = torch.rand(24, generator=g, dtype=torch.float64)
    rewards[:6] = 0.5
    ours = group_advantages(rewards, 6, scale)
    ref = trl_advantages(rewards.float(), 6, scale)
    assert ours[:6].abs().max() == 0  # a uniform group has no advantage
    diff = (ours - ref).abs().max().item()
    assert diff < 1e-5


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
@pytest.mark.parametrize("gamma", [0.0, 2.0])
@pytest.mark.parametrize("beta", [0.0, 0.04])
def test_loss_matches_trl(loss_type, gamma, beta):
    logp, old, ref, mask, rewards, G = random_batch(seed=int(100 * gamma + 1000 * beta) + len(loss_type))
    # For cispo epsilon_high is an absolute cap on the ratio: below e^0.4 so that some hit it.
    eps, eps_high = 0.2, (1.15 if loss_type == "cispo" else 0.28)
    max_len = 9  # dr_grpo's constant: TRL's max_completion_length, larger than this batch's T
    adv = group_advantages(rewards, G, "group")
    g = focal_weights(rewards, G, gamma)
    if gamma == 0:
        assert torch.equal(g, torch.ones_like(g))
    else:
        assert g.min() == 0 and g.max() == 1  # all-right group off, all-wrong group kept (adv 0 anyway)
    ours_logp = logp.clone().requires_grad_(True)
    ours, metrics = policy_loss(ours_logp, old, adv * g, mask, loss_type, eps, eps_high,
                                ref_logp=ref, beta=beta, max_completion_length=max_len)
    ours.backward()
    # TRL gets the F-GRPO advantages (its own, scaled by g): F-GRPO = GRPO on scaled advantages.
    theirs, grad, trl_metrics = trl_loss(loss_type, logp, old, ref, trl_advantages(rewards, G, "group") * g,
                                         mask, 3, beta, eps, eps_high, max_len)
    diff = (ours.detach() - theirs).abs().item()
    gdiff = (ours_logp.grad - grad).abs().max().item()
    assert ours_logp.grad.abs().max() > 1e-4  # a real, non-trivial gradient
    # float64 inputs; TRL's nanstd computes its n/(n-1) factor in float32, hence not 1e-15.
    assert diff < 1e-8 and gdiff < 1e-8
    if loss_type == "cispo":
        assert metrics["clip_ratio"] == pytest.approx(trl_metrics["cispo_clip_ratio"][0])
        assert metrics["clip_ratio"] > 0
    else:
        assert metrics["clip_ratio"] == pytest.approx(trl_metrics["clip_ratio/region_mean"][0])
        assert metrics["clip_low"] > 0 and metrics["clip_high"] > 0
    if beta:
        assert metrics["kl"] == pytest.approx(trl_metrics["kl"][0])
        assert metrics["kl"] > 0


def test_focal_weight_values():
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0.5])
    assert success_share(rewards >= 1, 4).tolist() == [0.75, 0.25, 0.0]
    g = focal_weights(rewards, 4, gamma=2.0)
    assert g.tolist() == pytest.approx([0.0625] * 4 + [0.5625] * 4 + [1.0] * 4)
    # A threshold, or an explicit success mask from the reward, changes p̂.
    assert focal_weights(rewards, 4, 1.0, threshold=0.5)[8].item() == pytest.approx(0.75)
    ok = torch.tensor([True] * 4 + [False] * 8)
    assert focal_weights(rewards, 4, 1.0, success=ok).tolist() == [0.0] * 4 + [1.0] * 8


def test_normalized_focal_weights_average_one_over_the_groups_with_an_advantage():
    # p̂ = 0.75, 0.25, 0 (all wrong: no advantage), 1 (all right: no advantage)
    rewards = torch.tensor([1, 1, 1, 0, 1, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1.0])
    g = focal_weights(rewards, 4, 1.0, normalize=True)
    # the mean of 0.25 and 0.75 over the two groups whose rewards differ is 0.5
    assert g.tolist() == pytest.approx([0.5] * 4 + [1.5] * 4 + [2.0] * 4 + [0.0] * 4)
    adv = group_advantages(rewards, 4, "group")
    plain = adv * focal_weights(rewards, 4, 1.0)
    assert (adv * g).abs().sum() == pytest.approx(2 * plain.abs().sum())  # the step is not shrunk
    assert torch.equal(focal_weights(rewards, 4, 0.0, normalize=True), torch.ones(16))  # gamma 0: GRPO
    # Nothing to normalise by: no group whose rewards differ, or all of them solved (graded reward).
    uniform = torch.tensor([1.0] * 4 + [0.0] * 4)
    assert focal_weights(uniform, 4, 1.0, normalize=True).tolist() == [0.0] * 4 + [1.0] * 4
    solved = torch.tensor([1.0, 2, 2, 2, 1, 1, 1, 1])
    ok = torch.tensor([True] * 4 + [False] * 4)
    assert focal_weights(solved, 4, 1.0, success=ok, normalize=True).tolist() == [0.0] * 4 + [1.0] * 4


def test_micro_batches_sum_to_the_full_loss_and_zero_advantage_rows_can_be_dropped():
    logp, old, ref, mask, rewards, G = random_batch(seed=7)
    adv = group_advantages(rewards, G, "group") * focal_weights(rewards, G, 1.0)
    for loss_type in ("grpo", "dapo", "dr_grpo", "cispo"):
        full_logp = logp.clone().requires_grad_(True)
        full, _ = policy_loss(full_logp, old, adv, mask, loss_type, 0.2, 0.28)
        full.backward()
        # Keep only rows with a non-zero advantage, in two uneven micro-batches,
        # normalised by the whole batch's counts.
        keep = (adv != 0).nonzero().view(-1)
        assert 0 < len(keep) < len(adv)
        part_logp = logp.clone().requires_grad_(True)
        total = 0.0
        for rows in (keep[:3], keep[3:]):
            loss, _ = policy_loss(part_logp[rows], old[rows], adv[rows], mask[rows], loss_type, 0.2, 0.28,
                                  max_completion_length=mask.shape[1], num_sequences=len(adv),
                                  num_tokens=mask.sum())
            loss.backward()
            total += loss.item()
        assert total == pytest.approx(full.item(), abs=1e-12)
        assert torch.allclose(part_logp.grad, full_logp.grad, atol=1e-12)

