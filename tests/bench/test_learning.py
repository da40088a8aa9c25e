"""bench/learning.py: held-out splits that share no question with train, the report it
writes, and (slow) real learning on a task the presets never use, measured on held-out
questions through the CLI as a user would run it."""

import json
from pathlib import Path

import bench_script
import pytest


def load_bench():
    return bench_script.load("learning")


def test_splits_share_no_question_and_files_follow_the_formats(tmp_path):
    bench = load_bench()
    for task in bench.TASKS:
        data = bench.write_task_data(task, tmp_path, n_train=40, n_eval=20, seed=3)
        train = [json.loads(line) for line in Path(data["train_rl"]).read_text().splitlines()]
        held = [json.loads(line) for line in Path(data["eval_rl"]).read_text().splitlines()]
        sft = [json.loads(line) for line in Path(data["train_sft"]).read_text().splitlines()]
        assert len(held) == 20 and len(train) == data["n_train"] > 0
        assert not {bench.norm(r["prompt"]) for r in train} & {bench.norm(r["prompt"]) for r in held}
        assert len({bench.norm(r["prompt"]) for r in held}) == 20  # no duplicate inside held-out
        # The demonstrations are the train questions, answered the way the reward reads them.
        assert [m["messages"][0]["content"] for m in sft] == [r["prompt"] for r in train]
        assert [m["messages"][1]["content"] for m in sft] == [f"Answer: {r['answer']}" for r in train]
    # Same seed, same items: every method of a run sees the same split.
    again = bench.write_task_data("chain_sum", tmp_path / "again", n_train=40, n_eval=20, seed=3)
    first = tmp_path / "chain_sum" / "eval_rl.jsonl"
    assert Path(again["eval_rl"]).read_text() == first.read_text()


def test_pairs_choose_the_answer_over_a_wrong_number_on_the_same_split(tmp_path):
    bench = load_bench()
    data = bench.write_task_data("chain_sum", tmp_path, n_train=40, n_eval=20, seed=3)
    for rl, pairs in (("train_rl", "train_pairs"), ("eval_rl", "eval_pairs")):
        rows = [json.loads(line) for line in Path(data[rl]).read_text().splitlines()]
        made = [json.loads(line) for line in Path(data[pairs]).read_text().splitlines()]
        assert [p["prompt"] for p in made] == [r["prompt"] for r in rows]
        assert [p["chosen"] for p in made] == [f"Answer: {r['answer']}" for r in rows]
        for p, r in zip(made, rows):
            wrong = int(p["rejected"].removeprefix("Answer: "))
            assert wrong != int(r["answer"]) and abs(wrong - int(r["answer"])) <= 2
            assert wrong >= 0 or int(r["answer"]) < 0  # a non-negative answer gets a non-negative wrong one
    # a task whose answers are not numbers has no pairs (and DPO says so instead of training)
    assert bench.pair_row({"question": "q", "answer": "cat"}, __import__("random").Random(0)) is None


def test_overlap_is_caught_by_content():
    bench = load_bench()
    train = [{"question": "What is 2 + 3?"}, {"question": "What is 1 + 1?"}]
    held = [{"question": "what is  2 + 3?"}]  # differs only in case and spacing
    with pytest.raises(AssertionError, match="also in train"):
        bench.assert_disjoint(train, held)
    bench.assert_disjoint(train, [{"question": "What is 4 + 4?"}])


def test_too_few_distinct_questions_is_one_line():
    bench = load_bench()
    with pytest.raises(SystemExit, match="distinct questions"):
        bench.make_items("products", n_train=10, n_eval=500, seed=0)


def toy_result():
    m = lambda s, p4=None, t=None: {"success_rate": s, "pass@1": s, **({"pass@4": p4} if p4 is not None else {}),
                                    "train_s": t, "curve": []}
    return {"date": "2026-12-01T06:00+00:00", "machine": "x86_64 CPU, 2 cores", "command": "python bench/learning.py",
            "args": {"eval_k": 4, "eval_prompts": 50}, "kept_aside": "products",
            "tasks": [{"task": "chain_sum", "kept_aside": False, "n_train": 146, "n_eval": 50,
                       "methods": {"base": m(0.12, 0.3), "sft": m(0.8, 0.9, 90.0),
                                   "fgrpo": {**m(0.5, 0.7, 600.0),
                                             "curve": [{"step": i, "reward_mean": 0.1 * i, "truncated": t}
                                                       for i, t in enumerate([1.0, 1.0, 0.5, 0.5, 0.5, 0.25, 0.25, 0.0], 1)]},
                                   "grpo": {"error": "train exited 1"}}},
                      {"task": "products", "kept_aside": True, "n_train": 49, "n_eval": 50,
                       "methods": {"base": m(0.0, 0.04)}}]}


