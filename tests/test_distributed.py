"""Training on several ranks (engine/core/distributed.py), on the CPU: two processes over gloo
under torchrun, on the tiny random Llama (conftest.py).

- SFT on 2 ranks (edgetune's own launcher) takes the same steps as one process with the
  same global batch: losses, gradient norms and final LoRA weights within 1e-5; step
  events carry both ranks' memory and time;
- the SFT gradient and an F-GRPO update on fixed rollouts (tests/helpers/dist_driver.py)
  equal the one-process ones;
- ESSA under a plain `torchrun -m edgetune.engine.cli train` (population 5 split 3 + 2)
  has the one-process fitness trajectory;
- a stop reaches both ranks; the run resumes on one process and ends as an uninterrupted one;
- a rank killed mid-run ends the run with an error that names it, and no process is left.
"""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from inline_run import run_inline
from safetensors.torch import load_file

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import settings
from edgetune.engine.core.events import read_events
from edgetune.engine.core.runfolder import exit_words

from edgetune.engine.run import api

HELPERS = Path(__file__).resolve().parent / "helpers"
ENV = {"OMP_NUM_THREADS": "1"}


@pytest.fixture(autouse=True)
def _one_thread(monkeypatch, tmp_path):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setenv("EDGETUNE_CACHE", os.environ.get("EDGETUNE_CACHE", str(tmp_path / "cache")))


def sft_cfg(model_dir, runs, **sft):
    return settings.from_dict({
        "method": "sft",
        "model": {"name": str(model_dir), "quant": "nf4", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"path": "embedded:arith-sft", "max_rows": 48, "max_seq_len": 96},
        "run": {"runs_dir": str(runs), "seed": 3, "checkpoint_every": 2},
        # 3 x 2 rows a step: 3 + 3 on two ranks, in micro-batches that differ from one process's
        "sft": {"lr": 1e-3, "steps": 4, "batch_size": 3, "grad_accum": 2, "warmup_steps": 1, "eval_every": 0,
                **sft},
    })


def one_process_sft(model_dir, root: Path, **sft):
    """The one-process run (in this process, as the worker would run it): its events and adapter."""
    from edgetune.engine.methods.sft import sft as sft_recipe

    _, _, events = run_inline(sft_recipe.train, sft_cfg(model_dir, root, **sft), root / "one")
    return events, root / "one" / "adapter" / "adapter_model.safetensors"


@pytest.fixture(scope="module")
def sft_reference(tiny_model_dir, tmp_path_factory):
    return one_process_sft(tiny_model_dir, tmp_path_factory.mktemp("one"))


def steps(events):
    return {e["step"]: e for e in events if e["type"] == "step"}


def assert_same_steps(ours: dict, ref: dict, keys=("loss", "grad_norm")):
    assert ours.keys() <= ref.keys() and ours
    for k in ours:
        for key in keys:
            assert ours[k][key] == pytest.approx(ref[k][key], rel=1e-5, abs=1e-6), (k, key)


def assert_same_weights(a: Path, b: Path):
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    assert max(float((wa[k] - wb[k]).abs().max()) for k in wa) < 1e-5
    assert max(float(wa[k].abs().max()) for k in wa if "lora_B" in k) > 1e-3  # trained: B left zero


def finish(run, timeout=300):
    t0 = time.time()
    while run.alive() and time.time() - t0 < timeout:
        time.sleep(0.3)
    assert not run.alive(), "the run did not end"
    return read_events(run.dir.events_path)


def test_shard_splits_unevenly():
    assert [list(dist.shard(5, r, 2)) for r in range(2)] == [[0, 1, 2], [3, 4]]
    assert [len(dist.shard(3, r, 4)) for r in range(4)] == [1, 1, 1, 0]
    assert sum((list(dist.shard(17, r, 3)) for r in range(3)), []) == list(range(17))


