"""bench/learning_search.sh: it never writes over an earlier run's reports, and names an unknown part."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent.parent / "bench" / "learning_search.sh"


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