def test_table_and_plot_from_a_toy_result(tmp_path):
    bench = load_bench()
    result = toy_result()
    bench.write_report(result, tmp_path)
    md = (tmp_path / "learning.md").read_text()
    assert "| chain_sum | 146 / 50 | 12% (30%) | 80% (90%), 1.5 min | 50% (70%), 10.0 min | failed | not run | not run |" in md
    assert "| products (kept aside) | 49 / 50 | 0% (4%) | not run |" in md
    assert "2026-12-01" in md and "x86_64 CPU, 2 cores" in md and "`python bench/learning.py`" in md
    # capped share of rollouts: mean of the first 4 steps (0.75), of the last 4 (0.25)
    assert "- chain_sum: F-GRPO 75% -> 25%" in md and "products:" not in md.split("cap")[-1]
    assert json.loads((tmp_path / "learning.json").read_text()) == result
    from PIL import Image

    with Image.open(tmp_path / "learning.png") as im:
        assert im.size[0] > 400 and im.size[1] > 400


def test_unknown_task_is_refused(capsys):
    bench = load_bench()
    with pytest.raises(SystemExit) as e:
        bench.main(["--tasks", "chain_summ"])
    assert e.value.code == 2 and "unknown task or method: chain_summ" in capsys.readouterr().err


def test_partial_runs_merge_into_one_table(tmp_path):
    bench = load_bench()
    a, b = toy_result(), toy_result()
    a["tasks"] = a["tasks"][:1]
    a["tasks"][0]["methods"] = {"base": a["tasks"][0]["methods"]["base"]}
    b["tasks"][0]["methods"] = {"grpo": {"success_rate": 0.4, "pass@4": 0.6, "train_s": 60.0}}
    b["command"] = "python bench/learning.py --methods grpo"
    for name, r in (("a.json", a), ("b.json", b)):
        (tmp_path / name).write_text(json.dumps(r))
    assert bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")]) == 0
    md = (tmp_path / "m" / "learning.md").read_text()
    assert "| chain_sum | 146 / 50 | 12% (30%) | not run | not run | 40% (60%), 1.0 min |" in md
    assert "| products (kept aside) |" in md and "--methods grpo" in md
    b["args"] = {"eval_k": 2, "eval_prompts": 50}
    (tmp_path / "b.json").write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="another evaluation"):
        bench.main(["--merge", str(tmp_path / "a.json"), str(tmp_path / "b.json"), "--out", str(tmp_path / "m")])


def run_bench(tmp_path, *args) -> dict:
    bench = load_bench()
    assert bench.main(["--out", str(tmp_path / "out"), "--work", str(tmp_path / "work"), *args]) == 0
    result = json.loads((tmp_path / "out" / "learning.json").read_text())
    methods = result["tasks"][0]["methods"]
    for name, m in methods.items():
        assert "error" not in m, f"{name}: {m['error']}"
    return methods


@pytest.mark.slow
def test_sft_learns_a_task_the_presets_never_use(tmp_path):
    """chain_sum (reasoning-gym, one-digit a + b / a - b), sft-quickstart with 40 steps (a
    quarter of the preset's, to keep the test short) on the train questions, judged on 30
    held-out questions. Measured on 2 shared CPU cores (bench run, 40 held-out, 40 steps):
    12.5% -> 95%. The margin asked here leaves room for the smaller held-out set and another
    machine."""
    m = run_bench(tmp_path, "--tasks", "chain_sum", "--methods", "base,sft", "--eval-prompts", "30", "--eval-k", "1",
                  "--sft-steps", "40")
    assert m["base"]["prompts"] == m["sft"]["prompts"] == 30
    assert m["sft"]["success_rate"] >= m["base"]["success_rate"] + 0.5


@pytest.mark.slow
def test_fgrpo_learns_a_task_the_presets_never_use(tmp_path):
    """products (reasoning-gym, one-digit a * b; the kept-aside task, never used to choose a
    default): fgrpo-quickstart for 6 steps with a 16-token cap (its answers take ~9 tokens),
    judged on 20 held-out questions. Measured with the bench (preset budget, 32 tokens, fp32):
    46% -> 80% at 12 steps on an H200 (50 held-out), 38% -> 60% at 8 steps on 2 loaded CPU
    cores (40 held-out). This test on 2 CPU cores at load average ~10: 40% -> 75%, 7.5 min."""
    m = run_bench(tmp_path, "--tasks", "products", "--methods", "base,fgrpo", "--eval-prompts", "20",
                  "--eval-k", "1", "--eval-tokens", "16", "--fgrpo-steps", "6", "--set", "fgrpo.max_new_tokens=16",
                  "--max-run-s", "1500")
    assert m["base"]["prompts"] == m["fgrpo"]["prompts"] == 20
    assert m["fgrpo"]["success_rate"] >= m["base"]["success_rate"] + 0.15