def test_sft_two_ranks_equal_one_process(tiny_model_dir, tmp_path, sft_reference):
    ref_events, ref_adapter = sft_reference
    run = api.start(sft_cfg(tiny_model_dir, tmp_path), name="two", gpus=2)
    events = finish(run)
    assert events[-1]["type"] == "finished", events[-1].get("message")
    started = next(e for e in events if e["type"] == "started")
    assert started["world_size"] == 2
    ours = steps(events)
    assert sorted(ours) == [1, 2, 3, 4]
    assert_same_steps(ours, steps(ref_events))
    for ev in ours.values():  # each rank's memory and time
        assert [r["rank"] for r in ev["ranks"]] == [0, 1]
        assert all(r["host_rss"] > 0 and r["step_s"] > 0 for r in ev["ranks"])
    assert_same_weights(run.path / "adapter" / "adapter_model.safetensors", ref_adapter)
    assert (run.path / "checkpoints" / "step-2").is_dir() and not run.dir.pid_path.exists()


def test_gradients_and_fgrpo_update_equal_one_process(tiny_model_dir, tmp_path):
    """The SFT gradient of 8 rows (2 ranks x 4, micro-batches of 3) and two F-GRPO optimizer
    steps on one fixed rollout batch (each rank the groups of its prompts, one group with
    zero advantage) equal the one-process ones."""
    import dist_driver

    dist_driver.main(str(tmp_path), str(tiny_model_dir))  # one process, in this one
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(HELPERS), os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                    str(HELPERS / "dist_driver.py"), str(tmp_path), str(tiny_model_dir)],
                   env=env, check=True, timeout=300, capture_output=True)
    one = torch.load(tmp_path / "world-1.pt", weights_only=False)
    two = torch.load(tmp_path / "world-2.pt", weights_only=False)
    assert two["world"] == 2 and one["world"] == 1
    assert two["sft"]["labels"] == one["sft"]["labels"]
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


REWARD_PY = "def reward(completion, answer, row):\n    return (sum(map(ord, completion)) % 97) / 96\n"


@pytest.mark.slow  # two ranks under torchrun, twice: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_essa_under_torchrun_has_the_one_process_trajectory(tiny_model_dir, tmp_path):
    """A plain `torchrun ... -m edgetune.engine.cli train` (no launcher of ours): rank 0
    makes the run folder; population 5 is split 3 + 2; greedy fitness per candidate and
    generation equals the one-process run's."""
    from edgetune.engine.methods.essa import essa

    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(4) for b in range(3)]
    (tmp_path / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (tmp_path / "reward.py").write_text(REWARD_PY)
    cfg = {"method": "essa", "model": {"name": str(tiny_model_dir), "quant": "nf4", "gradient_checkpointing": False},
           "lora": {"r": 4, "alpha": 8},
           "data": {"path": str(tmp_path / "rl.jsonl"), "eval_fraction": 0.0, "max_seq_len": 64},
           "run": {"runs_dir": str(tmp_path / "runs"), "seed": 1, "checkpoint_every": 0},
           "sft": {"batch_size": 2, "lr": 1e-2},
           "essa": {"warm_start_steps": 1, "warm_start_data": "embedded:arith-sft", "population": 5,
                    "generations": 2, "prompts_per_generation": 2, "max_new_tokens": 4, "sigma0": 0.5,
                    "reward": "file", "reward_file": str(tmp_path / "reward.py"), "eval_prompts": 0}}
    (tmp_path / "essa.yaml").write_text(json.dumps(cfg))
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                           "-m", "edgetune.engine.cli", "train", "--config", str(tmp_path / "essa.yaml"),
                           "--name", "two"], capture_output=True, text=True, timeout=400)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "run folder:" in proc.stdout and "finished" in proc.stdout
    two = read_events(tmp_path / "runs" / "two" / "events.jsonl")
    _, _, one = run_inline(essa.train, settings.from_dict(cfg), tmp_path / "one")

    def fitness(events):
        return [(e["generation"], e["index"], e["fitness"]) for e in events if e["type"] == "candidate"]

    assert len(fitness(two)) == 10 and [g[:2] for g in fitness(two)] == [g[:2] for g in fitness(one)]
    assert [f for *_, f in fitness(two)] == pytest.approx([f for *_, f in fitness(one)], abs=1e-9)
    assert len({f for *_, f in fitness(one)}) > 1  # the candidates really differ
    assert two[-1]["type"] == "finished" and not (tmp_path / "runs" / "two" / "worker.pid").exists()


