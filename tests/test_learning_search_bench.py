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
