"""Verifiable rewards for F-GRPO and ESSA: score completions against a row's gold answer.

`build_reward(spec, reward_file)` turns the settings' `reward` (a name, or a mapping
{name: weight, ...} summed with those weights) into a `Reward`, called as

    rewards, errors = fn(completions, rows, truncated=None)

one float and one error message (or None) per completion. `truncated[i]` says the
completion hit the token cap without reaching EOS (rollouts.RolloutBatch.truncated).

Built-ins (each one row at a time, no model calls: scoring costs microseconds next to
generation, so nothing here is batched or cached beyond the parsed user module):

- `math`          math-verify: parse gold and completion, check equivalence (1/0)
- `exact`         completion.strip() == answer.strip()
- `normalized`    same after lower-casing, collapsing whitespace, dropping a final period
- `last_number`   the last number in the completion equals the gold number (1/0)
- `answer_format` an "Answer: ..." line is present and the completion ended at EOS
- `length_penalty[:N]`  -min(1, chars / N), N = 512 by default; a shaping term
- `rg:<task>`     reasoning-gym's grader for <task> on the *extracted* answer, counted
                  only at full credit: its default grader gives len(gold)/len(text)
                  whenever the gold string appears anywhere, which a policy can farm
- `file`          the user's `def reward(completion, answer, row) -> float`, loaded
                  only from the local path in `reward_file`: it is ordinary Python run
                  with the user's rights, so only point it at code you trust. It runs
                  in a process of its own (engine/training/reward_worker.py), killed when a
                  call runs over USER_REWARD_TIMEOUT_S. An exception, a NaN or a
                  timeout costs that completion reward 0 and an error message; a run
                  of USER_REWARD_MAX_CONSECUTIVE_FAILURES such failures, or a call of
                  sys.exit, stops the run

Success (what p̂ in F-GRPO's focal weight and pass@k count) is `Reward.success`: with no
threshold, a completion succeeds when every non-shaping part reaches its best value
(for one 0/1 reward: reward == 1); with a threshold, when the weighted sum reaches it.
"""

from __future__ import annotations

import difflib
import math
import os
import pickle
import re
import select
import signal
import subprocess
import sys
import threading
import time
import uuid
import weakref
from dataclasses import dataclass, field
from fractions import Fraction
from pathlib import Path
from typing import Any, Callable

from edgetune.engine.core.errors import ConfigError, reason_line

from edgetune.engine.training.reward_worker import HEADER, one_line, send

# One row's score: (completion, row, truncated) -> float. Raising is allowed: the caller
# turns the exception into reward 0 and an error message for that completion.
ScoreOne = Callable[[str, dict, bool], float]


@dataclass
class Part:
    name: str
    score: ScoreOne
    best: float  # highest value the part can give
    shaping: bool = False  # not a correctness check (ignored by `success`)


@dataclass
class Scores:
    rewards: list[float]
    errors: list[str | None]
    success: list[bool]
    parts: dict[str, list[float]] = field(default_factory=dict)


class Reward:
    """A weighted sum of parts; `fn(completions, rows, truncated)` -> (rewards, errors)."""

    def __init__(self, parts: list[tuple[Part, float]], name: str):
        self.parts = parts
        self.name = name
        self.best = sum(w * p.best if w > 0 else 0.0 for p, w in parts)

    def score(self, completions: list[str], rows: list[dict], truncated: list[bool] | None = None,
              threshold: float | None = None) -> Scores:
        if len(completions) != len(rows):
            raise ValueError(f"{len(completions)} completions but {len(rows)} rows")
        truncated = list(truncated) if truncated is not None else [False] * len(completions)
        totals = [0.0] * len(completions)
        errors: list[str | None] = [None] * len(completions)
        reached = [True] * len(completions)
        parts: dict[str, list[float]] = {}
        for part, weight in self.parts:
            values = []
            for i, (text, row) in enumerate(zip(completions, rows)):
                try:
                    v = float(part.score(text, row, bool(truncated[i])))
                    if not math.isfinite(v):
                        raise ValueError(f"returned {v}")
                except RewardFailing:
                    raise
                except Exception as e:  # noqa: BLE001 - a bad completion or user code must not end the run
                    v = 0.0
                    msg = one_line(f"{part.name}: {describe(e)}")
                    errors[i] = msg if errors[i] is None else f"{errors[i]}; {msg}"
                values.append(v)
                totals[i] += weight * v
                if not part.shaping and weight != 0 and v < part.best:
                    reached[i] = False
            parts[part.name] = values
            worker = getattr(part.score, "worker", None)
            if worker is not None:  # what the user's function left running ends with this batch
                worker.end_step()
        if threshold is None:
            success = reached
        else:
            success = [t >= threshold for t in totals]
        return Scores(totals, errors, success, parts)

    def __call__(self, completions: list[str], rows: list[dict], truncated: list[bool] | None = None):
        s = self.score(completions, rows, truncated)
        return s.rewards, s.errors

    def __repr__(self) -> str:
        return f"Reward({self.name})"


