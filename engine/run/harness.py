"""The ecosystem's standard harness as an evaluation task: `--task lm:TASK` runs EleutherAI's
lm-evaluation-harness (`lm-eval`, the optional extra `harness`) on the model the evaluation
already loaded (the 4-bit base with the adapter on a GPU, the plain model the engine loads
on a CPU), handed to it as a model object (`HFLM(pretrained=model, tokenizer=tok)`).

    lm:arc_easy                  a task the harness ships (its data from the Hugging Face hub)
    lm:path/to/task.yaml         a task YAML of your own, e.g. one that reads local files:
                                     dataset_path: json
                                     dataset_kwargs: {data_files: {test: my.jsonl}}
    lm:path/to/folder            every task YAML in the folder

Prompts are rendered as the rest of edgetune renders them: the tokenizer's chat template
(when it has one) with data.system_prompt, so an adapter is asked as it was trained. The
harness's own seeds are the config's run.seed. Each item's metric values come back from the
harness's logged samples and are scored and compared as every other task's
(engine/run/evaluation.py): a 0/1 metric as a share (Wilson interval, exact McNemar), any
other as a mean (bootstrap).

A task whose data is not on this machine and cannot be downloaded is refused in one line
naming the task and its dataset, before any model loads.

A task YAML can run Python: `!function utils.process_docs` (in it, or in a YAML it
`include:`s) imports utils.py beside that YAML. Such a task is Python the harness runs with
the user's rights, as a reward file is: it is refused in one line naming the file and the
function unless the user named the task (or the Python file) with --allow-code
(`code_it_runs`, `confirm_code`), before anything imports it.
"""

from __future__ import annotations

import logging
from pathlib import Path

from edgetune.engine.core.errors import ConfigError, reason_line

from edgetune.engine.data import prompts

from edgetune.engine.run.eval_tasks import HARNESS_PREFIX as PREFIX

INSTALL = "pip install 'edgetune[harness]'"  # what puts lm-eval on a machine without it
BATCH_SIZE = 8  # items the harness scores in one forward


def is_harness(task: str) -> bool:
    return task.startswith(PREFIX)


def _lm_eval():
    try:
        import lm_eval  # noqa: F401
    except ImportError:
        raise ConfigError(f"harness tasks need lm-eval, which is not installed: {INSTALL}") from None
    for name in ("lm-eval", "lm_eval"):  # its progress and notices: our bar says how far it got
        logging.getLogger(name).setLevel(logging.ERROR)


def task_names(task: str) -> tuple[list[str], str | None]:
    """(harness task names, the folder to index for them or None for the shipped ones) of
    an `lm:` task."""
    spec = task[len(PREFIX):]
    if not spec:
        raise ConfigError("an empty harness task: give lm:TASK, lm:path/to/task.yaml or lm:path/to/folder")
    p = Path(spec).expanduser()
    if spec.endswith((".yaml", ".yml")) or p.is_dir():
        if not p.exists():
            raise ConfigError(f"{task}: file not found")
        import yaml

        files = sorted(p.glob("*.y*ml")) if p.is_dir() else [p]
        names = []
        for f in files:
            try:
                doc = yaml.safe_load(f.read_text())
            except (OSError, yaml.YAMLError) as e:
                raise ConfigError(f"{f}: not a readable task YAML ({str(e).splitlines()[0]})") from None
            if isinstance(doc, dict) and isinstance(doc.get("task"), str):
                names.append(doc["task"])
        if not names:
            raise ConfigError(f"{task}: no task YAML there (a file with `task: NAME`)")
        return names, str(p.parent if p.is_file() else p)
    return [spec], None


MAX_YAMLS = 10_000  # task YAMLs read for !function in one folder (the harness indexes them all)


def code_it_runs(task: str) -> list[tuple[Path, str, Path]]:
    """(task YAML, function, Python file) for each `!function` the harness could import
    for an `lm:` task of one's own: in every YAML of the folder it indexes for it, and in
    every YAML those `include:`; [] for a shipped task."""
    import os

    import yaml

    names, folder = task_names(task)
    if folder is None:
        return []
    found: list[tuple[Path, str, Path]] = []

    class Loader(yaml.SafeLoader):
        pass

    def function(loader, node):
        value = loader.construct_scalar(node)
        found.append((Path(loader.name), value, Path(loader.name).parent / f"{value.rsplit('.', 1)[0]}.py"))
        return value

    Loader.add_constructor("!function", function)
    Loader.add_multi_constructor("!", lambda loader, suffix, node: None)  # other tags run nothing

    todo = [Path(dirpath) / f for dirpath, _, files in os.walk(folder) for f in sorted(files)
            if f.endswith((".yaml", ".yml"))][:MAX_YAMLS]
    seen: set[Path] = set()
    while todo:
        f = todo.pop().resolve()
        if f in seen or not f.is_file():
            continue
        seen.add(f)
        try:
            with open(f) as stream:
                loader = Loader(stream)
                loader.name = str(f)
                try:
                    doc = loader.get_single_data()
                finally:
                    loader.dispose()
        except (OSError, UnicodeDecodeError, yaml.YAMLError):
            continue  # an unreadable YAML: task_names or the harness names it
        includes = doc.get("include") if isinstance(doc, dict) else None
        for inc in [includes] if isinstance(includes, str) else includes if isinstance(includes, list) else []:
            if isinstance(inc, str):
                todo.append(Path(inc) if Path(inc).is_absolute() else f.parent / inc)
    return found