@pytest.mark.slow  # two ranks, then a worker: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_stop_on_two_ranks_then_resume_on_one(tiny_model_dir, tmp_path):
    # 40 steps, not the other tests' 4: a tiny-model step takes ~70 ms, and 4 of them can all
    # end between the first step event and the stop reaching the ranks (measured: the run
    # finished uncut); 40 leave seconds for the stop to land
    ref_events, ref_adapter = one_process_sft(tiny_model_dir, tmp_path / "ref", steps=40)
    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=40), name="cut", gpus=2)
    for ev in run.events(follow_live=True, timeout=300):
        if ev["type"] == "step":
            # SIGTERM to the process the API started (the launcher): it writes the STOP file,
            # which rank 0 sees; every rank stops after the same step
            os.kill(run.process.pid, signal.SIGTERM)
            break
    events = finish(run)
    assert events[-1]["type"] == "stopped", events[-1]
    cut = events[-1]["step"]
    assert 1 <= cut < 40 and run.dir.last_checkpoint()[0] == cut
    again = api.resume(run.path, gpus=1)
    events = finish(again)
    assert events[-1]["type"] == "finished", events[-1].get("message")
    resumed = [e for e in events if e["type"] == "started"][-1]
    assert resumed["resumed_from"] == cut and "world_size" not in resumed
    assert_same_steps({k: v for k, v in steps(events[resumed["i"]:]).items()}, steps(ref_events))
    assert_same_weights(again.path / "adapter" / "adapter_model.safetensors", ref_adapter)


def _ranks(launcher_pid: int) -> dict:
    import psutil

    out = {}
    for p in psutil.Process(launcher_pid).children(recursive=True):
        try:
            env = p.environ()
            if "edgetune.engine.run.worker" in " ".join(p.cmdline()) and "RANK" in env:
                out[int(env["RANK"])] = p
        except psutil.Error:
            pass
    return out


def test_killing_the_launcher_ends_every_rank_and_only_then_frees_the_runs_folder(tiny_model_dir, tmp_path):
    """The process in worker.pid of a --gpus 2 run killed alone: torchrun and both ranks end
    with it (no orphan keeps writing the run), and the runs folder is free for the next
    writer only then."""
    import psutil

    from edgetune.engine.core.runfolder import lock_runs_folder

    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=400), name="launcher-killed", gpus=2)
    t0 = time.time()
    while len(_ranks(run.process.pid)) < 2:
        assert run.process.poll() is None and time.time() - t0 < 240, run.dir.log_path.read_text()[-3000:]
        time.sleep(0.2)
    writers = psutil.Process(run.process.pid).children(recursive=True)  # torchrun and the ranks
    assert lock_runs_folder(tmp_path) is None
    os.kill(run.process.pid, signal.SIGKILL)
    run.process.wait(30)
    alive = psutil.wait_procs(writers, timeout=30)[1]
    for p in alive:  # not left behind by a failing test
        p.kill()
    assert not alive, f"left writing the run: {[p.pid for p in alive]}"
    fd = lock_runs_folder(tmp_path)
    assert fd is not None
    os.close(fd)
    assert run.status() == "crashed"


@pytest.mark.slow  # two ranks: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_a_killed_rank_ends_the_run_naming_it(tiny_model_dir, tmp_path):
    import psutil

    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=400), name="kill", gpus=2)
    launcher = run.process.pid
    for ev in run.events(follow_live=True, timeout=300):
        if ev["type"] == "step":
            break
    ranks = _ranks(launcher)
    assert sorted(ranks) == [0, 1]
    ranks[1].send_signal(signal.SIGKILL)
    events = finish(run, timeout=120)
    err = events[-1]
    assert err["type"] == "error" and "rank 1" in err["message"] and err["kind"] == "killed", err
    assert f"pid {ranks[1].pid}" in err["message"]
    assert run.status() == "failed" and events[-2]["type"] != "error"  # one error, not a second one
    alive = psutil.wait_procs(list(ranks.values()), timeout=30)[1]
    assert not alive, f"ranks left running: {alive}"