# --------------------------------------------------------------------------- text parsing

_NUMBER = re.compile(r"(?<![\d.])-?\d+(?:,\d{3})*(?:\.\d+)?")
_ANSWER_LINE = re.compile(r"answer\s*(?:is)?\s*[:=]\s*(.+)", re.IGNORECASE)


def _gold(row: dict) -> str:
    if "answer" not in row:
        raise KeyError("row has no 'answer'")
    return str(row["answer"])


def numbers(text: str) -> list[Fraction]:
    """Every number in the text, in order; '1,234' is one number, a '-' glued to the
    digits (and not to a preceding digit, as in '7-3') is a sign."""
    text = text.replace("\u2212", "-")
    return [Fraction(m.group(0).replace(",", "")) for m in _NUMBER.finditer(text)]


def parse_number(text: str) -> Fraction | None:
    """The number a gold answer states ('7', '-4', '1,000', '2.50'), else None."""
    s = text.strip().replace("\u2212", "-").rstrip(".")
    m = _NUMBER.fullmatch(s)
    return Fraction(m.group(0).replace(",", "")) if m else None


def normalize(text: str) -> str:
    s = " ".join(text.strip().lower().split())
    return s[:-1].rstrip() if s.endswith(".") else s


def answer_line(text: str) -> str | None:
    """The text after the last 'Answer:' (or 'answer is:'), up to the end of its line."""
    found = _ANSWER_LINE.findall(text)
    return found[-1].strip() if found else None


# --------------------------------------------------------------------------- built-ins


def _exact(text: str, row: dict, truncated: bool) -> float:
    return float(text.strip() == _gold(row).strip())


def _normalized(text: str, row: dict, truncated: bool) -> float:
    return float(normalize(text) == normalize(_gold(row)))


def _last_number(text: str, row: dict, truncated: bool) -> float:
    gold = parse_number(_gold(row))
    if gold is None:
        raise ValueError(f"gold answer {_gold(row)!r} is not a number")
    found = numbers(text)
    return float(bool(found) and found[-1] == gold)


def _answer_format(text: str, row: dict, truncated: bool) -> float:
    return float(not truncated and answer_line(text) not in (None, ""))


def _math(text: str, row: dict, truncated: bool) -> float:
    from math_verify import parse, verify

    # math-verify's timeouts use SIGALRM, which only the main thread may set.
    timeout = 5 if threading.current_thread() is threading.main_thread() else None
    gold = _gold(row)
    gold_parsed = parse(gold if "$" in gold or "\\" in gold else f"${gold}$", parsing_timeout=timeout)
    if not gold_parsed:
        raise ValueError(f"math-verify cannot parse the gold answer {gold!r}")
    pred = parse(text, parsing_timeout=timeout)
    return float(bool(pred) and verify(gold_parsed, pred, timeout_seconds=timeout))


def _length_penalty(scale: float) -> ScoreOne:
    def score(text: str, row: dict, truncated: bool) -> float:
        return -min(1.0, len(text) / scale)

    return score


def extract_for_grader(text: str, gold: str) -> str:
    """What a reasoning-gym grader should see: the <answer> tag, else an 'Answer:' line,
    else (for a numeric gold) the last number, else the whole stripped completion."""
    from reasoning_gym.utils import extract_answer

    tagged = extract_answer(text)
    if tagged is not None:
        return tagged
    line = answer_line(text)
    if line is not None:
        return line.rstrip(".").strip()
    if parse_number(gold) is not None:
        found = _NUMBER.findall(text.replace("\u2212", "-"))
        if found:
            return found[-1].replace(",", "")
    return text.strip()


