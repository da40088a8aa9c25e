"""`edgetune eval`: the base and adapters graded on the same tasks."""

from __future__ import annotations

import contextlib
import json
import sys

from tqdm import tqdm

from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine.run import harness
from edgetune.engine.run.eval_tasks import size_line

from edgetune.engine.cli.common import config_args, config_from, run_arg
from edgetune.engine.cli.tables import eval_table


class _Above:
    """A stream whose lines are written above a tqdm bar (tqdm.write) instead of after it."""

    def __init__(self, bar):
        self.bar, self.part = bar, ""

    def write(self, text: str) -> int:
        *lines, self.part = (self.part + text).split("\n")
        for line in lines:
            self.bar.write(line, file=sys.__stderr__)
        return len(text)

    def flush(self) -> None:
        pass


def cmd_eval(a) -> int:
    from transformers.utils import logging as hf_logging  # lazy: transformers takes seconds to import

    from edgetune.engine.run import evaluation  # lazy: it imports torch

    hf_logging.disable_progress_bar()  # one bar here: ours
    cfg = config_from(a)
    tasks = list(dict.fromkeys(a.task or [evaluation.HELD_OUT]))
    harness.confirm_code(tasks, a.allow_code or (), how="add")  # a task file that runs Python: the user's word
    rows = evaluation.check_tasks(cfg, tasks)  # a task that cannot be graded: its one line, before loading
    systems = [(name, run_arg(path, a.runs_dir) if path else "")
               for name, path in evaluation.system_names(a.adapter or [], a.base)]
    if not systems:
        raise EdgetuneError("nothing to evaluate: give --adapter RUN (repeatable) and/or --base")
    for task, task_rows in rows.items():  # how much it generates, before it starts
        print(size_line(cfg, task, len(task_rows), len(systems)), file=sys.stderr)
    bar = tqdm(total=None, unit="item", dynamic_ncols=True, disable=a.json, desc="loading the model",
               bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}| {elapsed}")

    def tick(name: str, i: int, task: str, done: int, total: int) -> bool:
        if bar.total != total or done < bar.n:
            bar.reset(total=total)
        bar.n = done
        task_part = f", {task}" if len(tasks) > 1 else ""
        bar.set_description_str(f"{name} ({i + 1}/{len(systems)}{task_part}): evaluating", refresh=False)
        bar.refresh()
        return False

    try:
        with contextlib.redirect_stderr(_Above(bar)):  # the engine's notes above the bar, never glued to it
            result = evaluation.compare(cfg, systems, tasks, progress=tick)
    finally:
        bar.close()
    print(json.dumps(result, indent=2) if a.json else eval_table(result))
    return 0


def add_parser(sub) -> None:
    """`edgetune eval`'s flags."""
    ev = sub.add_parser("eval", help="the base and adapters on the same tasks: scores with 95%% intervals, "
                                     "paired comparisons")
    config_args(ev)
    ev.add_argument("--adapter", action="append",
                    help="an adapter folder, a run folder or a run name as `edgetune runs` prints it (repeatable; "
                         "'' = the base)")
    ev.add_argument("--base", action="store_true", help="grade the base model too (the adapter off)")
    ev.add_argument("--task", action="append", metavar="TASK",
                    help="what to grade on (repeatable; default held-out): held-out = the config's held-out split "
                         "(generated and graded by its reward; SFT: the loss of its held-out demonstrations); a "
                         "JSONL/CSV/Parquet file of prompt + answer or chat rows, graded by the config's reward "
                         "with its chat template, system prompt and seed; lm:TASK = EleutherAI's lm-evaluation-harness "
                         "on the loaded model (a shipped task, lm:path/to/task.yaml or lm:path/to/folder of YAMLs; "
                         "pip install 'edgetune[harness]')")
    ev.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    ev.add_argument("--allow-code", action="append", metavar="TASK_OR_FILE",
                    help="a harness task of one's own (lm:PATH: give PATH) or the Python file whose `!function` it "
                         "imports: run that Python (a task YAML that runs Python is refused without it)")
    ev.add_argument("--json", action="store_true",
                    help="scores, intervals, per-prompt outcomes and comparisons as JSON, no progress bar")
    ev.set_defaults(fn=cmd_eval)
