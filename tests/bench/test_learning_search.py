"""bench/learning_search.sh: it never writes over an earlier run's reports, and names an unknown part."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "learning_search.sh"


def _run(tmp_path, *args):
    return subprocess.run(["bash", str(SCRIPT), *args], capture_output=True, text=True, timeout=60,
                          env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work")})


def test_an_out_folder_with_reports_is_refused_untouched(tmp_path):
    out = tmp_path / "out"
    (out / "essa_linear" / "preset_seed2").mkdir(parents=True)
    (out / "essa_linear" / "preset_seed2" / "learning.md").write_text("an earlier run")
    r = _run(tmp_path, str(out), "essa_linear", "--tiny")
    assert r.returncode == 2 and "preset_seed2 exists: choose another OUT" in r.stderr
    assert (out / "essa_linear" / "preset_seed2" / "learning.md").read_text() == "an earlier run"
    assert [p.name for p in (out / "essa_linear").iterdir()] == ["preset_seed2"]
    assert not (tmp_path / "work").exists()


def test_an_unknown_part_is_named(tmp_path):
    r = _run(tmp_path, str(tmp_path / "out"), "essa_wide")
    assert r.returncode == 2 and "unknown part 'essa_wide'" in r.stderr
    assert not (tmp_path / "out").exists()


STUB = """#!/bin/bash
# stands in for python3 bench/learning.py: a report in --out, a log and events in --work
while [ $# -gt 0 ]; do case "$1" in --out) o=$2; shift;; --work) w=$2; shift;; esac; shift; done
mkdir -p "$o" "$w/runs/gcd-essa"; printf '| task | ESSA |\\n| gcd | 40%% |\\n' > "$o/learning.md"
echo trained > "$w/gcd-essa-train.log"; echo '{"type": "eval"}' > "$w/runs/gcd-essa/events.jsonl"
[ "$(basename "$o")" = preset_seed1 ] && exit 3 || exit 0
"""


def test_groups_are_waited_for_their_logs_kept_and_a_failed_one_named(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out), "essa_linear"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work"), "PYTHON": str(stub)})
    assert r.returncode == 1 and "learning_search: a group exited non-zero" in r.stderr
    assert r.stdout.count("| gcd | 40% |") == 4  # every seed's table, the failed one's too
    for s in range(4):
        logs = out / "essa_linear" / "logs" / f"preset_seed{s}"
        assert (logs / "gcd-essa-train.log").read_text() == "trained\n"
        assert (logs / "runs" / "gcd-essa" / "events.jsonl").is_file()


ARGS_STUB = """#!/bin/bash
# stands in for python3 bench/learning.py: writes the arguments it was given as its report
while [ $# -gt 0 ]; do case "$1" in --out) o=$2; shift;; esac; a="$a $1"; shift; done
mkdir -p "$o"; echo "$a" > "$o/learning.md"
"""


def test_the_3x_part_runs_each_seed_at_three_times_the_quick_starts_evaluations(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(ARGS_STUB)
    stub.chmod(0o755)
    out = tmp_path / "out"
    r = subprocess.run(["bash", str(SCRIPT), str(out), "essa_linear_3x"], capture_output=True, text=True,
                       timeout=60, env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work"),
                                        "PYTHON": str(stub), "SEEDS": "0 3"})
    assert r.returncode == 0, r.stderr
    groups = sorted(p.name for p in (out / "essa_linear_3x").iterdir() if p.is_dir() and p.name != "logs")
    assert groups == ["x3_seed0", "x3_seed3"]
    args = (out / "essa_linear_3x" / "x3_seed3" / "learning.md").read_text().split()
    setting = {args[i + 1].split("=")[0]: args[i + 1].split("=")[1] for i, a in enumerate(args) if a == "--set"}
    population, prompts = int(setting["essa.population"]), int(setting["essa.prompts_per_generation"])
    generations = int(args[args.index("--essa-generations") + 1])
    assert population * prompts * generations == 3 * 12 * 16 * 8  # the quick start: 12 x 16 prompts x 8
    assert setting["lora.target_modules"] == "all-linear" and setting["lora.r"] == "16"
    assert args[args.index("--seed") + 1] == "3" and args[args.index("--methods") + 1] == "essa"


def test_the_normalised_focal_parts_run_f_grpo_with_normalize_on_and_their_gamma(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(ARGS_STUB)
    stub.chmod(0o755)
    for part, group, gamma in (("fgrpo_norm", "norm_seed2", "1"), ("fgrpo_norm_gamma2", "norm2_seed2", "2")):
        out = tmp_path / part
        r = subprocess.run(["bash", str(SCRIPT), str(out), part], capture_output=True, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work" / part),
                                "PYTHON": str(stub), "SEEDS": "2"})
        assert r.returncode == 0, r.stderr
        args = (out / part / group / "learning.md").read_text().split()
        setting = {args[i + 1].split("=")[0]: args[i + 1].split("=")[1] for i, a in enumerate(args) if a == "--set"}
        assert setting["fgrpo.focal_normalize"] == "true" and setting["fgrpo.gamma"] == gamma
        assert args[args.index("--methods") + 1] == "fgrpo" and args[args.index("--seed") + 1] == "2"