def _reasoning_gym(task: str) -> ScoreOne:
    import reasoning_gym

    known = sorted(reasoning_gym.factory.DATASETS)
    if task not in known:
        near = difflib.get_close_matches(task, known, n=1, cutoff=0.5)
        hint = f" (did you mean 'rg:{near[0]}'?)" if near else ""
        raise ConfigError(f"reward 'rg:{task}': reasoning-gym has no task '{task}'{hint}")
    grade = reasoning_gym.get_score_answer_fn(task)

    def score(text: str, row: dict, truncated: bool) -> float:
        gold = _gold(row)
        entry = {"question": row.get("prompt", ""), "metadata": row.get("metadata") or {}, **row, "answer": gold}
        # Only full credit counts: partial credit rewards text that merely contains the gold.
        return float(grade(extract_for_grader(text, gold), entry) >= 1.0)

    return score


def load_user_reward(path: str) -> ScoreOne:
    """`def reward(completion, answer, row) -> float` from a local .py file, run in its own
    process (engine/training/reward_worker.py) so that the time limit holds whatever the code does."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise ConfigError(f"reward_file not found: {path}")
    worker = UserRewardProcess(str(p), path)
    worker.start()  # import errors are reported now, before any model loads
    failures = [0, ""]  # consecutive failures, the last one's message

    def score(text: str, row: dict, truncated: bool) -> float:
        try:
            v = worker.call(text, row.get("answer"), row, USER_REWARD_TIMEOUT_S)
            if not math.isfinite(v):
                raise ValueError(f"returned {v}")
        except RewardFailing:
            raise
        except Exception as e:  # noqa: BLE001 - counted here, reported per completion by Reward.score
            failures[0] += 1
            failures[1] = reason_line(describe(e))
            if failures[0] >= USER_REWARD_MAX_CONSECUTIVE_FAILURES:
                raise RewardFailing(f"reward_file {path}: failed on {failures[0]} completions in a row "
                                    f"(last: {failures[1]}); fix it, then edgetune resume the run") from None
            raise
        failures[0] = 0
        return v

    score.worker = worker  # type: ignore[attr-defined]  (tests, and close() when done)
    return score


# A user reward that errs, hangs or returns NaN costs its completion reward 0 and an error
# message; this many in a row means the function is broken, not the completions, and the
# run stops (its checkpoints stay) rather than train on zeros.
USER_REWARD_TIMEOUT_S = 10.0
USER_REWARD_MAX_CONSECUTIVE_FAILURES = 32
# Starting the reward process includes importing the user's file and what it imports
# (sympy and the like take seconds); a file that takes longer than this is reported.
USER_REWARD_START_TIMEOUT_S = 120.0
# What the user's function (and what it starts) may print into the run's worker.log, for
# the whole run; past it one line says the rest is left out.
USER_REWARD_LOG_CAP_BYTES = 1 << 20
TOKEN_ENV = "EDGETUNE_REWARD_PROCESS"  # in the environment of a reward process and all it starts


class RewardFailing(ConfigError):
    """The user's reward function fails on every completion: stop the run."""


