"""The tested environment as a lock: every package and version the suite last passed with.

    python .ci/lock.py check .ci/lock.txt [--foreign-torch]   # print the resolved versions; exit 1 where
                                                              # an installed package differs from the lock
    python .ci/lock.py write .ci/lock.txt                     # the running environment becomes the lock

dev.sh installs with the lock as pip constraints (`pip install -c .ci/lock.txt`), so a
fresh machine gets the versions that were tested. Each mode installs a part of it (the
app alone, the app and the tests, ... ), so `check` asks every installed package to be in
the lock at its version, not every locked package to be installed. --foreign-torch: the
environment keeps a torch of its own (a CUDA build), whose torch, triton and nvidia-*
packages are then not compared.
"""

from __future__ import annotations

import re
import sys
from importlib import metadata
from pathlib import Path

# installers and the project itself: not part of what is tested
SKIP = {"pip", "setuptools", "wheel", "edgetune"}
TORCH_BUILD = re.compile(r"^(torch|triton|nvidia-.*|cuda-.*)$")


def norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def installed() -> dict[str, str]:
    found = {}
    for dist in metadata.distributions():
        name = norm(dist.metadata["Name"] or "")
        if name and name not in SKIP:
            found[name] = dist.version.split("+")[0]  # torch's +cpu / +cu130 build label
    return found


def read(lock: Path) -> dict[str, str]:
    pins = {}
    for n, line in enumerate(lock.read_text().splitlines(), 1):
        line = line.split("#")[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            sys.exit(f"{lock}:{n}: not a `name==version` line: {line}")
        pins[norm(name)] = version.strip()
    return pins


def check(lock: Path, foreign_torch: bool) -> int:
    pins, have = read(lock), installed()
    diff = []
    for name, version in sorted(have.items()):
        if foreign_torch and TORCH_BUILD.match(name):
            continue
        if name not in pins:
            diff.append(f"  {name}=={version} (not in the lock)")
        elif pins[name] != version:
            diff.append(f"  {name}=={version} (the lock has {pins[name]})")
    key = ("torch", "transformers", "peft", "bitsandbytes", "accelerate", "triton", "gradio", "trl")
    print("resolved: " + ", ".join(f"{k} {have[k]}" for k in key if k in have)
          + f"; {len(have)} packages")
    if diff:
        print(f"error: {len(diff)} installed package(s) differ from {lock}:\n" + "\n".join(diff), file=sys.stderr)
        return 1
    print(f"every installed package is at its version in {lock}")
    return 0


def write(lock: Path) -> int:
    have = installed()
    header = ("# The tested environment (CPU, Python 3.11): what `bash dev.sh` installs, as pip constraints.\n"
              "# Written by `bash dev.sh update-lock` after the fast suite passed on these versions.\n")
    lock.write_text(header + "".join(f"{k}=={v}\n" for k, v in sorted(have.items())))
    print(f"wrote {lock}: {len(have)} packages")
    return 0


if __name__ == "__main__":
    if len(sys.argv) < 3 or sys.argv[1] not in ("check", "write"):
        sys.exit("usage: python .ci/lock.py check|write LOCK [--foreign-torch]")
    lock = Path(sys.argv[2])
    if sys.argv[1] == "write":
        sys.exit(write(lock))
    sys.exit(check(lock, "--foreign-torch" in sys.argv[3:]))
