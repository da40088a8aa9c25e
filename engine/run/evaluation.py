"""Did it help? The base model and any number of adapters graded on the same tasks, each
score with its 95% interval, and every pair of systems compared item by item with a paired
test (engine/training/stats.py) and a sentence saying the answer.

Tasks (`edgetune eval --task`, repeatable; `held-out` when none is given):

- `held-out`: the config's own held-out split. A method with a reward generates and grades
  its held-out prompts (engine/training/grading.py's `grade_rows`); SFT scores each held-out
  demonstration by its mean token loss (negative log-likelihood of its labelled tokens, the
  loss SFT trains on), a mean over the demonstrations with its bootstrap interval, and
  pairs compared by the paired bootstrap (lower is better: "better" means a lower loss).
- a file (JSONL / CSV / Parquet / a saved dataset): prompt + answer rows, or chat rows whose
  last turn is the answer (engine/data/rl.py's `task_rows`), generated and graded exactly
  as held-out prompts are: with the config's method's grading (its settings' `grading()`:
  its own reward, or GradingSettings' defaults for a method without one), its chat
  template and data.system_prompt, its seed.
- `lm:TASK`: EleutherAI's lm-evaluation-harness on the loaded model (engine/run/harness.py):
  a shipped task or a task YAML of one's own; each harness task is a task of the result.

`compare(cfg, systems, tasks)` loads each system once, grades it on every task in turn and
returns a plain dict (`edgetune eval --json` prints it as it is):

    {"seed", "system_prompt",
     "tasks": [{"task", "kind", "reward_fn", "prompts", "unit", "metrics", "shares" (shown in percent),
                "items": [{"prompt", "reference"}],          (generative tasks)
                "systems": [{"name", "adapter", "scores": {metric: {estimate, low, high}},
                             "per_prompt": {metric: [value of each item]},
                             "answers": [greedy completion of each item]}],
                "comparisons": [{"a", "b", "metric", "kind", "n", "difference", "low", "high",
                                 "p_value", "needed", "better", "worse", "words"}]}]}

Comparisons: each adapter against the base first, then the adapters against each other.
"""

from __future__ import annotations

import gc
from dataclasses import asdict
from itertools import combinations

from edgetune.engine.core.errors import ConfigError, DataError, EdgetuneError
from edgetune.engine.core.methods import METHODS as RECORDS

from edgetune.engine.training import grading, stats
from edgetune.engine.training.grading import BASE, compare_held_out, held_out_scores

from edgetune.engine.run import harness
from edgetune.engine.run.eval_tasks import HELD_OUT

from edgetune.engine import data as data_lib

GENERATIVE = "generative"  # a task's kind: prompts generated and graded by a reward
LOSS = "loss"  # a task's kind, and its one metric: the held-out demonstrations' mean token loss
UNBOUNDED = ("reward",)  # a generative task's metrics that are not shares of 0..1 (the rest show in percent)


class Stopped(EdgetuneError):
    """A stop was asked for while grading (progress returned True)."""


HARNESS = "harness"  # a task's kind: lm-evaluation-harness tasks (engine/run/harness.py)


def task_kind(task: str) -> str:
    return HELD_OUT if task == HELD_OUT else HARNESS if harness.is_harness(task) else "file"


def held_out_kind(cfg) -> str:
    """How the config's held-out split is graded: GENERATIVE for a method with a reward,
    LOSS for demonstrations; a one-line error for a method with neither."""
    record = RECORDS[cfg.method]
    if record.rewards:
        return GENERATIVE
    if record.data == "demonstrations":
        return LOSS
    graded = ", ".join(m.label for m in RECORDS.values() if m.rewards or m.data == "demonstrations")
    raise ConfigError(f"{record.label} runs have no held-out split `edgetune eval` can grade (it grades those of "
                      f"{graded}); give a task file of prompts and answers: --task FILE")


def check_tasks(cfg, tasks: list[str]) -> dict[str, list[dict]]:
    """Every task checked before a model loads: a one-line error for a task that cannot be
    graded. Returns the rows of each task file, read and checked."""
    rows = {}
    for task in tasks:
        if task_kind(task) == HELD_OUT:
            if held_out_kind(cfg) == GENERATIVE:
                grading.held_out_grading(cfg)
        elif task_kind(task) == HARNESS:
            harness.load_tasks(task)  # unknown, or its data missing offline: its one line
        else:
            rows[task] = data_lib.task_rows(task, cfg.data)
    return rows