class UserRewardProcess:
    """The user's reward function in a child process (engine/training/reward_worker.py): `call`
    sends one completion and waits at most `timeout` seconds for its score; past that the
    process is killed (a limit the function cannot catch) and the next call starts a new
    one; a process that ends before it answers is reported at once (its pidfd), also when a
    fork of it still holds the pipe. Calls are serialised (one pipe). Whatever the function
    starts, in a session of its own too, is found (the process is their child subreaper,
    and they carry its token in their environment) and ends with it (`close`) or, when it
    outlives its call, at the end of the step (`end_step`). What they print reaches the log
    through this process, USER_REWARD_LOG_CAP_BYTES at most."""

    def __init__(self, file: str, shown: str):
        self.file, self.shown = file, shown
        self.proc: subprocess.Popen | None = None
        self.lock = threading.Lock()
        self._procs: list = []  # what the finaliser kills when this object goes away
        self._log_left = [USER_REWARD_LOG_CAP_BYTES]  # shared by every process of this reward
        self.token = uuid.uuid4().hex  # in the environment of every process it starts (TOKEN_ENV)
        self.pidfd: int | None = None  # readable once the process has ended (Linux), beside its pipe
        weakref.finalize(self, _kill_all, self._procs, self.token)

    def start(self) -> None:
        if self.pidfd is not None:
            os.close(self.pidfd)
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in sys.path if p), **{TOKEN_ENV: self.token})
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "edgetune.engine.training.reward_worker", self.file, str(os.getpid())],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, process_group=0)
        try:
            self.pidfd = os.pidfd_open(self.proc.pid)
        except (AttributeError, OSError):
            self.pidfd = None
        threading.Thread(target=_forward_capped, args=(self.proc.stderr, self._log_left, self.shown),
                         name="edgetune-reward-log", daemon=True).start()
        self._procs[:] = [self.proc]
        kind, detail = self._receive(USER_REWARD_START_TIMEOUT_S, starting=True)
        if kind != "ready":
            self.close()
            raise ConfigError(f"reward_file {self.shown}: {detail}")

    def call(self, text: str, answer, row: dict, timeout: float) -> float:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
            try:
                send(self.proc.stdin, (text, answer, row))
            except BrokenPipeError:
                self.close()
                raise RuntimeError("the reward process ended before the call") from None
            kind, detail = self._receive(timeout)
        if kind == "ok":
            return detail
        if kind == "exit":
            raise RewardFailing(f"reward_file {self.shown}: reward() called sys.exit({detail}); a reward "
                                "returns a number (raise an exception to score a completion 0)")
        raise _RewardError(detail)

    def _receive(self, timeout: float, starting: bool = False) -> tuple[str, Any]:
        """The next frame within `timeout` seconds; past it, or when the process ends, the
        process is killed and the call fails."""
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        buf = b""
        need = HEADER.size
        while len(buf) < need:
            left = deadline - time.monotonic()
            watched = [fd] if self.pidfd is None else [fd, self.pidfd]
            ready = select.select(watched, [], [], max(left, 0))[0] if left > 0 else []
            if not ready:
                self.close()
                if starting:
                    return "load_error", f"took longer than {timeout:g} s to import"
                raise TimeoutError(f"took longer than {timeout:g} s")
            # the process ended: at once, also when a fork of it still holds the pipe open
            chunk = os.read(fd, need - len(buf)) if fd in ready else b""
            if not chunk:
                code = self.proc.wait()
                self.close()
                what = f"the reward process ended (exit status {code})"
                if starting:
                    return "load_error", f"fails to load: {what}"
                raise RuntimeError(what)
            buf += chunk
            if need == HEADER.size and len(buf) >= HEADER.size:
                need = HEADER.size + HEADER.unpack(buf[:HEADER.size])[0]
        return pickle.loads(buf[HEADER.size:need])

    def close(self) -> None:
        _kill_all(self._procs, self.token)
        self.proc = None
        if self.pidfd is not None:
            os.close(self.pidfd)
            self.pidfd = None

    def end_step(self) -> None:
        """End what the function started and left running (a subprocess, a fork): the
        members of the reward process's group other than itself."""
        with self.lock:
            if self.proc is not None and self.proc.poll() is None:
                _kill_descendants(self.proc.pid, self.token)


def _descendants(root: int, token: str) -> list[int]:
    """The live processes a reward process started, however they were started (Linux: /proc):
    those under it by their parent links (it is their subreaper: an orphan of theirs
    becomes its child, in a new session too) and any whose environment carries its `token`
    (one that outlived it, adopted by init since)."""
    mark = f"{TOKEN_ENV}={token}".encode()
    parents: dict[int, int] = {}
    found: set[int] = set()
    for name in os.listdir("/proc") if os.path.isdir("/proc") else ():
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if fields[0] == "Z":
            continue
        parents[int(name)] = int(fields[1])
        try:
            with open(f"/proc/{name}/environ", "rb") as f:
                if mark in f.read().split(b"\0"):
                    found.add(int(name))
        except OSError:
            pass
    children: dict[int, list[int]] = {}
    for pid, parent in parents.items():
        children.setdefault(parent, []).append(pid)
    todo = [root]
    while todo:
        for child in children.get(todo.pop(), []):
            if child not in found:
                found.add(child)
                todo.append(child)
    found.discard(root)
    return sorted(found)


def _kill_descendants(root: int, token: str) -> None:
    """SIGKILL everything a reward process started (not itself), again while some fork
    more between two looks."""
    for _ in range(20):
        pids = _descendants(root, token)
        if not pids:
            return
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except (ProcessLookupError, PermissionError):
                pass


