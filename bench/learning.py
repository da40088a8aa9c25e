#!/usr/bin/env python3
"""Learning on tasks the presets never use: base, SFT, F-GRPO, GRPO, ESSA and DPO, through the CLI.

For each task (reasoning-gym generators with graders, easy settings a 135M model can reach)
the benchmark writes a train split and a held-out split whose *questions* do not overlap
(checked by content), then runs what a user would run:

    edgetune eval  --preset fgrpo-quickstart --set data.path=<train> --set data.eval_path=<held-out> \\
                   --set fgrpo.reward=rg:<task> --adapter ''                      # base
    edgetune train --preset sft-quickstart   --set data.path=<train demonstrations>  # SFT
    edgetune train --preset fgrpo-quickstart --set data.path=... --set fgrpo.reward=rg:<task>
    edgetune train --preset fgrpo-quickstart ... --set fgrpo.gamma=0                 # plain GRPO
    edgetune train --preset essa-quickstart  --set essa.warm_start_data=<demonstrations> ...
    edgetune train --preset dpo-quickstart   --set data.path=<pairs>             # DPO

and evaluates every adapter with `edgetune eval` on the same held-out prompts: greedy
success, pass@1 and pass@k from 2k samples (same sampling seed for all). Only the data,
the reward and the budgets are changed from the presets (plus any --set you add). DPO's
pairs are made the way the embedded ones are: the answer chosen over a wrong number
(tasks with numeric answers only).

One task is kept aside (`KEPT_ASIDE`): defaults are never chosen on it; it checks them.

    nice -n 19 python bench/learning.py                                  # all tasks, all methods
    python bench/learning.py --tasks chain_sum --methods base,sft --eval-prompts 20 --sft-steps 10

Writes bench/results/<date>-cpu/learning/learning.json, learning.md and learning.png (or
--out). Data files and run folders go to a temporary folder (or --work), never elsewhere.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import json
import os
import platform
import random
import shlex
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# name -> (reasoning-gym generator, its settings). Easy settings: the embedded 135M model
# answers some of them at the start (no signal, no RL), not all (nothing to learn).
TASKS: dict[str, tuple[str, dict]] = {
    "chain_sum": ("chain_sum", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
    "basic_arithmetic": ("basic_arithmetic", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1,
                                                  operators=("+", "-"), allow_parentheses=False,
                                                  allow_negation=False)),
    "leg_counting": ("leg_counting", dict(min_animals=1, max_animals=1, min_instances=1, max_instances=6)),
    "count_bits": ("count_bits", dict(min_n=1, max_n=255)),
    "simple_equations": ("simple_equations", dict(min_terms=2, max_terms=2, min_value=1, max_value=9,
                                                  operators=("+", "-"), operators_weights=(0.5, 0.5))),
    "gcd": ("gcd", dict(min_numbers=2, max_numbers=2, min_value=2, max_value=20)),
    "products": ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1)),
}
KEPT_ASIDE = "products"  # never used to choose a default
METHODS = ["base", "sft", "fgrpo", "grpo", "essa", "dpo"]


# --------------------------------------------------------------------------- data


def norm(question: str) -> str:
    return " ".join(question.lower().split())


def make_items(task: str, n_train: int, n_eval: int, seed: int) -> tuple[list[dict], list[dict]]:
    """Distinct questions from the generator, split so no held-out question is in train."""
    import reasoning_gym

    gen, kwargs = TASKS[task]
    ds = reasoning_gym.create_dataset(gen, seed=seed, size=max(4 * (n_train + n_eval), 400), **kwargs)
    seen: dict[str, dict] = {}
    for x in ds:
        seen.setdefault(norm(x["question"]), x)
    items = list(seen.values())
    random.Random(seed).shuffle(items)
    held = items[:n_eval]
    train = items[n_eval : n_eval + n_train]
    if len(held) < n_eval or not train:
        raise SystemExit(f"{task}: only {len(items)} distinct questions; ask for fewer held-out prompts")
    return train, held


def assert_disjoint(train: list[dict], held: list[dict]) -> None:
    overlap = {norm(x["question"]) for x in train} & {norm(x["question"]) for x in held}
    assert not overlap, f"{len(overlap)} held-out questions also in train, e.g. {sorted(overlap)[0]!r}"


def _metadata(x: dict) -> dict:
    try:
        return json.loads(json.dumps(x.get("metadata") or {}))
    except (TypeError, ValueError):
        return {}


def rl_row(x: dict) -> dict:
    return {"prompt": x["question"], "answer": str(x["answer"]), "metadata": _metadata(x)}


def sft_row(x: dict) -> dict:
    # The demonstration states the answer the way the reward extracts it, then stops.
    return {"messages": [{"role": "user", "content": x["question"]},
                         {"role": "assistant", "content": f"Answer: {x['answer']}"}]}


def pair_row(x: dict, rng: random.Random) -> dict | None:
    """The reply as the demonstration states it, chosen over the same reply with a wrong
    number (the embedded pairs' recipe); None for an answer that is not an integer."""
    try:
        right = int(str(x["answer"]).strip())
    except ValueError:
        return None
    wrong = right + rng.choice([d for d in (-2, -1, 1, 2) if right < 0 or right + d >= 0])  # a non-negative answer, a non-negative wrong one
    return {"prompt": x["question"], "chosen": f"Answer: {right}", "rejected": f"Answer: {wrong}"}


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_task_data(task: str, folder: Path, n_train: int, n_eval: int, seed: int) -> dict:
    train, held = make_items(task, n_train, n_eval, seed)
    assert_disjoint(train, held)
    return {
        "train_rl": str(write_jsonl(folder / task / "train_rl.jsonl", [rl_row(x) for x in train])),
        "eval_rl": str(write_jsonl(folder / task / "eval_rl.jsonl", [rl_row(x) for x in held])),
        "train_sft": str(write_jsonl(folder / task / "train_sft.jsonl", [sft_row(x) for x in train])),
        "n_train": len(train), "n_eval": len(held),
        **_pairs(folder / task, train, held, seed),
    }


def _pairs(folder: Path, train: list[dict], held: list[dict], seed: int) -> dict:
    rng = random.Random(seed)
    out = {}
    for key, items in (("train_pairs", train), ("eval_pairs", held)):
        rows = [r for r in (pair_row(x, rng) for x in items) if r is not None]
        if len(rows) == len(items):  # every answer a number: the task has pairs
            out[key] = str(write_jsonl(folder / f"{key}.jsonl", rows))
    return out if len(out) == 2 else {}


# --------------------------------------------------------------------------- runs


def edgetune() -> list[str]:
    exe = Path(sys.executable).with_name("edgetune")
    return [str(exe)] if exe.is_file() else [sys.executable, "-m", "edgetune.engine.cli"]


def sets(pairs: list[str]) -> list[str]:
    return [a for p in pairs for a in ("--set", p)]


def _sigint_default() -> None:
    """In the command: Ctrl-C as in a terminal (a bench started in the background with `&`
    passes SIGINT on as ignored, and Python then never raises KeyboardInterrupt)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _interrupt_twice(p: subprocess.Popen) -> None:
    """End a command as a user would: Ctrl-C, then Ctrl-C again, which makes `edgetune
    train` kill its run's worker too (the worker has its own session, so killing only the
    command would leave it training)."""
    for _ in range(2):
        if p.poll() is None:
            p.send_signal(signal.SIGINT)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=2)
    try:
        p.wait(timeout=60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def _run(args: list[str], log: Path, timeout: float, capture: bool) -> tuple[int, float, str | None]:
    """(return code, seconds, stdout if captured); 124 past `timeout`. A command still
    running at the timeout, or when this bench is stopped, is ended by _interrupt_twice."""
    t = time.time()
    with open(log, "w", encoding="utf-8") as f:
        p = subprocess.Popen(args, stdout=subprocess.PIPE if capture else f, stderr=f if capture else subprocess.STDOUT,
                             text=True, cwd=log.parent, preexec_fn=_sigint_default)
        try:
            out, _ = p.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            _interrupt_twice(p)
            return 124, time.time() - t, None
        except BaseException:
            _interrupt_twice(p)
            raise
    return p.returncode, time.time() - t, out


def run_cmd(args: list[str], log: Path, timeout: float) -> tuple[int, float]:
    rc, secs, _ = _run(args, log, timeout, capture=False)
    return rc, secs


def run_json(args: list[str], log: Path, timeout: float) -> tuple[int, float, dict | None]:
    rc, secs, out = _run(args, log, timeout, capture=True)
    try:
        return rc, secs, json.loads(out) if rc == 0 else None
    except json.JSONDecodeError:
        return 1, secs, None


def curve(run: Path) -> list[dict]:
    """The run's per-step metrics (events.jsonl), with the warm start's SFT left out."""
    return curve_of_events(run / "events.jsonl")


def curve_of_events(ev: Path) -> list[dict]:
    """curve() of one events file (a run's events.jsonl, or a copy of it)."""
    if not ev.is_file():
        return []
    out = []
    for line in ev.read_text(encoding="utf-8").splitlines():
        try:
            e = json.loads(line)
        except json.JSONDecodeError:
            continue
        if e.get("type") == "step":
            out.append({k: e[k] for k in ("step", "reward_mean", "loss", "best", "mean", "truncated") if k in e})
        elif e.get("type") == "eval" and "step" in e:
            # Held-out during training (--curve-every): F-GRPO's greedy success and pass@k,
            # ESSA's greedy reward of the exported point at essa.max_new_tokens (0/1 rewards here:
            # a success rate).
            p = {"step": e["step"], "held_out": e.get("success_rate", e.get("reward"))}
            p.update({k: v for k, v in e.items() if k.startswith("pass@")})
            out.append(p)
    return out


def budget(key: str, value: int) -> list[str]:
    return [f"{key}={value}"] if value else []


def printable(args: list[str]) -> str:
    return " ".join(shlex.quote(a) for a in args)


def bench_task(task: str, a, data: dict, work: Path, log, save) -> dict:
    runs = work / "runs"
    runs.mkdir(parents=True, exist_ok=True)
    et = edgetune()
    rl_data = [f"data.path={data['train_rl']}", f"data.eval_path={data['eval_rl']}"]
    ev_sets = [*rl_data, f"fgrpo.reward=rg:{task}", f"essa.reward=rg:{task}",
               f"fgrpo.eval_prompts={a.eval_prompts}", f"fgrpo.eval_k={a.eval_k}",
               f"fgrpo.max_new_tokens={a.eval_tokens}", f"run.seed={a.seed}"]
    res: dict = {"task": task, "kept_aside": task == KEPT_ASIDE, "n_train": data["n_train"],
                 "n_eval": min(a.eval_prompts, data["n_eval"]), "methods": {}}

    def evaluate(method: str, adapter: str, train_s: float | None, cmd: list[str] | None, run: Path | None):
        args = [*et, "eval", "--preset", "fgrpo-quickstart", *sets(ev_sets + a.eval_set), "--json",
                "--adapter", adapter, "--runs-dir", str(runs)]
        rc, secs, m = run_json(args, work / f"{task}-{method}-eval.log", a.max_run_s)
        entry = {"train_cmd": printable(cmd) if cmd else None, "eval_cmd": printable(args),
                 "train_s": None if train_s is None else round(train_s, 1), "eval_s": round(secs, 1)}
        if m is None:
            entry["error"] = f"eval exited {rc}: see {work / f'{task}-{method}-eval.log'}"
        else:  # `edgetune eval --json`: one task (held-out), one system (the adapter), each score with its interval
            (held_out,) = m["tasks"]
            (system,) = held_out["systems"]
            entry.update({k: v["estimate"] for k, v in system["scores"].items()}, prompts=held_out["prompts"])
            entry["intervals"] = {k: [v["low"], v["high"]] for k, v in system["scores"].items()}
        if run is not None:
            entry["curve"] = curve(run)
        res["methods"][method] = entry
        log(f"{task} {method}: {json.dumps({k: v for k, v in entry.items() if 'cmd' not in k and k != 'curve'})}")

    def train(method: str, preset: str, extra: list[str]) -> tuple[Path | None, float, list[str]]:
        name = f"{task}-{method}"
        args = [*et, "train", "--preset", preset, *sets(extra + a.train_set), "--name", name,
                "--runs-dir", str(runs)]
        rc, secs = run_cmd(args, work / f"{name}-train.log", a.max_run_s)
        if rc != 0:
            res["methods"][method] = {"train_cmd": printable(args), "train_s": round(secs, 1),
                                      "error": f"train exited {rc}: see {work / (name + '-train.log')}"}
            log(f"{task} {method}: train exited {rc} after {secs:.0f} s")
            return None, secs, args
        return runs / name, secs, args

    for method in a.methods:
        if method == "base":
            evaluate("base", "", None, None, None)
        elif method == "sft":
            run, secs, cmd = train("sft", "sft-quickstart", [f"data.path={data['train_sft']}", f"run.seed={a.seed}",
                                                             *budget("sft.steps", a.sft_steps)])
            if run:
                evaluate("sft", str(run / "adapter"), secs, cmd, run)
        elif method in ("fgrpo", "grpo"):
            gamma = [] if method == "fgrpo" else ["fgrpo.gamma=0"]
            # Without --curve-every no held-out rows in training (eval_fraction 0, no eval_path):
            # `edgetune eval` below judges every method on the same prompts and sampling seed.
            # With it, the run also evaluates the held-out split every N steps: the same prompts,
            # k and sampling seed as `edgetune eval`, so the same figures when the run keeps the
            # preset's rollout batch and cap (the sampled chunks follow the batch).
            curve_sets = [f"data.eval_path={data['eval_rl']}", f"fgrpo.eval_every={a.curve_every}",
                          f"fgrpo.eval_prompts={a.eval_prompts}", f"fgrpo.eval_k={a.eval_k}"] if a.curve_every else []
            run, secs, cmd = train(method, "fgrpo-quickstart",
                                   [f"data.path={data['train_rl']}", "data.eval_fraction=0",
                                    f"fgrpo.reward=rg:{task}", *budget("fgrpo.steps", a.fgrpo_steps),
                                    f"run.seed={a.seed}", *gamma, *curve_sets])
            if run:
                evaluate(method, str(run / "adapter"), secs, cmd, run)
        elif method == "essa":
            run, secs, cmd = train("essa", "essa-quickstart",
                                   [*rl_data, f"essa.reward=rg:{task}", f"essa.warm_start_data={data['train_sft']}",
                                    *budget("essa.warm_start_steps", a.warm_start_steps),
                                    *budget("essa.generations", a.essa_generations),
                                    *([f"essa.eval_every={a.curve_every}", f"essa.eval_prompts={a.eval_prompts}"]
                                      if a.curve_every else ["essa.eval_prompts=0"]),
                                    f"run.seed={a.seed}"])
            if run:
                evaluate("essa_warm_start", str(run / "warm_start" / "adapter"), None, None, None)
                evaluate("essa", str(run / "adapter"), secs, cmd, run)
        elif method == "dpo":
            if "train_pairs" not in data:
                res["methods"]["dpo"] = {"error": "the task's answers are not all integers: no pairs"}
            else:
                run, secs, cmd = train("dpo", "dpo-quickstart",
                                       [f"data.path={data['train_pairs']}", f"data.eval_path={data['eval_pairs']}",
                                        f"run.seed={a.seed}", *budget("dpo.steps", a.dpo_steps)])
                if run:
                    evaluate("dpo", str(run / "adapter"), secs, cmd, run)
        save(res)  # after every method: a partial table survives a stop
    return res


# --------------------------------------------------------------------------- report

COLUMNS = ["base", "sft", "fgrpo", "grpo", "essa_warm_start", "essa", "dpo"]
# F-GRPO without its γ: the preset's by default, and a --set may change it (the command says which)
LABELS = {"base": "base", "sft": "SFT", "fgrpo": "F-GRPO", "grpo": "GRPO γ=0",
          "essa_warm_start": "ESSA warm start", "essa": "ESSA", "dpo": "DPO"}


def _pct(x) -> str:
    return "–" if x is None else f"{100 * x:.0f}%"


def table(result: dict) -> str:
    """The Markdown report: setup, one row per task (greedy success, pass@k, time)."""
    k = result["args"]["eval_k"]
    lines = [f"# Learning on unseen tasks ({result['date']})", "",
             f"Machine: {result['machine']}", "",
             f"Command: `{result['command']}`", "",
             "Held-out greedy success" + (f" (pass@{k} from {2 * k} samples at the preset's temperature in "
                                          "brackets)" if k else "") + ", then training wall time. Items of the held-out split never "
             f"appear in train (checked by content). The kept-aside task ({KEPT_ASIDE}) is not used to "
             "choose defaults.", ""]
    head = ["task", "train / held-out"] + [LABELS[c] for c in COLUMNS]
    lines += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for t in result["tasks"]:
        cells = [t["task"] + (" (kept aside)" if t["kept_aside"] else ""), f"{t['n_train']} / {t['n_eval']}"]
        for c in COLUMNS:
            m = t["methods"].get(c)
            if m is None:
                cells.append("not run")
            elif "error" in m:
                cells.append("failed")
            else:
                s = _pct(m.get("success_rate"))
                if f"pass@{k}" in m:
                    s += f" ({_pct(m[f'pass@{k}'])})"
                if m.get("train_s") is not None:
                    s += f", {m['train_s'] / 60:.1f} min"
                cells.append(s)
        lines.append("| " + " | ".join(cells) + " |")
    trunc = truncation_lines(result)
    if trunc:
        lines += ["", "Share of F-GRPO / GRPO rollouts that hit the completion cap (first 4 / last 4 training "
                  "steps; a completion cut there rarely holds its answer):", "", *trunc]
    held = held_out_lines(result)
    if held:
        lines += ["", f"Held-out greedy success while training (step or generation: success, pass@{k} in brackets "
                  "where measured; the same prompts as the table):", "", *held]
    if result.get("not_finished"):
        lines += ["", f"Not finished by the deadline (stopped): {', '.join(result['not_finished'])}."]
    lines += ["", "Commands of each run (train, then eval) are in the JSON beside this file."]
    return "\n".join(lines) + "\n"


def held_out_points(curve: list[dict]) -> list[dict]:
    """The points of a curve that evaluated the held-out split (--curve-every)."""
    return [p for p in curve if p.get("held_out") is not None]


def held_out_cells(pts: list[dict], k: int) -> str:
    """'0: 12% (30%), 8: 50% (70%)': step, greedy success, pass@k where measured."""
    return ", ".join(f"{p['step']}: {_pct(p['held_out'])}" + (f" ({_pct(p[f'pass@{k}'])})" if f"pass@{k}" in p else "")
                     for p in pts)


def draw_held_out(ax, by_method: dict[str, list[dict]], base: float | None = None) -> None:
    """One panel: held-out greedy success against step / generation, a line per method."""
    for c, pts in by_method.items():
        if pts:
            ax.plot([p["step"] for p in pts], [100 * p["held_out"] for p in pts], marker="o", label=LABELS[c])
    if base is not None:
        ax.axhline(100 * base, color="grey", linestyle="--", label="base")
    ax.set_xlabel("step / generation")
    ax.set_ylabel("held-out greedy success % (while training)")
    ax.set_ylim(0, 100)
    if ax.lines:
        ax.legend(fontsize=7)


def held_out_lines(result: dict) -> list[str]:
    """One line per (task, method) that evaluated the held-out split while training."""
    k = result["args"]["eval_k"]
    out = []
    for t in result["tasks"]:
        for c in ("fgrpo", "grpo", "essa"):
            pts = held_out_points(t["methods"].get(c, {}).get("curve", []))
            if pts:
                out.append(f"- {t['task']} {LABELS[c]}: {held_out_cells(pts, k)}")
    return out


def truncation_lines(result: dict) -> list[str]:
    """One line per task: the capped share of rollouts early and late in each RL run."""
    out = []
    for t in result["tasks"]:
        cells = []
        for c in ("fgrpo", "grpo"):
            pts = [p["truncated"] for p in t["methods"].get(c, {}).get("curve", []) if "truncated" in p]
            if pts:
                head, tail = pts[:4], pts[-4:]
                cells.append(f"{LABELS[c]} {_pct(sum(head) / len(head))} -> {_pct(sum(tail) / len(tail))}")
        if cells:
            out.append(f"- {t['task']}: " + ", ".join(cells))
    return out


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tasks = result["tasks"]
    held = any(held_out_points(m.get("curve", [])) for t in tasks for m in t["methods"].values())
    rows = 3 if held else 2
    fig, axes = plt.subplots(rows, max(1, len(tasks)), figsize=(4 * max(1, len(tasks)), 3.5 * rows), squeeze=False)
    for j, t in enumerate(tasks):
        ax = axes[0][j]
        cols = [c for c in COLUMNS if c in t["methods"] and "success_rate" in t["methods"][c]]
        ax.bar(range(len(cols)), [100 * t["methods"][c]["success_rate"] for c in cols], color="tab:blue")
        ax.set_xticks(range(len(cols)), [LABELS[c] for c in cols], rotation=45, ha="right", fontsize=8)
        ax.set_ylim(0, 100)
        ax.set_title(t["task"] + (" (kept aside)" if t["kept_aside"] else ""))
        ax.set_ylabel("held-out greedy success %")
        ax = axes[1][j]
        for c, key in (("fgrpo", "reward_mean"), ("grpo", "reward_mean"), ("essa", "mean")):
            pts = [(p["step"], p[key]) for p in t["methods"].get(c, {}).get("curve", []) if key in p]
            if pts:
                ax.plot(*zip(*pts), marker=".", label=LABELS[c] + (" (population mean fitness)" if c == "essa" else ""))
        ax.set_xlabel("step / generation")
        ax.set_ylabel("training reward")
        values = [v for line in ax.lines for v in line.get_ydata()]
        if all(0 <= v <= 1 for v in values):  # rewards; a gold_logprob fitness is negative
            ax.set_ylim(0, 1)
        if ax.lines:
            ax.legend(fontsize=7)
        if held:
            draw_held_out(axes[2][j], {c: held_out_points(t["methods"].get(c, {}).get("curve", []))
                                       for c in ("fgrpo", "grpo", "essa")},
                          t["methods"].get("base", {}).get("success_rate"))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def write_report(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "learning.json").write_text(json.dumps(result, indent=2) + "\n", encoding="utf-8")
    (out / "learning.md").write_text(table(result), encoding="utf-8")
    plot(result, out / "learning.png")


def merge(files: list[str]) -> dict:
    """One report from several partial runs (e.g. methods run side by side): per task, the
    methods of later files are added to those of earlier ones."""
    parts = [json.loads(Path(f).read_text(encoding="utf-8")) for f in files]
    out = {**parts[0], "tasks": [], "command": " ; ".join(p["command"] for p in parts),
           "machine": " ; ".join(dict.fromkeys(p["machine"] for p in parts))}
    by_name: dict[str, dict] = {}
    for p in parts:
        if p["args"]["eval_k"] != out["args"]["eval_k"] or p["args"]["eval_prompts"] != out["args"]["eval_prompts"]:
            raise SystemExit(f"{files[parts.index(p)]}: another evaluation (eval_k / eval_prompts) than {files[0]}")
        for t in p["tasks"]:
            if t["task"] in by_name:
                by_name[t["task"]]["methods"].update(t["methods"])
            else:
                by_name[t["task"]] = json.loads(json.dumps(t))
                out["tasks"].append(by_name[t["task"]])
    return out


def machine() -> str:
    try:
        load = os.getloadavg()[0]
    except OSError:
        load = float("nan")
    gpu = ""
    try:
        names = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True,
                               text=True, timeout=30).stdout.split("\n")
        gpu = ", ".join(n.strip() for n in names if n.strip())
    except (OSError, subprocess.SubprocessError):
        pass
    return (f"{platform.machine()} CPU, {os.cpu_count()} cores (load average {load:.1f} at the end), "
            + (f"GPU: {gpu}, " if gpu else "")
            + f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS', 'unset')}, Python {platform.python_version()}")


def child_args(a, task: str, method: str, out: Path, work: Path) -> list[str]:
    """This script for one (task, method), with every other option of this run."""
    args = [sys.executable, str(Path(__file__).resolve()), "--tasks", task, "--methods", method,
            "--out", str(out), "--work", str(work)]
    for name in ("train_items", "eval_prompts", "eval_k", "eval_tokens", "sft_steps", "fgrpo_steps",
                 "warm_start_steps", "essa_generations", "seed", "max_run_s", "curve_every"):
        args += ["--" + name.replace("_", "-"), str(getattr(a, name))]
    return args + sets(a.train_set) + [x for v in a.eval_set for x in ("--eval-set", v)]


# the slowest first, so that the last to finish starts early
_ORDER = {"essa": 0, "grpo": 1, "fgrpo": 2, "sft": 3, "base": 4}


def run_parallel(a, out: Path, work: Path, log) -> dict:
    """Every (task, method) in its own process, `--jobs` at a time (each writes its own
    report under work/parts/); at `--deadline-s` the ones still running are stopped with
    their child processes. The parts are merged into one report in `out`."""
    jobs = sorted(((t, m) for t in a.tasks for m in a.methods), key=lambda tm: (_ORDER[tm[1]], a.tasks.index(tm[0])))
    parts = work / "parts"
    t0, running, done = time.time(), {}, []
    pending = list(jobs)
    while pending or running:
        while pending and len(running) < a.jobs:
            t, m = pending.pop(0)
            logf = open(work / f"job-{t}-{m}.log", "w", encoding="utf-8")
            proc = subprocess.Popen(child_args(a, t, m, parts / f"{t}-{m}", work / f"{t}-{m}"), stdout=logf,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            running[(t, m)] = (proc, logf)
            log(f"started {t} {m}")
        for key, (proc, logf) in list(running.items()):
            if proc.poll() is not None:
                logf.close()
                del running[key]
                done.append(key)
                log(f"{key[0]} {key[1]}: exited {proc.returncode} after {time.time() - t0:.0f} s")
        if a.deadline_s and time.time() - t0 > a.deadline_s and running:
            for key, (proc, logf) in running.items():
                # SIGTERM to the job alone: it ends its command, and that command its worker
                # (_run); a SIGTERM to the whole group would end the command before it could
                with contextlib.suppress(ProcessLookupError):
                    proc.send_signal(signal.SIGTERM)
                log(f"{key[0]} {key[1]}: stopped at the deadline ({a.deadline_s:.0f} s)")
            for proc, logf in running.values():
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=90)
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)  # whatever of the job's group is left
                logf.close()
            running.clear()
            pending.clear()
        time.sleep(1)
    files = [str(parts / f"{t}-{m}" / "learning.json") for t, m in
             sorted(jobs, key=lambda tm: (a.tasks.index(tm[0]), METHODS.index(tm[1])))
             if (parts / f"{t}-{m}" / "learning.json").is_file()]
    if not files:
        raise SystemExit(f"no (task, method) finished: see the job logs in {work}")
    result = merge(files)
    missing = [f"{t} {m}" for t, m in jobs if str(parts / f"{t}-{m}" / "learning.json") not in files]
    result["not_finished"] = missing
    write_report(result, out)
    return result


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tasks", default=",".join(TASKS), help=f"comma-separated, from {', '.join(TASKS)}")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, from {', '.join(METHODS)}")
    p.add_argument("--train-items", type=int, default=150)
    p.add_argument("--eval-prompts", type=int, default=50, help="held-out prompts")
    p.add_argument("--eval-k", type=int, default=4, help="pass@k, from 2k samples per prompt")
    p.add_argument("--eval-tokens", type=int, default=32, help="completion cap of the evaluation")
    # 0 = the preset's own value (what a user of the quick start gets)
    p.add_argument("--sft-steps", type=int, default=0)
    p.add_argument("--fgrpo-steps", type=int, default=0)
    p.add_argument("--warm-start-steps", type=int, default=0)
    p.add_argument("--essa-generations", type=int, default=0)
    p.add_argument("--dpo-steps", type=int, default=0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--curve-every", type=int, default=0, metavar="N",
                   help="F-GRPO / GRPO and ESSA runs also evaluate the held-out split every N steps / "
                        "generations while they train (a held-out curve; each evaluation costs time)")
    p.add_argument("--set", dest="train_set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra setting for every training run (e.g. fgrpo.lr=1e-3)")
    p.add_argument("--eval-set", action="append", default=[], metavar="KEY=VALUE",
                   help="extra setting for every evaluation")
    p.add_argument("--max-run-s", type=float, default=900, help="wall-clock limit of one command")
    p.add_argument("--jobs", type=int, default=0,
                   help="run every (task, method) as its own process, this many at a time (0 = one after another)")
    p.add_argument("--deadline-s", type=float, default=0,
                   help="with --jobs: stop what still runs after this many seconds and merge what finished")
    p.add_argument("--out", default="", help="default: bench/results/<date>-cpu/learning")
    p.add_argument("--merge", nargs="+", metavar="JSON", help="only write one report from these learning.json files")
    p.add_argument("--work", default="", help="data files and run folders (default: a new temporary folder)")
    a = p.parse_args(argv)
    a.tasks = [t for t in a.tasks.split(",") if t]
    a.methods = [m for m in a.methods.split(",") if m]
    bad = [t for t in a.tasks if t not in TASKS] + [m for m in a.methods if m not in METHODS]
    if bad:
        p.error(f"unknown task or method: {', '.join(bad)}")
    return a