def compare_results(results: list[tuple[str, dict]]) -> dict:
    """The comparison dict of one generative task's already graded systems: (name,
    grade_rows' result with "adapter"), the base (if any) named BASE."""
    if not results:
        raise ConfigError("nothing to evaluate: give --adapter (repeatable) and/or --base")
    counts = {r["prompts"] for _, r in results}
    if len(counts) != 1:
        raise ConfigError(f"the systems were graded on different numbers of prompts ({sorted(counts)})")
    systems = [{"name": name, "adapter": r.get("adapter"), "scores": held_out_scores(r["per_prompt"]),
                "per_prompt": r["per_prompt"], **({"answers": r["answers"]} if "answers" in r else {})}
               for name, r in results]
    comparisons = [c for a, b in pairs(systems)
                   for c in compare_held_out(a["name"], a["per_prompt"], b["name"], b["per_prompt"])]
    return {"reward_fn": results[0][1].get("reward_fn"), "prompts": counts.pop(), "unit": "prompts",
            "systems": systems, "comparisons": comparisons}


def pairs(systems: list[dict]) -> list[tuple[dict, dict]]:
    """The pairs compared: each adapter against the base, then the adapters against each other."""
    base = [s for s in systems if s["name"] == BASE]
    adapters = [s for s in systems if s["name"] != BASE]
    return ([(base[0], s) for s in adapters] if base else []) + list(combinations(adapters, 2))


def system_names(adapters: list[str], base: bool) -> list[tuple[str, str]]:
    """(name, adapter path or "") of each system to grade: the base first. An adapter given
    as '' is the base; a name given twice is graded once."""
    out = [(BASE, "")] if base or "" in adapters else []
    for a in adapters:
        if a and a not in [p for _, p in out]:
            out.append((a, a))
    return out


def _grade_generative(cfg, s, model, tok, rows, tick) -> dict:
    out = grading.grade_rows(cfg, s, model, tok, rows, tick, samples=len(rows))
    if out is None:
        raise Stopped("the evaluation was stopped")
    prompts, answers, references = out.pop("samples")
    out["answers"] = answers
    out["items"] = [{"prompt": p, "reference": r} for p, r in zip(prompts, references)]
    return out


def _held_out_loss(cfg, model, tok, tick) -> dict:
    """Each held-out demonstration's mean token loss, as the method's loop evaluates it (the
    micro-batch of its record's `batch`, its eval_batches cap)."""
    import torch

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.lm_loss import labelled_logprobs

    group, name = RECORDS[cfg.method].batch.split(".")
    batch_size, eval_batches = getattr(getattr(cfg, group), name), getattr(cfg, cfg.method).eval_batches
    examples = data_lib.load_sft(cfg.data, tok, cfg.run.seed).eval
    if eval_batches:
        examples = examples[: eval_batches * batch_size]
    if not examples:
        raise DataError("no held-out demonstrations to score (set data.eval_fraction or data.eval_path)",
                        file=cfg.data.path)
    device = next(model.parameters()).device
    losses: list[float] = []
    with torch.no_grad():
        for start in range(0, len(examples), batch_size):
            batch = data_lib.collate(examples[start : start + batch_size], tok.pad_token_id)
            with model_lib.autocast(model):
                sums, counts = labelled_logprobs(model, {k: v.to(device) for k, v in batch.items()})
            losses += (-sums / counts.clamp(min=1)).tolist()
            if tick is not None and tick(len(losses), len(examples)):
                raise Stopped("the evaluation was stopped")
    return {"prompts": len(losses), "per_prompt": {LOSS: losses}}


def compare_losses(graded: list[tuple[str, dict]]) -> dict:
    """The comparison dict of the held-out loss of already scored systems."""
    systems = [{"name": name, "adapter": r.get("adapter"),
                "scores": {LOSS: asdict(stats.bootstrap_mean(r["per_prompt"][LOSS]))},
                "per_prompt": r["per_prompt"]} for name, r in graded]
    comparisons = [stats.compare_losses(a["per_prompt"][LOSS], b["per_prompt"][LOSS], a["name"], b["name"], LOSS,
                                        "demonstrations") for a, b in pairs(systems)]
    return {"prompts": graded[0][1]["prompts"], "unit": "demonstrations", "systems": systems,
            "comparisons": comparisons}


