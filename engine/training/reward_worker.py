"""The process that runs the user's reward function (`reward_file`), one per reward.

engine/training/rewards.py starts it as `python -m edgetune.engine.training.reward_worker <file>` and talks
to it over its stdin / stdout in frames (a 4-byte big-endian length, then a pickle):

    worker -> trainer   ("ready", None) once the file imported and defines reward(),
                        or ("load_error", "<one line>") and the worker exits
    trainer -> worker   (completion, answer, row), one per completion
    worker -> trainer   ("ok", float) | ("error", "<Type>: <message>") | ("exit", code)

A separate process is what makes the time limit hold: the trainer kills it when a call
runs past the limit, whatever the function does (catch every exception, loop, block in C)
and starts a new one for the next call. What the function prints goes to stderr (the
run's worker.log), never into the frames. Standard library only: it starts in a fraction
of a second.
"""

from __future__ import annotations

import importlib.util
import os
import pickle
import signal
import struct
import sys
from pathlib import Path

HEADER = struct.Struct(">I")


def send(f, message) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    f.write(HEADER.pack(len(data)) + data)
    f.flush()


def receive(f):
    """The next frame from a binary file, or None at its end."""
    head = f.read(HEADER.size)
    if len(head) < HEADER.size:
        return None
    data = f.read(HEADER.unpack(head)[0])
    return pickle.loads(data)


def _die_with_parent(parent: int) -> None:
    """Linux: the kernel kills this process when the trainer dies (even by SIGKILL), so a
    reward stuck in a loop does not outlive its run; and this process is the subreaper of
    what the function starts (PR_SET_CHILD_SUBREAPER): an orphan of theirs, in a session of
    its own too, becomes its child, where the trainer finds it (rewards._descendants)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        libc.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def _reap() -> None:
    """Collect the ended processes this one adopted as their subreaper (a zombie holds its
    entry until its parent waits for it)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _one_line(e: BaseException) -> str:
    return one_line(f"{type(e).__name__}: {e}")


def one_line(text: str, width: int = 300) -> str:
    """The first line of `text`, shortened at a word boundary with " …" when longer than
    `width` (a reason is never cut mid-word)."""
    line = (text.strip().splitlines() or [""])[0]
    if len(line) <= width:
        return line
    cut = line[: width - 2].rsplit(" ", 1)[0] if " " in line[: width - 2] else line[: width - 2]
    return cut.rstrip(" ,;:") + " …"


def load(path: str):
    p = Path(path)
    name = f"edgetune_user_reward_{abs(hash(str(p.resolve())))}"
    spec = importlib.util.spec_from_file_location(name, p)
    if spec is None or spec.loader is None:
        raise ValueError("not a Python file")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
    except SystemExit as e:
        raise RuntimeError(f"fails to load: it calls sys.exit({e.code})") from None
    except BaseException as e:  # noqa: BLE001 - any import-time failure, in one line
        raise RuntimeError(f"fails to load: {_one_line(e)}") from None
    fn = getattr(module, "reward", None)
    if not callable(fn):
        raise ValueError("defines no function 'reward(completion, answer, row)'")
    return fn


def main() -> int:
    path, parent = sys.argv[1], int(sys.argv[2])
    _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's: it stops the run gracefully
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the function's prints go to the log, not into the frames
    inp = sys.stdin.buffer
    try:
        fn = load(path)
    except (RuntimeError, ValueError) as e:
        send(out, ("load_error", str(e)))
        return 1
    send(out, ("ready", None))
    me = os.getpid()
    while (request := receive(inp)) is not None:
        text, answer, row = request
        try:
            answer_ = ("ok", float(fn(text, answer, row)))
        except SystemExit as e:
            answer_ = ("exit", e.code)
        except BaseException as e:  # noqa: BLE001 - reported per completion by the trainer
            answer_ = ("error", _one_line(e))
        if os.getpid() != me:  # a fork of the function's that returned (or exited) here: it is not the worker
            os._exit(0)
        send(out, answer_)
        _reap()
    return 0


if __name__ == "__main__":
    sys.exit(main())