def main(argv=None) -> int:
    a = parse_args(argv)
    if a.merge:
        result = merge(a.merge)
        write_report(result, Path(a.out) if a.out else Path(a.merge[0]).parent)
        print(table(result))
        return 0
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # oversubscribed cores: one thread is faster

    date = dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%d")
    out = Path(a.out) if a.out else ROOT / "bench" / "results" / f"{date}-cpu" / "learning"
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="edgetune-bench-learning-"))
    work.mkdir(parents=True, exist_ok=True)

    def log(msg: str) -> None:
        print(f"[{dt.datetime.now(dt.timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)

    log(f"work folder {work}")
    if a.jobs > 0:
        result = run_parallel(a, out, work, log)
        result["command"] = "python " + printable(["bench/learning.py", *(argv if argv is not None else sys.argv[1:])])
        result["machine"] = machine()
        write_report(result, out)
        log(f"wrote {out}")
        print(table(result))
        return 0
    # stopped (the parallel runner's deadline): unwind, so the running command ends its worker (_run)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = {"date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"), "machine": machine(),
              "command": "python " + printable(["bench/learning.py", *(argv if argv is not None else sys.argv[1:])]),
              "args": {k: v for k, v in vars(a).items()}, "kept_aside": KEPT_ASIDE, "tasks": []}
    for task in a.tasks:
        data = write_task_data(task, work / "data", a.train_items, a.eval_prompts, a.seed)
        done = list(result["tasks"])

        def save(partial: dict) -> None:
            result["tasks"] = [*done, partial]
            result["machine"] = machine()
            write_report(result, out)

        save(bench_task(task, a, data, work, log, save))
    log(f"wrote {out}")
    print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