def compare_scores(graded: list[tuple[str, dict]]) -> dict:
    """The comparison dict of a task whose items carry metric values of any kind (the
    harness's): a metric whose every value is 0 or 1 is a share (Wilson interval, exact
    McNemar), any other a mean (bootstrap, paired bootstrap)."""
    metrics = list(dict.fromkeys(m for _, r in graded for m in r["per_prompt"]))
    shares = [m for m in metrics if all(v in (0, 1) for _, r in graded for v in r["per_prompt"].get(m, []))]

    def interval(m, values):
        return stats.wilson(int(sum(values)), len(values)) if m in shares else stats.bootstrap_mean(values)

    systems = [{"name": name, "adapter": r.get("adapter"),
                "scores": {m: asdict(interval(m, v)) for m, v in r["per_prompt"].items()},
                "per_prompt": r["per_prompt"], "answers": r.get("answers", [])} for name, r in graded]
    comparisons = []
    for a, b in pairs(systems):
        for m in metrics:
            xa, xb = a["per_prompt"].get(m), b["per_prompt"].get(m)
            if xa is None or xb is None:
                continue
            c = stats.compare_proportions(xa, xb) if m in shares else stats.compare_means(xa, xb)
            comparisons.append({"a": a["name"], "b": b["name"], "metric": m, **c.dict(),
                                "words": stats.in_words(c, a["name"], b["name"], unit="items")})
    return {"prompts": graded[0][1]["prompts"], "unit": "items", "systems": systems, "comparisons": comparisons,
            "metrics": metrics, "shares": shares, "items": graded[0][1].get("items", [])}


def _release(model) -> None:
    """Free a graded system's model before the next one loads."""
    import torch

    del model
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _grade(cfg, task: str, file_rows: dict, model, tok, tick) -> list[tuple[str, str, dict]]:
    """(task name, kind, result) of one loaded system on one task: one entry, or one a
    harness task of an `lm:` task."""
    if task_kind(task) == HARNESS:
        return [(r["task"], HARNESS, r) for r in harness.run(cfg, model, tok, task, progress=tick)]
    if task_kind(task) == HELD_OUT and held_out_kind(cfg) == LOSS:
        return [(task, LOSS, _held_out_loss(cfg, model, tok, tick))]
    if task_kind(task) == HELD_OUT:
        s = grading.held_out_grading(cfg)
        rows = grading.held_out_rows(cfg, tok, s)
    else:
        s, rows = grading.grading_settings(cfg), file_rows[task]
    return [(task, GENERATIVE, _grade_generative(cfg, s, model, tok, rows, tick))]


def _task_result(task: str, kind: str, graded: list[tuple[str, dict]]) -> dict:
    if kind == HARNESS:
        return {"task": task, "kind": kind, **compare_scores(graded)}
    if kind == LOSS:
        return {"task": task, "kind": kind, **compare_losses(graded), "metrics": [LOSS], "shares": []}
    result = compare_results(graded)
    metrics = list(dict.fromkeys(m for s in result["systems"] for m in s["scores"]))
    return {"task": task, "kind": kind, **result, "metrics": metrics,
            "shares": [m for m in metrics if m not in UNBOUNDED], "items": graded[0][1]["items"]}


def compare(cfg, systems: list[tuple[str, str]], tasks: list[str] | None = None, progress=None) -> dict:
    """Grade each (name, adapter path or "" for the base) on every task and compare them.
    progress(name, index, task, done, total) as it goes; True back stops the evaluation
    (Stopped is raised)."""
    tasks = list(dict.fromkeys(tasks or [HELD_OUT]))
    if not systems:
        raise ConfigError("nothing to evaluate: give --adapter (repeatable) and/or --base")
    file_rows = check_tasks(cfg, tasks)
    graded: dict[tuple[str, str], list[tuple[str, dict]]] = {}  # (task, kind) -> each system's result, in order
    for i, (name, path) in enumerate(systems):
        model, tok, adapter = grading.eval_model(cfg, path)
        for task in tasks:
            tick = ((lambda done, total, name=name, i=i, task=task: progress(name, i, task, done, total))
                    if progress else None)
            for shown, kind, result in _grade(cfg, task, file_rows, model, tok, tick):
                graded.setdefault((shown, kind), []).append((name, {"adapter": adapter, **result}))
        _release(model)
    return {"seed": cfg.run.seed, "system_prompt": cfg.data.system_prompt,
            "tasks": [_task_result(task, kind, g) for (task, kind), g in graded.items()]}
