"""Python that is not edgetune's and that a run's settings would run: a reward file (imported,
then called on every completion) and a model's own modelling code (model.trust_remote_code).
A run folder may come from anywhere, so what its settings name runs only when the user
names that same file or model (`--allow-code`); anything else is refused in one line."""

from __future__ import annotations

from pathlib import Path

from edgetune.engine.core.errors import RunError
from edgetune.engine.core.methods import METHODS as RECORDS


def code_it_runs(cfg) -> list[tuple[str, str]]:
    """(setting, file or model) for each setting of `cfg` that makes its worker run Python
    that is not edgetune's: the method's reward_file (imported, then called on every
    completion) and model.trust_remote_code (the modelling code the model ships)."""
    out = []
    group = getattr(cfg, cfg.method, None)
    if RECORDS[cfg.method].rewards and group.reward_file:
        out.append((f"{cfg.method}.reward_file", group.reward_file))
    if cfg.model.trust_remote_code:
        out.append(("model.trust_remote_code", cfg.model.name))
    return out


def _names_the_same(a: str, b: str) -> bool:
    if a == b:
        return True
    try:
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    except (OSError, RuntimeError):
        return False


def confirm_code(run, cfg, allow_code: list[str] | tuple[str, ...] = (), doing: str = "resumes",
                 command: str | None = None) -> None:
    """A run folder may come from anywhere, and resuming it (or grading it: `doing`) must
    not run Python it names unless the user named that same file (or model) too: refuse in
    one line otherwise, ending with `command` (default: the resume with --allow-code)."""
    import shlex

    path = Path(getattr(run, "path", run))
    for setting, what in code_it_runs(cfg):
        if any(_names_the_same(what, allowed) for allowed in allow_code):
            continue
        code = f"the Python file {what}" if setting.endswith("reward_file") else \
            f"the Python code that model {what} ships"
        command = command or (f"resume on the command line with: edgetune resume {shlex.quote(str(path))} "
                              f"--allow-code {shlex.quote(what)}")
        raise RunError(f"{path / 'config.yaml'}: {setting} runs {code} when this run {doing}; if you trust it, "
                       f"{command}")