@pytest.mark.slow  # two ranks: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_a_killed_rank_0_is_named_with_its_pid_and_signal(tiny_model_dir, tmp_path):
    """Rank 0 writes the events and watches the others, so its own death is written by the
    launcher, from the failure torchrun reports: the rank, its pid and how it ended."""
    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=400), name="kill0", gpus=2)
    for ev in run.events(follow_live=True, timeout=300):
        if ev["type"] == "step":
            break
    ranks = _ranks(run.process.pid)
    ranks[0].send_signal(signal.SIGKILL)
    err = finish(run, timeout=120)[-1]
    assert err["type"] == "error" and err["kind"] == "killed", err
    assert f"rank 0 (pid {ranks[0].pid}) died: killed by signal 9 (SIGKILL)" in err["message"], err


def test_rank_death_is_read_from_torchruns_own_summary(tmp_path):
    """The launcher reads the root cause from the text torchrun's ChildFailedError writes,
    and only from this attempt's part of worker.log."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from edgetune.engine.run import worker

    def summary(rank, pid, code):
        return ChildFailedError("edgetune.engine.run.worker", {
            rank: ProcessFailure(local_rank=rank, pid=pid, exitcode=code, error_file=str(tmp_path / "none")),
            rank + 1: ProcessFailure(local_rank=rank + 1, pid=pid + 1, exitcode=1, error_file=str(tmp_path / "none")),
        }).format_msg()

    log = tmp_path / "worker.log"
    log.write_text("an earlier attempt\n" + summary(1, 111, 3))
    start = log.stat().st_size
    assert worker._first_failure(log, start) is None
    with open(log, "a") as f:
        f.write("this attempt\n" + summary(0, 4242, -9))
    assert worker._first_failure(log, start) == {"rank": 0, "exitcode": -9, "pid": 4242}
    assert exit_words(-9) == "killed by signal 9 (SIGKILL)" and exit_words(3) == "exit status 3"


def test_cli_launch_options(tmp_path):
    from edgetune.engine import cli

    assert cli.main(["train", "--preset", "sft-quickstart", "--gpus", "0", "--runs-dir", str(tmp_path)]) == 2
    assert cli.main(["train", "--preset", "sft-quickstart", "--gpus", "2", "--nnodes", "2",
                     "--runs-dir", str(tmp_path)]) == 2
    assert not list(tmp_path.iterdir())  # nothing was started


def test_gpu_count_reads_nvidia_smi(tmp_path, monkeypatch):
    """What the app's start form asks to show its GPUs field (no torch in the app)."""
    smi = tmp_path / "nvidia-smi"
    smi.write_text("#!/bin/sh\necho 'GPU 0: NVIDIA H200 (UUID: a)'\necho 'GPU 1: NVIDIA H200 (UUID: b)'\n")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert api.gpu_count() == 2
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert api.gpu_count() == 1
    monkeypatch.setenv("PATH", str(tmp_path / "empty"))
    assert api.gpu_count() == 0


@pytest.mark.slow  # two ranks: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_a_failing_rank_ends_the_run_with_its_error(tiny_model_dir, tmp_path, monkeypatch):
    """A bug on rank 1 alone (its 2nd step raises): rank 0 ends the run with rank 1's own
    one-line error, kind bug; the traceback is in worker.log."""
    hooks = HELPERS / "rank_hooks"
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(hooks), os.environ.get("PYTHONPATH", "")]))
    monkeypatch.setenv("EDGETUNE_RANK_FAULT", "1:2")
    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=6), name="fault", gpus=2)
    events = finish(run)
    err = events[-1]
    assert err["type"] == "error" and err["kind"] == "bug", err
    assert "rank 1" in err["message"] and "RuntimeError: injected fault" in err["message"], err
    assert [e["step"] for e in events if e["type"] == "step"] == [1]
    assert "injected fault" in run.dir.log_path.read_text()


