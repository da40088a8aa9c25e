"""`model.shard: fsdp` (engine/models/fsdp.py) on the CPU: two processes over gloo, the tiny NF4
Llama's decoder layers sharded with FSDP2.

- SFT on 2 sharded ranks takes the steps of one process with the same global batch
  (losses, gradient norms and the saved adapter within 1e-5), with micro-batch counts that
  differ between the ranks (3 rows a step: 2 + 1, micro-batches of one row);
- its checkpoint is rank-independent: one process resumes from it and ends as the
  one-process run;
- the SFT gradient and an F-GRPO update on fixed rollouts equal one process's
  (tests/dist_driver.py), and an F-GRPO run, generation included, equals the
  data-parallel run;
- ESSA with fsdp is refused in one line; the planner divides the base by N.
"""

import os
import shutil
from pathlib import Path

import pytest
import torch
from inline_run import run_inline
from test_distributed import assert_same_steps, assert_same_weights, finish, steps

from edgetune.engine.core import settings
from edgetune.engine.core.errors import ConfigError

from edgetune.engine.run import api


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
    from edgetune.engine.methods.sft import sft

    _, _, ref = run_inline(sft.train, fsdp_cfg(tiny_model_dir, tmp_path), tmp_path / "one")
    ref_adapter = tmp_path / "one" / "adapter" / "adapter_model.safetensors"

    run = api.start(fsdp_cfg(tiny_model_dir, tmp_path), name="two", gpus=2)
    events = finish(run)
    assert events[-1]["type"] == "finished", events[-1].get("message")
    assert next(e for e in events if e["type"] == "started")["world_size"] == 2
    assert sorted(steps(events)) == [1, 2, 3, 4]
    assert_same_steps(steps(events), steps(ref))
    assert_same_weights(run.path / "adapter" / "adapter_model.safetensors", ref_adapter)

    # the 2-rank checkpoint of step 2 (whole tensors), resumed by one process
    state = torch.load(run.path / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    one_state = torch.load(tmp_path / "one" / "checkpoints" / "step-2" / "training_state.pt", weights_only=True)
    for i, s in one_state["optimizer"]["state"].items():
        assert torch.allclose(state["optimizer"]["state"][i]["exp_avg"], s["exp_avg"], atol=1e-6, rtol=0), i
    # step 2 only: a finished run also keeps a checkpoint of its last step
    shutil.copytree(run.path / "checkpoints" / "step-2", tmp_path / "resumed" / "checkpoints" / "step-2")
    _, _, again = run_inline(sft.train, fsdp_cfg(tiny_model_dir, tmp_path), tmp_path / "resumed", resume=True)
    assert again[-1]["type"] == "finished" and sorted(steps(again)) == [3, 4]
    assert_same_steps(steps(again), steps(ref))
    assert_same_weights(tmp_path / "resumed" / "adapter" / "adapter_model.safetensors", ref_adapter)


def test_fsdp_is_refused_for_essa_in_one_line():
    with pytest.raises(ConfigError) as e:
        settings.resolve(overrides={"method": "essa", "model": {"shard": "fsdp"}, "essa": {"warm_start": "x"}})
    assert "\n" not in str(e.value) and str(e.value).startswith("model.shard: fsdp is built for sft and fgrpo; essa")


def test_planner_divides_the_sharded_parts_by_the_gpu_count():
    """`estimate --gpus N --set model.shard=fsdp`: the decoder layers' weights, the adapter,
    its gradients and optimizer state are 1/N per GPU, plus two whole layers (the running
    one and the one gathered ahead); embeddings and head stay whole; the batch is split as
    in the data-parallel run."""
    from edgetune.engine.planning import planner

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
    # F-GRPO: the same division; its rollouts take no bf16 copy of the base (the plain loop)
    rl = {"method": "fgrpo", "model": {"name": "Qwen/Qwen2.5-72B"}, "fgrpo": {"prompts_per_step": 4}}
    rl_dp, rl_four = (planner.estimate(settings.resolve(overrides={**rl, "model": {**rl["model"], "shard": sh}}),
                                       device="cuda", gpu_total=141 * 2**30, detect_gpu=False, gpus=4)
                      for sh in ("none", "fsdp"))
    assert rl_four["weights"] == four["weights"] < rl_dp["weights"]
    assert rl_four["rollout_kv_cache"] == rl_dp["rollout_kv_cache"]
    assert any("bf16 copy" in n for n in rl_dp["notes"]) and not any("bf16 copy" in n for n in rl_four["notes"])


def test_gradients_and_fgrpo_update_sharded_equal_one_process(tiny_model_dir, tmp_path):
    """tests/dist_driver.py with the base sharded on 2 ranks: the SFT gradient of 8 rows and
    two F-GRPO optimizer steps on one fixed rollout batch (rank 0 keeps 4 rows, rank 1 8:
    2 and 3 micro-batches of 3) equal the one-process ones."""
    import os
    import subprocess
    import sys
    from pathlib import Path

    import dist_driver

    driver = Path(dist_driver.__file__).resolve()
    dist_driver.main(str(tmp_path), str(tiny_model_dir))  # one process, in this one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(driver.parent), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           str(driver), str(tmp_path), str(tiny_model_dir), "fsdp"],
                          env=env, timeout=300, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    one = torch.load(tmp_path / "world-1.pt", weights_only=False)
    two = torch.load(tmp_path / "world-2-fsdp.pt", weights_only=False)
    assert two["world"] == 2 and two["sft"]["labels"] == one["sft"]["labels"]
    assert two["sft"]["loss"] == pytest.approx(one["sft"]["loss"], rel=1e-6)
    for k, g in one["sft"]["grads"].items():
        assert float(g.abs().max()) > 0, k
        assert torch.allclose(two["sft"]["grads"][k], g, atol=1e-5, rtol=0), k
    for k, w in one["fgrpo"]["weights"].items():
        assert torch.allclose(two["fgrpo"]["weights"][k], w, atol=1e-5, rtol=0), k
    m1, m2 = one["fgrpo"]["metrics"], two["fgrpo"]["metrics"]
    assert m1["dropped"] == m2["dropped"] == 4 and m1["train_tokens"] == m2["train_tokens"]
    for key in ("loss", "grad_norm", "clip_ratio", "ratio"):
        assert m2[key] == pytest.approx(m1[key], rel=1e-5, abs=1e-7), key
    # a sharded resume: the whole adapter and optimizer state loaded back into the shards
    back = two["reloaded"]
    for k, w in two["fgrpo"]["weights"].items():
        assert torch.equal(back["weights"][k], w), k
    assert back["optimizer"].keys() == back["saved_optimizer"].keys() and back["optimizer"]
    for i, st in back["saved_optimizer"].items():
        assert float(st["exp_avg_sq"].abs().max()) > 0
        for key, v in st.items():
            assert torch.equal(back["optimizer"][i][key], v), (i, key)


def test_fgrpo_sharded_on_two_ranks_equals_data_parallel(tiny_model_dir, tmp_path, monkeypatch):
    """F-GRPO end to end, generation included: the sharded ranks decode in step (the plain
    loop, every rank until all are done) and sample what the data-parallel ranks sample
    (3 prompts: 2 + 1 groups, so different row and micro-batch counts per rank); steps,
    held-out evaluations and the final adapter equal the data-parallel run's. (The
    data-parallel ranks decode on the plain loop too: on the CPU they would take an fp32
    copy of the base, whose logits differ from the NF4 layers' in the last bits.)"""
    import json

    hooks = Path(__file__).parent / "helpers" / "decode_hooks"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EDGETUNE_PLAIN_DECODE", "1")

    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text("def reward(completion, answer, row):\n"
                                        "    return (sum(map(ord, completion)) % 7) / 6\n")

    def cfg(shard):
        return settings.from_dict({
            "method": "fgrpo",
            "model": {"name": str(tiny_model_dir), "quant": "nf4", "gradient_checkpointing": False, "shard": shard},
            "lora": {"r": 4, "alpha": 8},
            "data": {"path": str(tmp_path / "rl.jsonl"), "eval_fraction": 0.2},
            "run": {"runs_dir": str(tmp_path / shard), "seed": 1, "checkpoint_every": 1},
            "fgrpo": {"num_generations": 4, "prompts_per_step": 3, "max_new_tokens": 5, "steps": 2,
                      "reward": "file", "reward_file": str(tmp_path / "reward.py"), "lr": 5e-3,
                      "micro_batch_size": 3, "eval_prompts": 2, "eval_k": 0, "temperature": 0.9}})

    runs, events = {}, {}
    for shard in ("none", "fsdp"):
        runs[shard] = api.start(cfg(shard), name="two", gpus=2)
        events[shard] = finish(runs[shard])
    for ev in events.values():
        assert ev[-1]["type"] == "finished", ev[-1]
    assert sorted(steps(events["fsdp"])) == [1, 2]
    assert_same_steps(steps(events["fsdp"]), steps(events["none"]), keys=("loss", "reward_mean", "grad_norm"))
    evals = {s: [e for e in ev if e["type"] == "eval"] for s, ev in events.items()}
    assert evals["fsdp"] and [e.get("success_rate") for e in evals["fsdp"]] == \
        [e.get("success_rate") for e in evals["none"]]
    assert (runs["fsdp"].path / "checkpoints" / "step-1").is_dir()
    assert_same_weights(runs["fsdp"].path / "adapter" / "adapter_model.safetensors",
                        runs["none"].path / "adapter" / "adapter_model.safetensors")
