"""A stop asked by a signal (a terminal's Ctrl-C, a job's SIGTERM), raised as
KeyboardInterrupt in the main thread — and raised again until the command has ended.

The first KeyboardInterrupt can be lost. Raised inside a `__del__` or a weakref callback,
Python only prints it and the work goes on; raised inside a library it may come out as
another error (torch's mode stack: a RuntimeError; numpy's half-imported module: a
RecursionError) that some code catches and goes on from. So, once a stop is asked, a
timer of the process's CPU time raises it again every half second of work, wherever no
exception is being handled (the `finally` and `except` blocks that clean up run to their
end), until `ended()`. The timer counts CPU time, not wall time: math-verify's timeouts
own the wall-clock alarm, and a process that waits does no work to stop."""

from __future__ import annotations

import signal
import sys

AGAIN_EVERY_S = 0.5  # of the process's CPU time

_asked: list = []


def asked() -> bool:
    """Whether a stop has been asked of this process (an error from here on is the stop's)."""
    return bool(_asked)


def _again(signum, frame) -> None:
    if sys.exc_info()[0] is None:  # not while an error (the stop itself, most often) is being handled
        raise KeyboardInterrupt


def _first(signum, frame) -> None:
    _asked.append(signum)
    signal.signal(signum, _on_second)
    signal.signal(signal.SIGVTALRM, _again)
    signal.setitimer(signal.ITIMER_VIRTUAL, AGAIN_EVERY_S, AGAIN_EVERY_S)
    raise KeyboardInterrupt


_on_second = signal.SIG_DFL


def install(signum: int, second=signal.SIG_DFL) -> None:
    """From now on `signum` stops the command: KeyboardInterrupt in the main thread, raised
    again while the command goes on. `second`: what the same signal does after the first
    (by default it ends the process at once, as a second Ctrl-C should)."""
    global _on_second
    _on_second = second
    signal.signal(signum, _first)


def ended(signum: int, then=signal.SIG_IGN) -> None:
    """The command has heard the stop (or ended): no more raising, no stop asked any more;
    `signum` does `then` from now on."""
    _asked.clear()
    signal.setitimer(signal.ITIMER_VIRTUAL, 0)
    signal.signal(signal.SIGVTALRM, signal.SIG_IGN)  # a tick already on its way changes nothing
    signal.signal(signum, then)
    # A KeyboardInterrupt that left a string run by exec() (dataclasses and namedtuple make
    # their methods so, at import) is remembered by Python as unhandled, though it was
    # handled since, and at exit Python kills its own process with SIGINT instead of
    # returning the command's status. The next string run by exec() clears that memory.
    exec("pass")