@pytest.mark.slow  # two ranks: the fast suite keeps the SFT and F-GRPO equality on two ranks
def test_kill_takes_every_rank(tiny_model_dir, tmp_path):
    """Run.kill() (the second Ctrl-C) kills the launcher's process group; the ranks,
    which torchrun starts in sessions of their own, die with their parent."""
    import psutil

    run = api.start(sft_cfg(tiny_model_dir, tmp_path, steps=400), name="kill-all", gpus=2)
    for ev in run.events(follow_live=True, timeout=300):
        if ev["type"] == "step":
            break
    ranks = _ranks(run.process.pid)
    assert sorted(ranks) == [0, 1]
    run.kill()
    alive = psutil.wait_procs(list(ranks.values()), timeout=30)[1]
    assert not alive, f"ranks left running: {alive}"
    last = read_events(run.dir.events_path)[-1]
    assert last["type"] == "error" and last["kind"] == "killed" and run.status() == "failed"


def test_planner_gives_the_peak_of_each_gpu(tiny_model_dir):
    """Data-parallel: each GPU holds the whole base; SFT's and F-GRPO's batches are split
    (an SFT step of 8 x 1 rows: 4 rows a GPU; F-GRPO's 8 prompts: 4 a GPU); the flat
    gradient buffer and NCCL's are added; ESSA's per-GPU work is one process's."""
    from edgetune.engine.planning import planner

    def est(method, gpus, **over):
        cfg = settings.resolve(overrides={"method": method, "model": {"name": str(tiny_model_dir)}, **over})
        return planner.estimate(cfg, device="cuda", gpu_total=80 * 2**30, detect_gpu=False, gpus=gpus)

    sft = {"sft": {"batch_size": 8, "grad_accum": 1}, "data": {"max_seq_len": 512}}
    one, two = est("sft", 1, **sft), est("sft", 2, **sft)
    assert two["weights"] == one["weights"] and two["gpus"] == 2
    assert two["shape"] == "4 x 512 tokens" and one["shape"] == "8 x 512 tokens"
    assert two["activations"] < one["activations"]
    assert two["lora_grads"] == 2 * one["lora_grads"] and two["cuda_context"] > one["cuda_context"]
    assert sum(two[k] for k in two["parts"]) == two["total"]
    # grad_accum 2 on 2 GPUs: each takes one micro-batch of the full size, as one GPU does
    acc = {"sft": {"batch_size": 8, "grad_accum": 2}, "data": {"max_seq_len": 512}}
    assert est("sft", 2, **acc)["activations"] == est("sft", 1, **acc)["activations"]
    rl = {"fgrpo": {"prompts_per_step": 8, "num_generations": 8}}
    assert est("fgrpo", 2, **rl)["rollout_kv_cache"] * 2 == est("fgrpo", 1, **rl)["rollout_kv_cache"]
    essa = {"essa": {"warm_start": "x"}}
    assert est("essa", 2, **essa)["lora"] == est("essa", 1, **essa)["lora"]


def test_dpo_two_ranks_equal_one_process(tiny_model_dir, tmp_path):
    """Data-parallel DPO (--gpus 2 on CPU ranks): each rank takes half of a step's pairs,
    the pair count and the gradients are summed over the ranks, and every step's loss and
    gradient norm, and the adapter, are those of one process."""
    from test_dpo import dpo_config

    from edgetune.engine.methods.dpo import dpo

    cfg = dpo_config(tiny_model_dir, tmp_path, dpo={"eval_every": 0})
    _, _, ref_events = run_inline(dpo.train, cfg, tmp_path / "one")
    run = api.start(dpo_config(tiny_model_dir, tmp_path, dpo={"eval_every": 0}), name="two", gpus=2)
    events = finish(run)
    assert events[-1]["type"] == "finished", events[-1].get("message")
    assert next(e for e in events if e["type"] == "started")["world_size"] == 2
    ours = steps(events)
    assert sorted(ours) == [1, 2, 3, 4]
    assert_same_steps(ours, steps(ref_events), keys=("loss", "grad_norm", "accuracy", "margin"))
    assert_same_weights(run.path / "adapter" / "adapter_model.safetensors",
                        tmp_path / "one" / "adapter" / "adapter_model.safetensors")