def confirm_code(tasks: list[str], allow_code: list[str] | tuple[str, ...] = (), how: str = "") -> None:
    """A harness task of one's own that runs Python is refused in one line, naming the YAML,
    the function and its file, unless `allow_code` names the task (as given after lm:) or
    that Python file. `how`: what the user does to allow it (a command line)."""
    def same(a, b) -> bool:
        try:
            return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
        except (OSError, RuntimeError):
            return False

    for task in tasks:
        if not is_harness(task):
            continue
        for yaml_file, fn, py in code_it_runs(task):
            if any(same(task[len(PREFIX):], a) or same(py, a) for a in allow_code):
                continue
            raise ConfigError(f"{yaml_file}: `!function {fn}` runs the Python file {py} when the harness loads task "
                              f"{task}; if you trust it, {how or 'add'} --allow-code {task[len(PREFIX):]}")


def _manager(folder: str | None):
    from lm_eval.tasks import TaskManager

    # A folder of one's own is indexed alone (the shipped index of ~15,000 tasks takes seconds)
    return TaskManager(include_path=folder, include_defaults=False) if folder else TaskManager()


def load_tasks(task: str) -> tuple:
    """(the TaskManager, {name: the harness's task object}) of an `lm:` task, their data
    loaded: a one-line ConfigError for an unknown task or data that is not here and
    cannot be fetched."""
    _lm_eval()
    names, folder = task_names(task)
    tm = _manager(folder)
    unknown = [n for n in names if n not in tm.all_tasks]
    if unknown:
        raise ConfigError(f"{task}: no harness task {', '.join(unknown)} (lm-eval --tasks list shows the shipped ones)")
    import datasets

    datasets.utils.logging.disable_progress_bar()
    built = {}
    for name in names:
        try:
            built.update(_flat(tm.load([name])))
        except Exception as e:  # noqa: BLE001 - the harness and datasets raise many kinds for missing data
            cfg = tm._entry(name).cfg or {}
            where = " ".join(str(x) for x in (cfg.get("dataset_path"), cfg.get("dataset_name")) if x)
            raise ConfigError(f"{task}: its data could not be loaded ({type(e).__name__}: "
                              f"{reason_line(str(e), 160)}); download the dataset {where} "
                              f"while online (HF_HUB_OFFLINE unset), or point a task YAML at local files") from None
    return tm, built


def _flat(loaded) -> dict:
    """{name: Task} of what TaskManager.load returned (groups flattened to their tasks)."""
    tasks = loaded.get("tasks", loaded) if isinstance(loaded, dict) else loaded
    return dict(tasks)


def run(cfg, model, tok, task: str, progress=None) -> list[dict]:
    """Each harness task of `task` graded on the loaded model: [{"task", "prompts",
    "per_prompt": {metric: [value of each item]}, "items": [{"prompt", "reference"}],
    "answers": [...]}], items in the harness's document order."""
    _lm_eval()
    from lm_eval import simple_evaluate
    from lm_eval.models.huggingface import HFLM

    tm, tasks = load_tasks(task)
    lm = HFLM(pretrained=model, tokenizer=tok, batch_size=BATCH_SIZE)
    total = sum(len(list(t.eval_docs)) for t in tasks.values())
    if progress is not None:
        progress(0, total)
    chat = prompts.has_template(tok)
    seed = cfg.run.seed
    from lm_eval import evaluator

    # It records the git commit of the working folder, and outside a repository git prints
    # "fatal: not a git repository" to our terminal: no commit of the user's folder is ours to record.
    evaluator.get_git_commit_hash = lambda: None
    out = simple_evaluate(model=lm, tasks=list(tasks.values()), task_manager=tm, log_samples=True, bootstrap_iters=0,
                          apply_chat_template=chat, system_instruction=(cfg.data.system_prompt or None) if chat else None,
                          random_seed=seed, numpy_random_seed=seed, torch_random_seed=seed, fewshot_random_seed=seed,
                          verbosity="ERROR")
    if progress is not None:
        progress(total, total)
    results = []
    for name in tasks:
        samples = sorted(out["samples"][name], key=lambda s: s["doc_id"])
        metrics = list(dict.fromkeys(m for s in samples for m in s["metrics"]))
        results.append({
            "task": f"{PREFIX}{name}", "prompts": len(samples),
            "per_prompt": {m: [float(s[m]) for s in samples] for m in metrics},
            "items": [{"prompt": s["arguments"][0][0], "reference": _reference(s)} for s in samples],
            "answers": [_answer(s) for s in samples]})
    return results


def _scored(sample: dict) -> bool:
    """Whether the harness scored the item's choices by log-likelihood (multiple choice)."""
    resps = sample["filtered_resps"]
    return bool(resps) and isinstance(resps[0], (list, tuple))


def _reference(sample: dict) -> str:
    """The right answer: a multiple-choice item's right choice, else the target as written."""
    target = sample["target"]
    if _scored(sample) and isinstance(target, int) and 0 <= target < len(sample["arguments"]):
        return str(sample["arguments"][target][1]).strip()
    return str(target)


def _answer(sample: dict) -> str:
    """What the model answered an item: a generated text, or the choice it scored highest."""
    resps = sample["filtered_resps"]
    if _scored(sample):  # log-likelihoods: one (logprob, greedy) a choice
        best = max(range(len(resps)), key=lambda i: resps[i][0])
        return str(sample["arguments"][best][1]).strip()
    return str(resps[0]) if resps else ""
