"""`model.shard: fsdp` (engine/fsdp.py) on the CPU: two processes over gloo, the tiny NF4
Llama's decoder layers sharded with FSDP2.

- SFT on 2 sharded ranks takes the steps of one process with the same global batch
  (losses, gradient norms and the saved adapter within 1e-5), with micro-batch counts that
  differ between the ranks (3 rows a step: 2 + 1, micro-batches of one row);
- its checkpoint is rank-independent: one process resumes from it and ends as the
  one-process run;
- F-GRPO and ESSA with fsdp are refused in one line; the planner divides the base by N.
"""

import shutil

import pytest
import torch

from edgetune.engine import api, settings
from edgetune.engine.errors import ConfigError
from inline_run import run_inline
from test_distributed import assert_same_steps, assert_same_weights, finish, steps


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    import os

    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.setenv("EDGETUNE_CACHE", os.environ.get("EDGETUNE_CACHE", str(tmp_path / "cache")))


def fsdp_cfg(model_dir, runs, shard="fsdp"):
    return settings.from_dict({
        "method": "sft",
        "model": {"name": str(model_dir), "quant": "nf4", "gradient_checkpointing": False, "shard": shard},
        "lora": {"r": 8, "alpha": 16},
        "data": {"path": "embedded:arith-sft", "max_rows": 48, "max_seq_len": 96},
        "run": {"runs_dir": str(runs), "seed": 3, "checkpoint_every": 2},
        # 1 x 3 rows a step: rank 0 runs two micro-batches, rank 1 one (and a zero-weight one)
        "sft": {"lr": 1e-3, "steps": 4, "batch_size": 1, "grad_accum": 3, "warmup_steps": 1, "eval_every": 0},
    })


def test_sft_sharded_on_two_ranks_equals_one_process_and_resumes_on_one(tiny_model_dir, tmp_path):
    from edgetune.engine import sft

    _, _, ref = run_inline(sft.train, fsdp_cfg(tiny_model_dir, tmp_path), tmp_path / "one")
    ref_adapter = tmp_path / "one" / "adapter" / "adapter_model.safetensors"

    run = api.start(fsdp_cfg(tiny_model_dir, tmp_path), name="two", gpus=2)
    events = finish(run)
    assert events[-1]["type"] == "finished", events[-1]
    assert next(e for e in events if e["type"] == "started")["world_size"] == 2
    assert sorted(steps(events)) == [1, 2, 3, 4]
    assert_same_steps(steps(events), steps(ref))
    assert_same_weights(run.path / "adapter" / "adapter_model.safetensors", ref_adapter)

    # the 2-rank checkpoint of step 2 (whole tensors), resumed by one process
    state = torch.load(run.path / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    one_state = torch.load(tmp_path / "one" / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    for i, s in one_state["optimizer"]["state"].items():
        assert torch.allclose(state["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], atol=1e-6, rtol=0), i
    shutil.copytree(run.path / "checkpoints", tmp_path / "resumed" / "checkpoints")
    _, _, again = run_inline(sft.train, fsdp_cfg(tiny_model_dir, tmp_path), tmp_path / "resumed", resume=True)
    assert again[-1]["type"] == "finished" and sorted(steps(again)) == [3, 4]
    assert_same_steps(steps(again), steps(ref))
    assert_same_weights(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors", ref_adapter)


@pytest.mark.parametrize("method", ["fgrpo", "essa"])
def test_fsdp_is_refused_for_rl_methods_in_one_line(method):
    with pytest.raises(ConfigError) as e:
        settings.resolve(overrides={"method": method, "model": {"shard": "fsdp"}, "essa": {"warm_start": "x"}})
    assert "\n" not in str(e.value) and str(e.value).startswith("model.shard: fsdp is built for sft only; " + method)


def test_planner_divides_the_sharded_parts_by_the_gpu_count():
    """`estimate --gpus N --set model.shard=fsdp`: the decoder layers' weights, the adapter,
    its gradients and optimizer state are 1/N per GPU, plus two whole layers (the running
    one and the one gathered ahead); embeddings and head stay whole; the batch is split as
    in the data-parallel run."""
    from edgetune.engine import planner

    def est(gpus, shard):
        cfg = settings.resolve(overrides={"method": "sft", "model": {"name": "Qwen/Qwen2.5-72B", "shard": shard},
                                          "sft": {"batch_size": 4, "grad_accum": 1},
                                          "data": {"max_seq_len": 1024}})
        return planner.estimate(cfg, device="cuda", gpu_total=141 * 2**30, detect_gpu=False, gpus=gpus)

    one, dp, four = est(1, "fsdp"), est(4, "none"), est(4, "fsdp")
    outside = (152064 * 8192 * 2 + 8192) * 2  # untied embeddings + head + final norm, bf16
    layer = (one["weights"] - outside) / 80
    assert four["weights"] == pytest.approx((one["weights"] - outside) / 4 + 2 * layer + outside, abs=2)
    assert four["weights"] < dp["weights"] == one["weights"]
    assert four["optimizer"] == pytest.approx(one["optimizer"] / 4, abs=1)
    assert four["lora_grads"] < one["lora_grads"] < dp["lora_grads"]  # no flat all-reduce buffer
    assert four["activations"] == dp["activations"] and four["shape"] == dp["shape"] == "1 x 1024 tokens"
    assert sum(four[k] for k in four["parts"]) == four["total"] < dp["total"]
    assert any("model.shard: fsdp" in n for n in four["notes"])
