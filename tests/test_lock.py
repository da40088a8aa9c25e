"""The tested environment's lock (.ci/lock.txt, read by dev.sh and .ci/lock.py): the check
fails on a package that differs from it, and the README names the versions it holds."""

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LOCK = ROOT / ".ci" / "lock.txt"


def lock_check(lock: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / ".ci" / "lock.py"), "check", str(lock), *args],
                          capture_output=True, text=True)


def test_the_check_passes_on_the_running_environment_and_names_what_differs(tmp_path):
    written = tmp_path / "lock.txt"
    subprocess.run([sys.executable, str(ROOT / ".ci" / "lock.py"), "write", str(written)], check=True,
                   capture_output=True)
    ok = lock_check(written)
    assert ok.returncode == 0, ok.stderr
    assert ok.stdout.startswith("resolved: torch ")
    pins = written.read_text()
    version = re.search(r"^pyyaml==(\S+)$", pins, re.M).group(1)
    (tmp_path / "older.txt").write_text(pins.replace(f"pyyaml=={version}", "pyyaml==0.0.1"))
    older = lock_check(tmp_path / "older.txt")
    assert older.returncode == 1 and f"pyyaml=={version} (the lock has 0.0.1)" in older.stderr
    (tmp_path / "less.txt").write_text(re.sub(r"^pyyaml==.*\n", "", pins, flags=re.M))
    assert "pyyaml==" + version + " (not in the lock)" in lock_check(tmp_path / "less.txt").stderr
    # a torch of the machine's own (a CUDA build) is not compared, nor what came with it
    (tmp_path / "cuda.txt").write_text(re.sub(r"^torch==.*$", "torch==0.0.1", pins, flags=re.M))
    assert lock_check(tmp_path / "cuda.txt").returncode == 1
    assert lock_check(tmp_path / "cuda.txt", "--foreign-torch").returncode == 0


def test_the_readme_names_the_locked_versions():
    pins = dict(line.split("==") for line in LOCK.read_text().splitlines() if "==" in line and line[0] != "#")
    named = re.search(r"the versions the suite passed with \(`\.ci/lock\.txt`; ([^)]*)\)",
                      " ".join((ROOT / "README.md").read_text().split()))
    assert named, "the README's first screen names the tested versions"
    for name, version in re.findall(r"(torch|transformers|PEFT|bitsandbytes|Gradio) ([\d.]+)", named.group(1)):
        assert pins[name.lower()].startswith(version + "."), (name, version, pins[name.lower()])
