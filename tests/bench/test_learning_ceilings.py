"""bench/learning_ceilings.sh: it never writes over an earlier run's reports."""

import subprocess
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[2] / "bench" / "learning_ceilings.sh"


def test_an_out_folder_with_reports_is_refused_untouched(tmp_path):
    out = tmp_path / "out"
    (out / "rl_long").mkdir(parents=True)
    (out / "rl_long" / "learning.md").write_text("an earlier run")
    r = subprocess.run(["bash", str(SCRIPT), str(out), "--tiny"], capture_output=True, text=True, timeout=60,
                       env={"PATH": "/usr/bin:/bin", "WORK": str(tmp_path / "work")})
    assert r.returncode == 2 and "rl_long exists: choose another OUT" in r.stderr
    assert (out / "rl_long" / "learning.md").read_text() == "an earlier run"
    assert sorted(p.name for p in out.iterdir()) == ["rl_long"] and not (tmp_path / "work").exists()
