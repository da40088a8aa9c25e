"""A run's folder on disk, and writing into it so that a crash never leaves half a file.

    runs/<name>/
      config.yaml          fully resolved settings (engine/core/settings/)
      events.jsonl         everything the run reported (engine/core/events.py)
      worker.pid           the worker process while it lives
      worker.log           the worker's stdout/stderr (tracebacks of bugs go here)
      memory.json          live memory gauge, rewritten every second while the worker lives
      inputs.json          checksums of the data and base files the run trains on (record_inputs)
      queue-job            a queued run's job token (engine/run/queue.py): the proof that the job started
      STOP                 present = stop gracefully after the current step
      checkpoints/step-N/  adapter + optimizer + scheduler + RNG state
      adapter/             the final adapter (PEFT format, tokenizer, model card)

Every file is written to a temporary name in the same folder and renamed into place;
folders (the run folder itself, checkpoints, adapter) are built under a temporary name and
renamed whole.
Nothing in a run folder is a symbolic link: a run folder that holds one (copied from
elsewhere, or planted) is refused before a worker writes into it, and the files a run
appends to are opened without following links.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import shutil
import signal
import tempfile
import time
from pathlib import Path

from edgetune.engine.core.errors import ConfigError, RunError
from edgetune.engine.core.methods import METHODS as RECORDS


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        raise


@contextlib.contextmanager
def atomic_dir(path: str | os.PathLike):
    """Yield a temporary folder; on success it replaces `path` in one rename."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp"))
    try:
        yield tmp
        if path.exists():
            old = path.with_name(f".{path.name}.old-{time.time_ns()}")
            os.replace(path, old)
            os.replace(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


LOG_TAIL_BYTES = 65536  # how much of the end of worker.log is read for its last line


def exit_words(code: int) -> str:
    """A process's exit as a user reads it: `exit status 3`, `killed by signal 4 (SIGILL)`."""
    if code >= 0:
        return f"exit status {code}"
    try:
        return f"killed by signal {-code} ({signal.Signals(-code).name})"
    except ValueError:
        return f"killed by signal {-code}"


class RunDir:
    def __init__(self, path: str | os.PathLike):
        self.path = Path(path)

    # -- layout
    @property
    def name(self) -> str:
        return self.path.name

    @property
    def config_path(self) -> Path:
        return self.path / "config.yaml"

    @property
    def events_path(self) -> Path:
        return self.path / "events.jsonl"

    @property
    def pid_path(self) -> Path:
        return self.path / "worker.pid"

    @property
    def log_path(self) -> Path:
        return self.path / "worker.log"

    @property
    def memory_path(self) -> Path:
        return self.path / "memory.json"

    @property
    def queue_job_path(self) -> Path:
        return self.path / "queue-job"

    def queue_job(self) -> str | None:
        """The token of the queued job that made this run folder, or None."""
        try:
            return self.queue_job_path.read_text().strip() or None
        except (OSError, UnicodeDecodeError):
            return None

    @property
    def stop_path(self) -> Path:
        return self.path / "STOP"

    @property
    def checkpoints(self) -> Path:
        return self.path / "checkpoints"

    @property
    def adapter(self) -> Path:
        return self.path / "adapter"

    def checkpoint(self, step: int) -> Path:
        return self.checkpoints / f"step-{step}"

    # -- state
    def stop_requested(self) -> bool:
        return self.stop_path.exists()

    def request_stop(self) -> None:
        atomic_write_text(self.stop_path, str(time.time()))

    def clear_stop(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            self.stop_path.unlink()

    def list_checkpoints(self) -> list[tuple[int, Path]]:
        if not self.checkpoints.is_dir():
            return []
        out = []
        for p in self.checkpoints.iterdir():
            if p.is_dir() and p.name.startswith("step-") and p.name[5:].isdigit():
                out.append((int(p.name[5:]), p))
        return sorted(out)

    def last_checkpoint(self) -> tuple[int, Path] | None:
        cps = self.list_checkpoints()
        return cps[-1] if cps else None

    def prune_checkpoints(self, keep: int) -> None:
        if keep <= 0:
            return
        for _, p in self.list_checkpoints()[:-keep]:
            shutil.rmtree(p, ignore_errors=True)

    def last_log_line(self, start: int = 0, width: int = 300) -> str:
        """The last line with text in worker.log from byte `start` on (a progress bar's
        carriage returns split lines too), shortened to `width` characters; "" without one."""
        try:
            with open(self.log_path, "rb") as f:
                end = f.seek(0, os.SEEK_END)
                f.seek(max(start, end - LOG_TAIL_BYTES))
                text = f.read().decode("utf-8", "replace")
        except OSError:
            return ""
        line = next((ln.strip() for ln in reversed(re.split(r"[\r\n]+", text)) if ln.strip()), "")
        return line if len(line) <= width else line[: width - 1] + "…"

    def read_pid(self) -> int | None:
        try:
            return int(self.pid_path.read_text().strip())
        except (FileNotFoundError, ValueError):
            return None

    def require(self) -> "RunDir":
        if not self.config_path.is_file():
            raise RunError(f"not a run folder (no config.yaml): {self.path}")
        return self

    def refuse_links(self) -> "RunDir":
        """Refuse, naming it, a symbolic link anywhere in the run folder: a worker appends to
        events.jsonl and worker.log and writes checkpoints/ and adapter/, and through a link
        it would write (or prune) wherever the link points."""
        link = find_link(self.path)
        if link is not None:
            raise RunError(f"{link}: a symbolic link inside the run folder (to {os.readlink(link)}); a run "
                           "writes only its own files: replace the link with the file itself, or start a new run")
        return self


def find_link(folder: str | os.PathLike) -> Path | None:
    """The first symbolic link in `folder`'s tree (links are not followed), or None."""
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in sorted(dirnames + filenames):
            p = Path(dirpath) / name
            if p.is_symlink():
                return p
    return None


def open_append(path: str | os.PathLike):
    """`path` opened for appending (and reading), never through a symbolic link."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunError(f"{path}: a symbolic link; a run writes only its own files, never through a link") \
                from None
        raise
    return os.fdopen(fd, "a+b")


def checkpoint_mismatch(cfg, checkpoint: str | os.PathLike,
                        config_path: str | os.PathLike = "config.yaml") -> str | None:
    """One line naming the first setting of `cfg` that differs from what the checkpoint was
    trained with (method, the adapter's shape), or None when they agree. Reads only JSON."""
    import json

    ck = Path(checkpoint)
    try:
        adapter = json.loads((ck / "adapter_config.json").read_text())
        info = json.loads((ck / "edgetune.json").read_text()) if (ck / "edgetune.json").is_file() else {}
    except (OSError, ValueError):
        return None  # a damaged checkpoint: picking one (engine/training/loop.py) names what is wrong with it
    if not isinstance(adapter, dict) or not isinstance(info, dict):
        return None
    theirs = [("method", cfg.method, info.get("method"))]
    # The adapter's shape is lora.*'s unless it comes from another adapter (lora.init_from,
    # ESSA's warm start): then that adapter decides it, and the settings are not compared.
    if not RECORDS[cfg.method].warm_start and not cfg.lora.init_from:
        theirs += [("lora.r", cfg.lora.r, adapter.get("r")), ("lora.alpha", cfg.lora.alpha, adapter.get("lora_alpha")),
                   ("lora.dropout", cfg.lora.dropout, adapter.get("lora_dropout"))]
    if len(theirs) > 1 and isinstance(cfg.lora.target_modules, (list, tuple)) \
            and isinstance(adapter.get("target_modules"), list):
        theirs.append(("lora.target_modules", sorted(cfg.lora.target_modules), sorted(adapter["target_modules"])))
    for name, ours, saved in theirs:
        if saved is not None and ours != saved:
            return (f"{config_path}: {name} is {ours}, but checkpoint {ck.name} was trained with {saved}; set it "
                    f"back to {saved} to resume, or start a new run with the new value")
    return None


# --------------------------------------------------------------------------- what a run trained on

INPUTS_FILE = "inputs.json"  # in the run folder: the checksums of the files the run trained on
WHOLE_HASH_BYTES = 1 << 30  # files up to this size are hashed whole; bigger ones by size and both ends
END_BYTES = 16 << 20


def file_digest(path: Path) -> str:
    """SHA-256 of a file: of all of it up to WHOLE_HASH_BYTES; of a bigger one (a base
    model's weights), of its size and its first and last END_BYTES (`ends:` in front)."""
    import hashlib

    h = hashlib.sha256()
    size = path.stat().st_size
    with open(path, "rb") as f:
        if size <= WHOLE_HASH_BYTES:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
            return h.hexdigest()
        h.update(str(size).encode())
        h.update(f.read(END_BYTES))
        f.seek(size - END_BYTES)
        h.update(f.read(END_BYTES))
    return "ends:" + h.hexdigest()


def run_inputs(cfg) -> dict[str, str]:
    """The local files a run's settings read its data and base model from (the setting that
    names each): data.path, data.eval_path, essa.warm_start_data and model.name, each a
    file or every file of a folder (embedded sets and hub ids have none). Each is named as
    the settings reach it (absolute, its links not followed): a link retargeted since is a
    change too (record_inputs keeps where each led)."""
    out: dict[str, str] = {}
    named = [("data.path", cfg.data.path), ("data.eval_path", cfg.data.eval_path), ("model.name", cfg.model.name)]
    if RECORDS[cfg.method].warm_start:
        named.append((f"{cfg.method}.warm_start_data", getattr(cfg, cfg.method).warm_start_data))
    for setting, value in named:
        if not value or str(value).startswith("embedded:"):
            continue
        p = Path(os.path.abspath(Path(value).expanduser()))
        if p.is_file():
            out[str(p)] = setting
        elif p.is_dir():
            for f in sorted(p.rglob("*"))[:10_000]:
                if f.is_file() and not any(part.startswith(".") for part in f.relative_to(p).parts):
                    out[str(f)] = setting
    return out


def record_inputs(run: RunDir, cfg) -> None:
    """Write the checksums of the run's input files into its folder (at its first start):
    of each file as its path reads now, and the file its links lead to."""
    import json

    found = {path: {"setting": setting, "target": str(Path(path).resolve()), "sha256": file_digest(Path(path))}
             for path, setting in run_inputs(cfg).items()}
    atomic_write_text(run.path / INPUTS_FILE, json.dumps(found, indent=1))


def _recorded_inputs(run: RunDir) -> tuple[dict | None, str | None]:
    """(inputs.json's entries, None), or (None, what is wrong with it)."""
    import json

    p = run.path / INPUTS_FILE
    try:
        found = json.loads(p.read_text())
    except FileNotFoundError:
        return None, "missing"
    except (OSError, ValueError, UnicodeDecodeError) as e:
        return None, f"damaged ({getattr(e, 'strerror', None) or str(e).splitlines()[0][:80]})"
    if not isinstance(found, dict) or not all(isinstance(v, dict) for v in found.values()):
        return None, "damaged (not the checksums edgetune writes)"
    return found, None


def inputs_unchecked(run: RunDir) -> str | None:
    """One line when a run's inputs.json is missing or damaged, so that what it trained on
    cannot be checked (a resume says so, and records them anew); None when it can."""
    _, problem = _recorded_inputs(run)
    if problem is None:
        return None
    return (f"{run.path / INPUTS_FILE}: {problem}, so whether the data and base files run '{run.name}' trained on "
            "changed since cannot be checked; it resumes on them as they are now (and records them for the next "
            "resume)")


def changed_input(run: RunDir, only: tuple[str, ...] = ()) -> str | None:
    """One line naming the first file a run trained on that is gone or changed since, or
    a link that leads elsewhere now (`only`: the files of these settings), or None; a run
    that recorded none has none (inputs_unchecked says so)."""
    found, _ = _recorded_inputs(run)
    for path, was in (found or {}).items():
        if only and was.get("setting") not in only:
            continue
        p = Path(path)
        target = was.get("target")
        if isinstance(target, str) and p.exists() and str(p.resolve()) != target:
            return (f"{p}: leads to {p.resolve()} now, not to {target} as when run '{run.name}' trained on it "
                    f"({was.get('setting')}); point it back, or start a new run on the new file")
        try:
            now = file_digest(p)
        except OSError:
            now = None
        if now != was.get("sha256"):
            how = "is gone" if now is None else "has changed"
            return (f"{p}: {how} since run '{run.name}' trained on it ({was.get('setting')}); put the original file "
                    "back, or start a new run on the new one")
    return None


_TEMPORARY = re.compile(r"^\..+\.(tmp|old-\d+)$")  # names atomic_write_text / atomic_dir give their temporaries


def clean_temporaries(folder: str | os.PathLike) -> list[Path]:
    """Remove what a killed write left behind (our own temporary names only, anywhere
    in the run folder); returns what was removed."""
    removed = []
    for dirpath, dirnames, filenames in os.walk(folder):
        for name in list(dirnames) + filenames:
            if _TEMPORARY.match(name):
                p = Path(dirpath) / name
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                    dirnames.remove(name)
                else:
                    p.unlink(missing_ok=True)
                removed.append(p)
    return removed


def check_run_name(name: str) -> str:
    """A run name is one path component of our own choosing: nothing is ever written
    outside the runs folder."""
    bad = (not isinstance(name, str) or not name.strip() or name in (".", "..") or name.startswith(".")
           or "/" in name or "\\" in name or "\0" in name or name != name.strip() or len(name.encode()) > 200
           or any(ord(c) < 32 for c in name))
    if bad:
        raise ConfigError(f"run.name {name!r}: give a plain folder name (letters, digits, - _ .; no '/', "
                          "no '..', not starting with '.')")
    return name


LOCK_FILE = ".edgetune.lock"


def lock_runs_folder(runs_dir: str | os.PathLike) -> int | None:
    """Take the runs folder's lock without waiting: the fd holding it, or None when
    another process holds it. A worker inherits the fd, so the lock lives exactly as long
    as the run's process (the kernel drops it when that dies, even by SIGKILL)."""
    return try_lock(Path(runs_dir) / LOCK_FILE)


def try_lock(path: Path) -> int | None:
    """Take an exclusive lock on `path` (a lock file in a runs folder, made if missing)
    without waiting: the fd holding it, or None when another process holds it."""
    import fcntl

    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise RunError(f"{path.parent}: cannot use as the runs folder ({e.strerror})") from None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    return fd


def disk_full(e: BaseException) -> bool:
    """ENOSPC, also when a library (torch's or safetensors' writer) wrapped it in its own error."""
    if isinstance(e, OSError) and e.errno == errno.ENOSPC:
        return True
    text = str(e)
    return "No space left on device" in text or "StorageFull" in text or "os error 28" in text


def cannot_write(e: BaseException) -> bool:
    """A write refused by the file system (permissions, a read-only mount), also when a
    library (torch's or safetensors' writer) wrapped it in its own error."""
    if isinstance(e, OSError) and e.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return True
    text = str(e)
    return "Permission denied" in text or "Read-only file system" in text


def pid_alive(pid: int | None) -> bool:
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its parent) is not alive for us.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return True


def process_start(pid: int) -> int | None:
    """When process `pid` started, in clock ticks since boot (/proc/PID/stat), or None when
    there is no such process."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[-1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def our_process(pid: int | None, marks: tuple[str, ...], start: int | None = None) -> bool:
    """Whether `pid`, as a file we wrote names it, is still the process we started: it lives,
    its command line holds each of `marks`, and (`start` given) it started when we recorded.
    A pid read from a file may be planted, or reused by another process since: a signal is
    sent only to a process for which this holds."""
    if not pid or not pid_alive(pid):
        return False
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().replace(b"\0", b" ").decode("utf-8", "replace")
    except OSError:
        return False
    return all(m in cmd for m in marks) and (start is None or process_start(pid) == start)
