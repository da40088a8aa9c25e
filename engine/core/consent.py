"""What this machine's user said yes to, kept where a runs folder cannot reach: a runs
folder may come from anywhere (copied, unpacked, shared), so what it says was queued or
allowed is never taken as the user's word. The record is a folder of this user's own,
outside every runs folder:

    $EDGETUNE_STATE_DIR, else $XDG_STATE_HOME/edgetune, else ~/.local/state/edgetune
        queued/<sha256>   one empty file for each job this user queued (engine/run/queue.py)

A job is recorded by the checksum of everything that decides what it runs (its command,
the folder it runs in, its settings' text), so a job edited in the queue file afterwards,
or one planted there, matches no record.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

STATE_ENV = "EDGETUNE_STATE_DIR"


def state_dir() -> Path:
    if os.environ.get(STATE_ENV):
        return Path(os.environ[STATE_ENV]).expanduser()
    base = os.environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state"
    return Path(base).expanduser() / "edgetune"


def digest(what: dict) -> str:
    """The checksum of a record (a dict of JSON values, its keys in any order)."""
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()


def _path(kind: str, key: str) -> Path:
    return state_dir() / kind / key


def record(kind: str, what: dict) -> None:
    """This user said yes to `what` (a `kind` of record: `queued`)."""
    p = _path(kind, digest(what))
    p.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    p.touch()


def recorded(kind: str, what: dict) -> bool:
    return _path(kind, digest(what)).is_file()


def forget(kind: str, what: dict) -> None:
    try:
        _path(kind, digest(what)).unlink()
    except OSError:
        pass