@pytest.mark.slow
def test_essa_with_the_gold_fitness_improves_on_its_warm_start(tmp_path):
    """products again, essa-quickstart's warm start (6 SFT steps) and 12 generations ranked by
    the gold answer's log-probability (essa.fitness: gold_logprob). Measured with the bench
    on an H200 (50 held-out, fp32, 20 generations): 42% -> 72%. This test on 2 CPU cores at
    load average 4-10: 50% -> 70%, 9.8 min."""
    m = run_bench(tmp_path, "--tasks", "products", "--methods", "essa", "--eval-prompts", "30", "--eval-k", "1",
                  "--eval-tokens", "16", "--essa-generations", "12", "--set", "essa.fitness=gold_logprob",
                  "--max-run-s", "1800")
    assert m["essa"]["prompts"] == m["essa_warm_start"]["prompts"] == 30
    assert m["essa"]["success_rate"] >= m["essa_warm_start"]["success_rate"] + 0.1


def test_jobs_run_side_by_side_and_the_deadline_keeps_what_finished(tmp_path, monkeypatch):
    """--jobs: one process per (task, method), their reports merged in the script's task
    and method order; at --deadline-s the ones still running (here: a child that sleeps,
    with a grandchild) are stopped and named in the report."""
    import sys

    bench = load_bench()
    part = toy_result()
    child = (
        "import json, subprocess, sys, time, pathlib\n"
        "task, method, out = sys.argv[1], sys.argv[2], pathlib.Path(sys.argv[3])\n"
        "if method == 'grpo':\n"
        "    g = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])\n"
        "    (out.parent / f'grandchild-{task}').mkdir(parents=True, exist_ok=True)\n"
        "    (out.parent / f'grandchild-{task}' / 'pid').write_text(str(g.pid))\n"
        "    time.sleep(60)\n"
        "r = json.loads(sys.argv[4])\n"
        "t = dict(r['tasks'][0], task=task, kept_aside=task == 'products', methods={method: {'success_rate': 0.5}})\n"
        "out.mkdir(parents=True, exist_ok=True)\n"
        "(out / 'learning.json').write_text(json.dumps(dict(r, tasks=[t])))\n"
    )
    monkeypatch.setattr(bench, "child_args", lambda a, t, m, out, work: [sys.executable, "-c", child, t, m, str(out),
                                                                         json.dumps(part)])
    t0 = __import__("time").time()
    assert bench.main(["--tasks", "products,chain_sum", "--methods", "sft,grpo,base", "--jobs", "4",
                       "--deadline-s", "8", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    assert __import__("time").time() - t0 < 40  # the sleepers (60 s) were stopped, not waited for
    result = json.loads((tmp_path / "out" / "learning.json").read_text())
    assert [t["task"] for t in result["tasks"]] == ["products", "chain_sum"]
    assert all(sorted(t["methods"]) == ["base", "sft"] for t in result["tasks"])
    assert result["not_finished"] == ["products grpo", "chain_sum grpo"]
    md = (tmp_path / "out" / "learning.md").read_text()
    assert "Not finished by the deadline (stopped): products grpo, chain_sum grpo." in md
    for task in ("products", "chain_sum"):  # the stopped jobs' own children were taken too
        pid = int((tmp_path / "work" / "parts" / f"grandchild-{task}" / "pid").read_text())
        assert not _alive(pid), pid


def _alive(pid: int) -> bool:
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    status = open(f"/proc/{pid}/stat").read().split(")")[-1].split()[0]
    return status != "Z"  # a zombie waits for its reaper, it does not run


def test_a_command_past_its_limit_gets_ctrl_c_twice(tmp_path):
    """--max-run-s ends `edgetune train` as a user would: Ctrl-C (a graceful stop), then
    Ctrl-C again (the CLI kills its run's worker, which has a session of its own and would
    otherwise train on). Here a stand-in for the CLI records what it got."""
    import signal
    import sys
    import time

    bench = load_bench()
    cli = tmp_path / "cli.py"
    cli.write_text(
        "import pathlib, sys, time\n"
        "got = pathlib.Path(sys.argv[1])\n"
        "try:\n"
        "    time.sleep(60)\n"
        "except KeyboardInterrupt:\n"
        "    got.write_text('stop')\n"
        "    try:\n"
        "        time.sleep(60)\n"
        "    except KeyboardInterrupt:\n"
        "        got.write_text('stop, kill')\n"
        "        sys.exit(130)\n")
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)  # as in a bench started with `&`
    try:
        t0 = time.time()
        rc, secs = bench.run_cmd([sys.executable, str(cli), str(tmp_path / "got")], tmp_path / "cli.log", 1.5)
    finally:
        signal.signal(signal.SIGINT, old)
    assert rc == 124 and (tmp_path / "got").read_text() == "stop, kill"
    assert time.time() - t0 < 20


def test_held_out_points_while_training_are_read_reported_and_plotted(tmp_path):
    """--curve-every: the runs' eval events (F-GRPO: success_rate and pass@k; ESSA: the
    exported point's greedy reward) become held-out points of the curve, a line of the
    report and a third row of plots."""
    bench = load_bench()
    run = tmp_path / "run"
    run.mkdir()
    events = [{"type": "eval", "step": 0, "success_rate": 0.1, "reward": 0.1, "pass@1": 0.05, "pass@4": 0.2},
              {"type": "step", "step": 1, "reward_mean": 0.3, "truncated": 0.5},
              {"type": "sample", "step": 1, "completion": "x"},
              {"type": "eval", "step": 1, "success_rate": 0.4, "reward": 0.4, "pass@1": 0.3, "pass@4": 0.6}]
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    assert bench.curve(run) == [{"step": 0, "held_out": 0.1, "pass@1": 0.05, "pass@4": 0.2},
                                {"step": 1, "reward_mean": 0.3, "truncated": 0.5},
                                {"step": 1, "held_out": 0.4, "pass@1": 0.3, "pass@4": 0.6}]
    (run / "events.jsonl").write_text(json.dumps({"type": "eval", "step": 5, "reward": 0.25, "candidate": "mean"}) + "\n")
    assert bench.curve(run) == [{"step": 5, "held_out": 0.25}]

    result = toy_result()
    methods = result["tasks"][0]["methods"]
    methods["fgrpo"]["curve"] += [{"step": 0, "held_out": 0.12, "pass@4": 0.3}, {"step": 8, "held_out": 0.5, "pass@4": 0.7}]
    methods["essa"] = {"success_rate": 0.6, "curve": [{"step": 0, "held_out": 0.55}, {"step": 4, "held_out": 0.6}]}
    bench.write_report(result, tmp_path / "with")
    md = (tmp_path / "with" / "learning.md").read_text()
    assert "- chain_sum F-GRPO: 0: 12% (30%), 8: 50% (70%)" in md and "- chain_sum ESSA: 0: 55%, 4: 60%" in md
    bench.write_report(toy_result(), tmp_path / "without")
    assert "while training" not in (tmp_path / "without" / "learning.md").read_text()
    from PIL import Image

    with Image.open(tmp_path / "with" / "learning.png") as a, Image.open(tmp_path / "without" / "learning.png") as b:
        assert a.size[0] == b.size[0] and a.size[1] > 1.4 * b.size[1]  # three rows of plots, not two


def test_curve_every_gives_rl_and_essa_runs_the_held_out_split(tmp_path, monkeypatch):
    """The settings --curve-every adds to the training commands (and passes to --jobs children)."""
    bench = load_bench()
    seen = []

    def fake_run_cmd(args, log, timeout):
        seen.append(args)
        return 1, 0.0  # "failed": nothing is evaluated afterwards

    monkeypatch.setattr(bench, "run_cmd", fake_run_cmd)
    a = bench.parse_args(["--tasks", "gcd", "--methods", "fgrpo,essa", "--curve-every", "4", "--eval-prompts", "7"])
    data = bench.write_task_data("gcd", tmp_path / "data", 20, 7, 0)
    bench.bench_task("gcd", a, data, tmp_path, lambda m: None, lambda r: None)
    fg, es = [" ".join(x) for x in seen]
    assert f"data.eval_path={data['eval_rl']}" in fg and "fgrpo.eval_every=4" in fg and "fgrpo.eval_prompts=7" in fg
    assert "essa.eval_every=4" in es and "essa.eval_prompts=7" in es and "essa.eval_prompts=0" not in es
    child = bench.child_args(a, "gcd", "essa", tmp_path / "o", tmp_path / "w")
    assert child[child.index("--curve-every") + 1] == "4"