def _forward_capped(pipe, left: list, shown: str) -> None:
    """Copy what the reward's processes print to this process's stderr (the run's
    worker.log) while `left[0]` bytes remain; then one line, and the rest is read and
    dropped (a writer never blocks on a full pipe)."""
    out = sys.stderr
    try:
        for chunk in iter(lambda: pipe.read1(65536), b""):
            if left[0] > 0:
                part = chunk[: left[0]]
                left[0] -= len(part)
                out.write(part.decode("utf-8", "replace"))
                if left[0] <= 0:
                    out.write(f"\n[reward_file {shown}: what it prints past {USER_REWARD_LOG_CAP_BYTES:,} bytes is "
                              "left out of this log]\n")
                out.flush()
    except (OSError, ValueError):
        pass


class _RewardError(Exception):
    """The user's function raised, in its process: "Type: message" of what it raised."""


def describe(e: Exception) -> str:
    """"Type: message" of a failed score (for the user's function: of what it raised)."""
    return str(e) if isinstance(e, _RewardError) else f"{type(e).__name__}: {e}"


def _kill_all(procs: list, token: str) -> None:
    """Each reward process and what it started: that first (while the process, their
    subreaper, still holds them), then the process, then what outlived it."""
    for proc in procs:
        _kill_descendants(proc.pid, token)
        try:
            proc.kill()
        except OSError:
            pass
        proc.wait()
        _kill_descendants(proc.pid, token)
        for f in (proc.stdin, proc.stdout):
            if f is not None:
                f.close()
    procs.clear()


BUILTINS: dict[str, tuple[ScoreOne, float]] = {
    "math": (_math, 1.0),
    "exact": (_exact, 1.0),
    "normalized": (_normalized, 1.0),
    "last_number": (_last_number, 1.0),
    "answer_format": (_answer_format, 1.0),
}
KNOWN = sorted([*BUILTINS, "length_penalty", "rg:<task>", "file"])


def _part(name: str, reward_file: str) -> Part:
    name = str(name).strip()
    if name in BUILTINS:
        fn, best = BUILTINS[name]
        return Part(name, fn, best)
    if name == "length_penalty" or name.startswith("length_penalty:"):
        raw = name.partition(":")[2] or "512"
        try:
            scale = float(raw)
        except ValueError:
            raise ConfigError(f"reward '{name}': expected length_penalty:<characters>") from None
        if scale <= 0:
            raise ConfigError(f"reward '{name}': the length scale must be positive")
        return Part(name, _length_penalty(scale), 0.0, shaping=True)
    if name.startswith("rg:"):
        return Part(name, _reasoning_gym(name[3:]), 1.0)
    if name == "file":
        if not reward_file:
            raise ConfigError("reward 'file' needs reward_file: the path of a .py file with def reward(...)")
        # A user function's scale is unknown: 1 counts as success unless a threshold says otherwise.
        return Part("file", load_user_reward(reward_file), 1.0)
    near = difflib.get_close_matches(name, KNOWN, n=1, cutoff=0.5)
    hint = f" (did you mean '{near[0]}'?)" if near else f" (known: {', '.join(KNOWN)})"
    raise ConfigError(f"unknown reward '{name}'{hint}")


def build_reward(spec: Any, reward_file: str = "") -> Reward:
    """A name ('last_number'), or {name: weight, ...}; 'file' names the user's function."""
    if spec is None or spec == "":
        spec = "file" if reward_file else "last_number"
    if isinstance(spec, str):
        weights = {spec: 1.0}
    elif isinstance(spec, dict) and spec:
        weights = {}
        for name, w in spec.items():
            try:
                weights[str(name)] = float(w)
            except (TypeError, ValueError):
                raise ConfigError(f"reward '{name}': weight must be a number, got {w!r}") from None
    else:
        raise ConfigError(f"reward: expected a name or a mapping {{name: weight}}, got {spec!r}")
    if reward_file and "file" not in weights:
        raise ConfigError(f"reward_file {reward_file} is set but the reward does not use it: "
                          "set reward: file (or add file: <weight> to the mapping)")
    parts = [(_part(name, reward_file), w) for name, w in weights.items()]
    label = next(iter(weights)) if len(weights) == 1 else " + ".join(f"{w:g}*{n}" for n, w in weights.items())
    return Reward(parts, label)
