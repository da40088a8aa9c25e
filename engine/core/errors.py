"""User-facing errors: one line that names the thing and the problem.

The CLI prints `error: <message>` and exits 2; the app shows the message; a worker
writes it as an `error` event. Anything that is not an `EdgetuneError` is a bug and
keeps its traceback (in the run's `worker.log`, never in the UI).
"""


class EdgetuneError(Exception):
    """A problem with the user's input or environment, explained in one line."""


class ConfigError(EdgetuneError):
    pass


class ModelError(EdgetuneError):
    pass


class DataError(EdgetuneError):
    def __init__(self, message: str, file: str | None = None, row: int | None = None):
        where = file or ""
        if row is not None:
            where = f"{where}, row {row}" if where else f"row {row}"
        super().__init__(f"{where}: {message}" if where else message)
        self.file, self.row, self.problem = file, row, message


class RunError(EdgetuneError):
    pass


class CheckpointError(RunError):
    """A checkpoint that is missing, truncated, or holds more than tensors and numbers."""


def reason_line(text: str, limit: int = 200) -> str:
    """The first line of a library's message, for a one-line reason: whole when it fits,
    else cut after its last whole sentence (or word) within `limit` characters, marked "…",
    never mid-word or inside a `quoted name`."""
    line = (str(text).strip().splitlines() or [""])[0].strip()
    if len(line) <= limit:
        return line
    head = line[:limit]
    ends = [head.rfind(mark) + 1 for mark in (". ", "; ", ": ")]
    cut = max(ends) if max(ends) > limit // 3 else head.rfind(" ")
    head = head[:cut if cut > 0 else limit].rstrip(" ;:,")
    if head.count("`") % 2:  # an unclosed `name`: end before it
        head = head[:head.rfind("`")].rstrip(" ;:,(")
    return head + " …"


def os_error_line(e: OSError) -> str:
    """An OSError as one line naming the file and the condition (a full disk, a read-only
    folder): the user's condition, never a traceback."""
    import errno

    said = {errno.ENOSPC: "no space left on the device", errno.EROFS: "the file system is read-only",
            errno.EACCES: "permission denied", errno.EDQUOT: "the disk quota is used up",
            errno.EXDEV: "it lies on another file system"}.get(e.errno, e.strerror or str(e))
    where = " -> ".join(str(f) for f in (e.filename, e.filename2) if f)
    return f"{where}: {said}" if where else said


def os_errors_as_run_errors(fn):
    """`fn`, whose OSError (a full disk, a read-only folder) is a one-line RunError."""
    import functools

    @functools.wraps(fn)
    def wrapped(*args, **kwargs):
        try:
            return fn(*args, **kwargs)
        except OSError as e:
            raise RunError(os_error_line(e)) from None

    return wrapped
