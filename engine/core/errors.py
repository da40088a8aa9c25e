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
