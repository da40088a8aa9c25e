"""The command line: every UI action, scriptable.

    edgetune train --preset sft-quickstart            # embedded default model + data, offline
    edgetune train --config my.yaml --set lora.r=32   # any setting overridable
    edgetune resume runs/<run>                        # continue from the last checkpoint
    edgetune resume runs/<run> --more-steps 50        # train a finished run further
    edgetune export runs/<run> --out my-adapter/      # PEFT adapter (--zip, --merged)
    edgetune train --preset X --queue                 # queue it; runs one after another
    edgetune queue [list | run | cancel ID | up ID | down ID | move ID --to N]
    edgetune runs | presets | data FILE | estimate --preset X
    edgetune ui                                       # the Gradio app

Errors in the user's input print one line `error: ...` and exit with status 2; a run
that fails exits with 1 and its run folder says why.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys

from edgetune.engine.core.errors import EdgetuneError
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.metric_words import metrics_text
from edgetune.engine.core.units import duration, size


def _config(a):
    from edgetune.engine.core.settings import resolve

    if not a.preset and not a.config:
        raise EdgetuneError("give --preset NAME or --config FILE (edgetune presets lists the presets)")
    overrides = list(a.set or [])
    if getattr(a, "name", None):
        overrides.append(f"run.name={a.name}")
    if getattr(a, "runs_dir", None):
        overrides.append(f"run.runs_dir={a.runs_dir}")
    return resolve(preset=a.preset, config=a.config, overrides=overrides)


def _step_total(ev: dict) -> int | None:
    """Steps (ESSA: generations) of a run, from its `started` event's config."""
    method = RECORDS.get(ev.get("method") or "")
    return method.total(ev.get("config") or {}) if method else None


def _resumed_line(run, ev: dict) -> str:
    """What a resume did, from its `started` event: the checkpoint the worker really
    continued from (it skips a damaged newest one), or that it starts over."""
    from edgetune.engine.core.phases import resume_words

    step = ev.get("resumed_from")
    return resume_words(run.name, (step, None) if step is not None else None)


def _one_line(text, n: int, tail: bool = False) -> str:
    """`text` on one line, at most `n` characters: its first, or its last with `tail` (a
    prompt's end is its question)."""
    text = " / ".join(part.strip() for part in str(text).splitlines() if part.strip())
    if len(text) <= n:
        return text
    return "…" + text[-(n - 1):] if tail else text[: n - 1] + "…"


def samples_text(ev: dict) -> str:
    """A `samples` event as a few lines: prompt (its end), the model's greedy completion
    and the reference answer."""
    lines = [f"samples at step {ev.get('step')} (prompt → model | reference):"]
    for x in ev.get("samples") or []:
        lines.append(f"  {_one_line(x.get('prompt', ''), 60, tail=True)} → {_one_line(x.get('completion', ''), 80)!r}"
                     f" | {_one_line(x.get('reference', ''), 80)!r}")
    return "\n".join(lines)


def more_steps_text(ev: dict) -> str:
    return (f"more steps: {ev.get('setting')} {ev.get('from')} → {ev.get('to')}; the learning rate keeps the "
            f"schedule of {ev.get('schedule')} steps, then stays at its final value")


def watch(run, start: int = 0, quiet: bool = False, resuming: bool = False) -> int:
    """Follow a run's events from index `start` with a progress bar that shows the phase
    at once. Ctrl-C (or SIGTERM, a plain `kill`) asks for a graceful stop and keeps
    following this attempt to its end; a second one kills the worker and returns (the
    worker runs in its own session, so it would otherwise train on without its parent).
    `resuming`: the first line says from which checkpoint the worker continues."""
    import signal

    def interrupt(*_):
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        return _watch(run, start, quiet, resuming)
    finally:
        signal.signal(signal.SIGTERM, before)


def _watch(run, start: int, quiet: bool, resuming: bool) -> int:
    from tqdm import tqdm

    from edgetune.engine.core import phases

    # Elapsed and ETA come from the worker's events: tqdm's own rate would count the
    # replayed or resumed steps as if done in the first instant.
    bar = tqdm(total=None, disable=quiet, unit="step", dynamic_ncols=True, desc="starting the worker",
               bar_format="{desc}: {n_fmt}/{total_fmt} |{bar}|{postfix}")
    seen = {"i": start, "status": 1, "step": 0}

    def show_phase(text: str) -> None:
        bar.set_description_str(text, refresh=True)

    def on_event(ev: dict) -> None:
        t = ev["type"]
        if t == "started":
            seen["t0"] = ev.get("time")  # elapsed: this attempt's wall time, as the page shows it
            bar.total = _step_total(ev)
            if resuming:
                tqdm.write(_resumed_line(run, ev))
            if not quiet:
                threads = ev.get("cpu_threads") if ev.get("device") == "cpu" else None
                tqdm.write(f"run {run.name}: {ev['method']} on {ev['device']}"
                           + (f" ({threads} CPU thread{'s' if threads != 1 else ''})" if threads else "")
                           + (f", resumed from step {ev['resumed_from']}" if ev.get("resumed_from") and not resuming
                              else ""))
        elif t == "phase":
            if seen.get("post") and seen.get("t0") and ev.get("time"):  # the clock runs on through the evaluations
                bar.set_postfix({**seen["post"], "elapsed": duration(ev["time"] - seen["t0"])}, refresh=False)
            show_phase(phases.describe(ev) if ev["phase"] != "training" or seen["step"] else "training · first step")
        elif t == "data" and not quiet:
            r = ev["report"]
            dropped = "; ".join(f"dropped {n}: {why}" for why, n in (r.get("dropped") or {}).items())
            tqdm.write(f"data: {r.get('rows_kept')}/{r.get('rows_total')} rows kept ({r.get('format')})"
                       + (f"; {dropped}" if dropped else "")
                       + (f"; truncated {r['truncated']} to max_seq_len" if r.get("truncated") else ""))
        elif t == "step":
            seen["step"] = ev["step"]
            bar.total = ev.get("total") or bar.total
            bar.n = ev["step"]
            post = {k: f"{ev[k]:.4g}" for k in ("loss", "reward_mean", "success_rate", "best", "mean")
                    if isinstance(ev.get(k), (int, float))}
            if ev.get("gpu", {}).get("total"):
                post["gpu"] = size(ev["gpu"]["peak"] or 0)
            post["elapsed"] = duration(ev["time"] - seen["t0"] if seen.get("t0") and ev.get("time") else None)
            post["eta"] = duration(ev.get("eta"))
            seen["post"] = post
            bar.set_postfix(post, refresh=False)
            bar.set_description_str("training", refresh=False)
            bar.refresh()
        elif t == "eval" and not quiet:
            tqdm.write("eval: " + metrics_text({k: v for k, v in ev.items() if k not in ("i", "time", "type")}))
        elif t == "comparison" and not quiet:
            tqdm.write(f"held-out {ev.get('metric')}: {ev.get('words')}")
        elif t == "warm_start":
            inner = ev.get("event")
            if inner == "phase":
                show_phase(f"warm start (SFT) · {phases.describe(ev)}")
            elif inner == "step":
                show_phase(f"warm start (SFT) · step {ev.get('step')}/{ev.get('total')}")
                if not quiet and (ev.get("step") == ev.get("total") or ev.get("step") == 1):
                    tqdm.write(f"warm start (SFT) step {ev.get('step')}/{ev.get('total')}: "
                               f"loss {ev.get('loss', 0):.4g}")
            elif inner == "eval" and not quiet:
                tqdm.write(f"warm start (SFT) eval loss {ev.get('eval_loss', 0):.4g}")
            elif inner == "finished" and not quiet:
                tqdm.write("warm start (SFT) finished")
        elif t == "warning" and not quiet:
            tqdm.write(f"warning: {ev['message']}")
        elif t == "sample" and not quiet:
            tqdm.write(f"sample (step {ev.get('step')}): {ev.get('completion', '')[:200]!r}")
        elif t == "samples" and not quiet:
            tqdm.write(samples_text(ev))
        elif t == "more_steps" and not quiet:
            tqdm.write(more_steps_text(ev))
        elif t == "error":
            tqdm.write(f"error: {ev['message']}", file=sys.stderr)
            seen["status"] = 2 if ev.get("kind") == "input" else 1
        elif t in ("finished", "stopped"):
            bar.close()
            where = f"adapter in {ev['adapter']}" if ev.get("adapter") else "no adapter yet"
            tqdm.write(f"{t}: {where}; {metrics_text(ev.get('metrics', {}))}")
            seen["status"] = 0

    def kill() -> int:
        bar.close()
        print("\nkilling the worker...", file=sys.stderr)
        run.kill()
        last = run.dir.last_checkpoint()
        print(f"killed; `edgetune resume {run.name}` continues from its step-{last[0]} checkpoint"
              if last else "killed before any checkpoint: a resume starts over from step 0", file=sys.stderr)
        return 130

    stopping = False
    try:
        while True:
            try:
                for ev in run.events(seen["i"], follow_live=True):
                    seen["i"] = ev["i"] + 1
                    on_event(ev)
                break
            except KeyboardInterrupt:
                if stopping:
                    return kill()
                stopping = True
                try:
                    tqdm.write("stopping after the current step or evaluation batch (Ctrl-C again to kill)...",
                               file=sys.stderr)
                    run.stop()
                    show_phase("stopping")
                except KeyboardInterrupt:  # the second Ctrl-C came while the first was being handled
                    return kill()
    finally:
        bar.close()
    try:
        run.wait(30)  # the worker writes its last event a moment before it exits: return when it is gone
    except KeyboardInterrupt:  # a Ctrl-C while the worker winds down still means "kill it now"
        return kill()
    if run.status() == "crashed":
        print(f"error: {run.death()}", file=sys.stderr)
        return 1
    return seen["status"]


def _run_arg(value: str, runs_dir: str = "runs") -> str:
    """A run as the user names it: a path, or a name as `edgetune runs` prints it."""
    from pathlib import Path

    if Path(value).expanduser().exists():
        return value
    named = Path(runs_dir) / value
    if named.is_dir():
        return str(named)
    raise EdgetuneError(f"no run or folder '{value}' (not a path, and not in {runs_dir}/; "
                        f"edgetune runs --runs-dir {runs_dir} lists the runs)")


def cmd_train(a) -> int:
    from edgetune.engine.core import distributed

    from edgetune.engine.run import api

    if distributed.launched():  # one of several ranks that torchrun started
        return _train_as_rank(a)
    if a.nnodes > 1:
        return _exec_torchrun(a)
    check_gpus(a.gpus)
    cfg = _config(a)
    if a.queue:
        from pathlib import Path

        from edgetune.engine.run import queue

        job = queue.add_run(cfg, gpus=a.gpus)
        runs = cfg.run.runs_dir
        print(f"queued as job {job['id']} (run folder {Path(runs).resolve() / job['folder']}, place "
              f"{queue.position(runs, job['id'])} in the queue); it runs in the app (edgetune ui --runs-dir {runs}) "
              f"or with: edgetune queue run --runs-dir {runs}")
        return 0
    run = api.start(cfg, name=a.name, gpus=a.gpus, job=a.queue_job)
    print(f"run folder: {run.path}" + (f" ({a.gpus} ranks)" if a.gpus > 1 else ""))
    if a.detach:
        return 0
    return watch(run)


def _job_line(j: dict, place: int | None = None) -> str:
    from datetime import datetime

    what = f"{j.get('method') or ''} {j.get('steps') or '?'} steps".strip() if j["kind"] == "train" else j["kind"]
    if place is None:  # an ended job
        when = datetime.fromtimestamp(j["ended"]).strftime("%Y-%m-%d %H:%M")
        return f"  job {j['id']:<4} {j['status']:9s} {j['folder']:32s} {when}" + \
            (f"  {_one_line(j['message'], 100)}" if j.get("message") and j["status"] != "finished" else "")
    return f"{place:>3}. job {j['id']:<4} {j.get('state', 'queued'):9s} {j['folder']:32s} {what}"


def cmd_queue(a) -> int:
    from pathlib import Path

    from edgetune.engine.run import queue

    runs = a.runs_dir
    if a.action == "list":
        jobs, ended = queue.jobs(runs), queue.history(runs)
        pid = queue.driver_pid(runs)
        print(f"queue of {Path(runs).resolve()}: {len(jobs)} job{'s' if len(jobs) != 1 else ''}; "
              + (f"run by pid {pid}" if pid else "no process runs it now (edgetune queue run, or the app)"))
        for i, j in enumerate(jobs):
            print(_job_line(j, i + 1))
        if ended and a.all:
            print("ended:")
            for j in ended:
                print(_job_line(j))
        return 0
    if a.action == "run":
        queue.Driver(runs, say=lambda line: print(line, flush=True)).run(wait=a.wait)
        return 0
    if a.job is None:
        raise EdgetuneError(f"edgetune queue {a.action}: give the job's number (edgetune queue list shows them)")
    if a.action == "cancel":
        job = queue.cancel(runs, a.job)
        print(f"job {job['id']} ({job['folder']}) taken out of the queue")
        return 0
    places = {"up": -1, "down": 1}
    if a.to is None and a.action in places:
        now = queue.position(runs, a.job) if any(j["id"] == a.job for j in queue.jobs(runs)) else 0
        a.to = now + places[a.action]
    if a.to is None:
        raise EdgetuneError("edgetune queue move: give --to N (1 = next to run)")
    print(f"job {a.job} is now number {queue.move(runs, a.job, a.to)} in the queue")
    return 0


def check_gpus(n: int | None) -> None:
    """--gpus (already within its range): on a machine without a CUDA GPU every rank is a
    CPU process (gloo), so at most one a core."""
    import os

    from edgetune.engine.planning.planner import gpu_memory

    if n is None:
        return
    cores = os.cpu_count() or 1
    if n > cores and gpu_memory() is None:
        raise EdgetuneError(f"--gpus {n}: this machine has no CUDA GPU, so each rank would be a CPU process; "
                            f"at most {cores} (its CPU cores)")


def _exec_torchrun(a) -> int:
    """Several machines: this machine's share of the ranks under torchrun, which meets the
    other machines at --rdzv-endpoint; every rank runs `edgetune train` (below)."""
    import os

    if not a.rdzv_endpoint:
        raise EdgetuneError("--nnodes > 1 needs --rdzv-endpoint HOST:PORT (the same on every machine)")
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={a.nnodes}", f"--nproc-per-node={a.gpus}",
           "--rdzv-backend=c10d", f"--rdzv-endpoint={a.rdzv_endpoint}", f"--rdzv-id={a.rdzv_id}"]
    if a.node_rank is not None:
        cmd.append(f"--node-rank={a.node_rank}")
    cmd += ["-m", "edgetune.engine.cli", "train"]
    for flag, value in (("--preset", a.preset), ("--config", a.config), ("--name", a.name),
                        ("--runs-dir", a.runs_dir)):
        if value:
            cmd += [flag, value]
    for s in a.set or []:
        cmd += ["--set", s]
    print(" ".join(cmd), file=sys.stderr, flush=True)
    os.execv(sys.executable, cmd)
    return 1  # not reached


def _train_as_rank(a) -> int:
    """`torchrun ... -m edgetune.engine.cli train ...`: every rank trains in its own
    process (no worker is spawned); rank 0 makes the run folder and prints the steps."""
    import threading

    from edgetune.engine.core import distributed as dist
    from edgetune.engine.core.events import follow

    from edgetune.engine.run import api, worker

    dist.init()
    made = fd = None
    if dist.is_main():
        try:
            run, fd = api.create(_config(a), name=a.name)
            made = ("ok", str(run.path))
        except EdgetuneError as e:
            made = ("error", str(e))
    made = dist.broadcast_object(made)
    if made[0] == "error":
        dist.shutdown()
        if fd is None and dist.is_main():
            raise EdgetuneError(made[1])
        return 2
    path = made[1]
    done = threading.Event()
    main = dist.is_main()  # (worker.run leaves the process group at its end)
    if main:
        print(f"run folder: {path} ({dist.world()} ranks)", flush=True)

        def show():
            for ev in follow(f"{path}/events.jsonl", alive=lambda: not done.is_set()):
                if ev["type"] == "step":
                    nums = ", ".join(f"{k} {ev[k]:.4g}" for k in ("loss", "reward_mean", "best") if k in ev)
                    print(f"step {ev['step']}/{ev.get('total')}: {nums}", flush=True)
                elif ev["type"] in ("error", "warning"):
                    print(f"{ev['type']}: {ev['message']}", file=sys.stderr, flush=True)
                elif ev["type"] in ("finished", "stopped"):
                    print(f"{ev['type']}: adapter in {ev.get('adapter')}", flush=True)

        shower = threading.Thread(target=show, daemon=True)
        shower.start()
    try:
        return worker.run(path, owns_pid=main)
    finally:
        done.set()
        if main:
            shower.join(10)  # the last events printed
        if fd is not None:
            import os

            os.close(fd)


def cmd_resume(a) -> int:
    from edgetune.engine.run import api

    a.run = _run_arg(a.run, a.runs_dir)
    check_gpus(a.gpus)
    before = list(api.open_run(a.run).events())
    start = before[-1]["i"] + 1 if before else 0  # counted before the worker starts writing
    run = api.resume(a.run, gpus=a.gpus, allow_code=a.allow_code or (), more=a.more_steps)
    if not a.detach:
        return watch(run, start=start, resuming=True)
    # Detached: wait only for the worker's choice of checkpoint (or its refusal).
    for ev in run.events(start, follow_live=True):
        if ev["type"] == "warning":
            print(f"warning: {ev['message']}", file=sys.stderr)
        elif ev["type"] == "error":
            print(f"error: {ev['message']}", file=sys.stderr)
            return 2 if ev.get("kind") == "input" else 1
        elif ev["type"] == "started":
            print(_resumed_line(run, ev))
            return 0
    print(f"error: {run.death()}", file=sys.stderr)
    return 1


def cmd_export(a) -> int:
    import signal

    from edgetune.engine.run import api

    a.run = _run_arg(a.run, a.runs_dir)
    # SIGTERM ends through the export's cleanup (its temporary folder removed), as Ctrl-C does
    before = signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    try:
        out = api.export(a.run, a.out, merged=a.merged, as_zip=a.zip, force=a.force, gguf=a.gguf)
    finally:
        signal.signal(signal.SIGTERM, before)
    print(f"exported to {out}")
    if a.gguf:
        from edgetune.engine.models.export_gguf import CHECK_FILE, check_line

        print(check_line(json.loads((out / "gguf" / CHECK_FILE).read_text())))
    return 0


def cmd_runs(a) -> int:
    from edgetune.engine.run import api

    for s in api.summaries(a.runs_dir):
        metrics = metrics_text(s["metrics"])
        if s["status"] == "damaged":
            print(f"{s['name']:32s} damaged   {s['message']}")
            continue
        damaged = s.get("damaged_event_lines") or 0
        note = f"  ({damaged} damaged line{'s' if damaged != 1 else ''} in events.jsonl, skipped)" if damaged else ""
        print(f"{s['name']:32s} {s['status']:9s} {s['method'] or '':6s} step {s['step']}/{s['total'] or '?'}  "
              f"{metrics}{note}")
    return 0


def cmd_rename(a) -> int:
    from edgetune.engine.run import api

    where = api.rename_run(_run_arg(a.run, a.runs_dir), a.new_name)
    print(f"renamed to {where}")
    return 0


def cmd_delete(a) -> int:
    """A run to <runs_dir>/.trash (never a training one); `edgetune restore` brings it back."""
    from edgetune.engine.run import api

    where = api.trash_run(_run_arg(a.run, a.runs_dir))
    print(f"moved to {where} (edgetune restore {where.name} --runs-dir {a.runs_dir} brings it back)")
    return 0


def cmd_restore(a) -> int:
    from edgetune.engine.run import api

    if not a.name:
        names = api.trashed_runs(a.runs_dir)
        print("\n".join(names) if names else f"the trash of {a.runs_dir} is empty")
        return 0
    print(f"restored to {api.restore_run(a.runs_dir, a.name)}")
    return 0


def cmd_presets(a) -> int:
    import shutil
    import textwrap

    from edgetune.engine.core.config_files import list_presets, preset_description

    width = max(60, min(shutil.get_terminal_size((100, 20)).columns, 120))
    for name, path in list_presets().items():
        lines = textwrap.wrap(preset_description(path), width - 18) or [""]
        print(f"{name:16s}  {lines[0]}")
        for more in lines[1:]:
            print(f"{'':16s}  {more}")
    return 0


def cmd_data(a) -> int:
    from edgetune.engine.core.settings import DataSettings, ModelSettings

    from edgetune.engine.models import model as model_lib

    from edgetune.engine import data as data_lib

    ds = DataSettings(path=a.path, format=a.format, max_seq_len=a.max_seq_len)
    fmt = data_lib.preview(a.path, a.format, 1)[1]
    tty, shown = sys.stderr.isatty(), []

    def progress(rows: int, read: int, total: int) -> None:  # a long file: how far the check got
        shown.append(rows)
        done = f" ({read / 2**20:.0f} of {total / 2**20:.0f} MiB)" if total else ""
        print(f"{chr(13) if tty else ''}checking {a.path}: {rows:,} rows{done}", end="" if tty else "\n",
              file=sys.stderr, flush=True)

    if fmt == "rl":
        report = data_lib.load_rl(ds, 0, progress=progress).report
    else:
        tok = model_lib.load_tokenizer(model_lib.resolve_model_path(a.model or ModelSettings().name))
        load = data_lib.load_pairs if fmt == "pairs" else data_lib.load_sft
        report = load(ds, tok, 0, progress).report
    if tty and shown:
        print(file=sys.stderr)  # ends the \r line
    print(report.summary())
    return 0


def decided_rows(est: dict) -> list[tuple[str, str]]:
    """What the run will do for every `auto` setting (engine/planning/effective.py), in words."""
    eff = est.get("effective") or {}
    if not eff:
        return []
    on = {True: "on", False: "off"}
    layers = (est.get("model") or {}).get("layers")
    ck = eff.get("checkpointed_layers")
    checkpointing = (f"all {layers} decoder layers" if ck is None or ck == layers else
                     "off" if ck == 0 else f"the first {ck} of {layers} decoder layers")
    rows = [("device", eff["device"]),
            ("dtype", eff["dtype"] + (" (autocast)" if eff["autocast"] else "")),
            ("attention", eff["attn_implementation"]),
            ("gradient checkpointing", checkpointing)]
    if not RECORDS[est["method"]].gradients:
        rows.append(("candidates per batch", str(eff["candidates_per_batch"])))
    else:
        rows += [("optimizer", eff["optimizer"] + (" (fused)" if eff["fused_optimizer"] else "")),
                 ("sebp", on[eff["sebp"]]), ("liger", on[eff["liger"]])]
        if RECORDS[est["method"]].packing:
            rows.append(("packing", on[eff["packing"]]))
    rows.append(("loss chunk", f"{eff['loss_chunk_rows']} rows"))
    return rows


def estimate_table(est: dict) -> str:
    """The planner's parts in GiB, as the page shows them, then the decided settings."""
    rows = [(k.replace("_", " "), est.get(k) or 0) for k in est.get("parts", [])] + [("total", est.get("total") or 0)]
    width = max(len(k) for k, _ in rows)
    lines = [est.get("verdict", ""), ""]
    if est.get("shape"):
        lines[1:1] = [f"peak step shape: {est['shape']}"]
    lines.append(f"{'part':{width}s}  {'GiB':>7s}")
    lines += [f"{k:{width}s}  {v / 2**30:7.2f}" for k, v in rows]
    if not est.get("gpu_total"):
        lines.append("(no GPU visible here: the parts are those of a CUDA card; a CPU run computes in fp32 "
                     "without a CUDA context, so its memory differs)")
    decided = decided_rows(est)
    if decided:
        w = max(len(k) for k, _ in decided)
        lines += ["", "decided (every auto setting, as the run will do it):"]
        lines += [f"  {k:{w}s}  {v}" for k, v in decided]
    lines += [f"note: {n}" for n in est.get("notes") or []]
    return "\n".join(lines)


def cmd_estimate(a) -> int:
    from edgetune.engine.planning.timing import words as timing_words

    from edgetune.engine.run import api

    cfg = _config(a)
    est = {**api.estimate(cfg, gpus=a.gpus), "time": api.time_estimate(cfg)}
    print(json.dumps(est, indent=2) if a.json else estimate_table(est) + "\n" + timing_words(est["time"]))
    return 0


def _score(x: dict, proportion: bool) -> str:
    """A score and its 95% interval: shares in percent, other means as they are."""
    if not proportion:
        return f"{x['estimate']:.3f} [{x['low']:.3f}, {x['high']:.3f}]"
    return f"{100 * x['estimate']:5.1f}% [{100 * x['low']:.1f}, {100 * x['high']:.1f}]"


def _task_head(t: dict) -> str:
    what = {"generative": f"graded by {t.get('reward_fn')}", "loss": "mean token loss (lower is better)",
            "harness": "lm-evaluation-harness"}
    return (f"{t['task']}: {t['prompts']} {t.get('unit', 'prompts')}, {what.get(t['kind'], t['kind'])}; "
            f"each score with its 95% interval")


def eval_table(result: dict) -> str:
    """`edgetune eval`'s tables, one a task: each system's scores with their 95% intervals,
    then each pair compared on the same items, in numbers and in words."""
    from edgetune.engine.training.stats import TESTS, p_text

    lines = []
    for t in result["tasks"]:
        systems = t["systems"]
        metrics = t.get("metrics") or list(dict.fromkeys(m for s in systems for m in s["scores"]))
        shares = set(t.get("shares", ()))
        cells = [[_score(s["scores"][m], m in shares) if m in s["scores"] else "–" for m in metrics]
                 for s in systems]
        names = [s["name"] for s in systems]
        nw = max(len(n) for n in names + ["system"])
        widths = [max(len(m), *(len(c[j]) for c in cells)) for j, m in enumerate(metrics)]
        lines += ([""] if lines else []) + [_task_head(t), "",
                                            f"{'system':{nw}s}  " + "  ".join(f"{m:{w}s}" for m, w in zip(metrics, widths))]
        lines += [f"{n:{nw}s}  " + "  ".join(f"{c:{w}s}" for c, w in zip(row, widths)) for n, row in zip(names, cells)]
        for s in systems:
            if s.get("adapter"):
                lines.append(f"  {s['name']}: {s['adapter']}")
        if t["comparisons"]:
            lines += ["", f"paired on the same {t.get('unit', 'prompts')}:"]
            for c in t["comparisons"]:
                unit = (lambda x: f"{100 * x:+.1f} pts") if c["kind"] == "proportion" else (lambda x: f"{x:+.3f}")
                lines.append(f"  {c['b']} vs {c['a']}, {c['metric']}: {unit(c['difference'])} "
                             f"[{unit(c['low'])}, {unit(c['high'])}], {p_text(c['p_value'])} ({TESTS[c['kind']]})")
                lines.append(f"    {c['words']}")
    return "\n".join(ln.rstrip() for ln in lines)


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
    from tqdm import tqdm
    from transformers.utils import logging as hf_logging

    from edgetune.engine.run import evaluation

    hf_logging.disable_progress_bar()  # one bar here: ours
    cfg = _config(a)
    tasks = list(dict.fromkeys(a.task or [evaluation.HELD_OUT]))
    evaluation.check_tasks(cfg, tasks)  # a task that cannot be graded: its one line, before loading
    systems = [(name, _run_arg(path, a.runs_dir) if path else "")
               for name, path in evaluation.system_names(a.adapter or [], a.base)]
    if not systems:
        raise EdgetuneError("nothing to evaluate: give --adapter RUN (repeatable) and/or --base")
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


def cmd_ui(a) -> int:
    import ipaddress

    from edgetune.app.main import launch

    print(f"edgetune: starting the app on {a.host}:{a.port} (runs in {a.runs_dir}) ...", flush=True)
    demo = launch(host=a.host, port=a.port, runs_dir=a.runs_dir, block=False, auth=a.auth,
                  insecure_no_auth=a.insecure_no_auth, allow_hosts=a.allow_host)
    try:
        local = a.host in ("localhost",) or ipaddress.ip_address(a.host).is_loopback
    except ValueError:
        local = False
    shown = "127.0.0.1" if a.host in ("0.0.0.0", "::") else a.host
    reach = "this machine only" if local else "reachable from the network"
    login = "login required" if getattr(demo, "auth", None) else "no login"
    print(f"edgetune ready: http://{shown}:{a.port}/  ({reach}; {login}; Ctrl-C to quit)", flush=True)
    import time

    try:
        while demo.is_running:  # Gradio's block_thread, without its own message at Ctrl-C
            time.sleep(0.1)
    finally:
        demo.close()
        demo.edgetune_chat.close()
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetune", description="Fine-tune LoRA adapters on a 4-bit model.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def config_args(sp):
        sp.add_argument("--preset", help="a preset name from presets/ (edgetune presets)")
        sp.add_argument("--config", help="a YAML file of settings")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. lora.r=32")

    t = sub.add_parser("train", help="start a run and follow it",
                       epilog="fgrpo.reward_file / essa.reward_file name a Python file that the run imports and "
                              "calls: it runs with your rights, so use only code you trust.")
    config_args(t)
    t.add_argument("--name", help="the run's folder name in the runs folder (default: run.name, else the method "
                                  "and the time)")
    t.add_argument("--runs-dir", help="the folder runs are kept in (default: run.runs_dir, which is runs)")
    t.add_argument("--detach", action="store_true", help="start and return; follow it later")
    t.add_argument("--gpus", "--nproc", dest="gpus", default=1,
                   help="GPUs of this machine to train on, data-parallel (torchrun, NCCL); on a machine "
                        "without CUDA, that many CPU processes (gloo), for tests")
    t.add_argument("--nnodes", default=1, help="machines (run the same command on each; needs "
                                               "--rdzv-endpoint)")
    t.add_argument("--node-rank", help="this machine's index (default: torchrun assigns one)")
    t.add_argument("--rdzv-endpoint", help="HOST:PORT of the first machine, where the machines meet")
    t.add_argument("--rdzv-id", default="edgetune", help="a name shared by the machines of one run")
    t.add_argument("--queue", action="store_true",
                   help="add the run to the runs folder's queue instead of starting it now: queued runs train one "
                        "after another, in the app or under `edgetune queue run` (edgetune queue list shows them)")
    t.add_argument("--queue-job", help=argparse.SUPPRESS)  # the queue's driver: the token its run folder carries
    t.set_defaults(fn=cmd_train)

    q = sub.add_parser("queue", help="the queued jobs: list, run them one after another, cancel or move one",
                       description="Jobs queued with `edgetune train --queue` (or the app's Add to queue) run one "
                                   "after another, in order: in the app while it runs, or under `edgetune queue run`. "
                                   "The queue lives in the runs folder and survives restarts.")
    q.add_argument("action", nargs="?", default="list", choices=["list", "run", "cancel", "up", "down", "move"],
                   help="list (the default); run: run the jobs one after another until the queue is empty; cancel, "
                        "up, down, move (with --to N) a job that has not started")
    q.add_argument("job", nargs="?", help="the job's number, as list shows it")
    q.add_argument("--to", metavar="N", help="move: the job's new place (1 = next to run)")
    q.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    q.add_argument("--all", action="store_true", help="list: also the jobs that ended (the last 50)")
    q.add_argument("--wait", action="store_true", help="run: when the queue is empty, wait for more jobs (until "
                                                        "Ctrl-C)")
    q.set_defaults(fn=cmd_queue)

    r = sub.add_parser("resume", help="continue a stopped or crashed run from its last checkpoint (--more-steps: "
                                      "train a run further)")
    r.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    r.add_argument("--detach", action="store_true")
    r.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    r.add_argument("--gpus", "--nproc", dest="gpus",
                   help="GPUs to continue on (any number: checkpoints hold nothing rank-specific); default "
                        "as many as the run's last start")
    r.add_argument("--allow-code", action="append", metavar="FILE_OR_MODEL",
                   help="run this Python when resuming: the reward_file, or for model.trust_remote_code the "
                        "model, exactly as the run's config.yaml names it (repeat for both). Without it, a run "
                        "whose settings run Python other than edgetune's is refused: a run folder may come "
                        "from anyone")
    r.add_argument("--more-steps", metavar="N",
                   help="train N steps past the run's step count, a finished run too (from its final checkpoint, "
                        "with its optimizer state); the learning rate stays at the schedule's final value for them")
    r.set_defaults(fn=cmd_resume)

    e = sub.add_parser("export", help="copy a run's adapter (PEFT format) to a new or empty folder")
    e.add_argument("run", help="a run folder, an adapter folder, or a run name as `edgetune runs` prints it")
    e.add_argument("--out", required=True,
                   help="a new folder; with --zip a file (.zip added when it has no extension; into an existing "
                        "folder: <run name>.zip there)")
    e.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    e.add_argument("--merged", action="store_true", help="also fold the adapter into a bf16 copy of the base")
    e.add_argument("--zip", action="store_true", help="write a .zip instead of a folder")
    e.add_argument("--gguf", action="store_true",
                   help="also write gguf/: the LoRA as a llama.cpp GGUF adapter and an Ollama Modelfile; with "
                        "--merged, the merged model as F16 and Q8_0 GGUF (instead of merged/); checked in llama.cpp "
                        "when llama-cpp-python is installed (gguf/gguf-check.json)")
    e.add_argument("--force", action="store_true",
                   help="replace a previous export at --out (never anything else: a non-empty folder or a file "
                        "that an export did not write is refused)")
    e.set_defaults(fn=cmd_export)

    ls = sub.add_parser("runs", help="list runs")
    ls.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    ls.set_defaults(fn=cmd_runs)

    rn = sub.add_parser("rename", help="give a run (not a training one) a new name")
    rn.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    rn.add_argument("new_name")
    rn.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    rn.set_defaults(fn=cmd_rename)
    dl = sub.add_parser("delete", help="move a run (not a training one) to <runs-dir>/.trash; restore brings it back")
    dl.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    dl.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    dl.set_defaults(fn=cmd_delete)
    rs = sub.add_parser("restore", help="bring a run back from <runs-dir>/.trash (no name: list the trash)")
    rs.add_argument("name", nargs="?", default="")
    rs.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    rs.set_defaults(fn=cmd_restore)

    ps = sub.add_parser("presets", help="list presets")
    ps.set_defaults(fn=cmd_presets)

    d = sub.add_parser("data", help="validate a data file and print its report")
    d.add_argument("path")
    d.add_argument("--format", default="auto")
    d.add_argument("--max-seq-len", default=512)
    d.add_argument("--model", help="tokenizer of this model (default: the embedded one)")
    d.set_defaults(fn=cmd_data)

    es = sub.add_parser("estimate", help="predict peak memory of a configuration")
    config_args(es)
    es.add_argument("--json", action="store_true", help="the planner's raw numbers (bytes) as JSON")
    es.add_argument("--gpus", default=1, help="the peak of each GPU of a data-parallel run on that many")
    es.set_defaults(fn=cmd_estimate)

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
    ev.add_argument("--json", action="store_true",
                    help="scores, intervals, per-prompt outcomes and comparisons as JSON, no progress bar")
    ev.set_defaults(fn=cmd_eval)

    u = sub.add_parser("ui", help="start the browser app")
    u.add_argument("--host", default="127.0.0.1",
                   help="the address to serve on (default 127.0.0.1: this machine only; another needs --auth)")
    u.add_argument("--port", default=7860, help="the port to serve on (default 7860)")
    u.add_argument("--runs-dir", default="runs",
                   help="where the page lists, starts and reads runs (default runs/ in the current folder)")
    u.add_argument("--auth", metavar="USER:PASSWORD",
                   help="require this login (required with a --host other than 127.0.0.1)")
    u.add_argument("--insecure-no-auth", action="store_true",
                   help="serve a non-local --host without a login: anyone who reaches the port can start runs "
                        "and run reward_file Python as you")
    u.add_argument("--allow-host", action="append", metavar="NAME",
                   help="also answer requests addressed to this host name (a reverse proxy's or a LAN name); "
                        "localhost, the --host and IP addresses always work, any other name is refused "
                        "(a web page could point its own domain at this port). Repeatable")
    u.set_defaults(fn=cmd_ui)
    return p


def flag_ranges() -> dict:
    """The numeric flags that are not settings: their dest -> (the flag, its Range). A
    setting's own flag (--max-seq-len) takes the setting's range."""
    from edgetune.engine.core import settings as S

    return {"gpus": ("--gpus", S.GPUS), "nnodes": ("--nnodes", S.NODES), "node_rank": ("--node-rank", S.NODE_RANK),
            "more_steps": ("--more-steps", S.MORE_STEPS), "port": ("--port", S.PORT),
            "job": ("job", S.QUEUE_NUMBER), "to": ("--to", S.QUEUE_NUMBER),
            "max_seq_len": ("--max-seq-len", S.declared()["data.max_seq_len"].metadata["range"])}


def _read_numbers(a) -> None:
    """Each numeric flag given, as an int within its range, or the one-line refusal."""
    from edgetune.engine.core.settings import typed_number

    for dest, (flag, rng) in flag_ranges().items():
        if getattr(a, dest, None) is not None:
            setattr(a, dest, typed_number(flag, getattr(a, dest), rng))


def _interrupted(a) -> str:
    """What a Ctrl-C left, in words, for the commands that end at the first one."""
    if a.cmd == "export":
        return (f"nothing was exported to {a.out} (what the export had written so far is removed)"
                if a.out else "nothing was exported")
    return {"data": f"the check of {getattr(a, 'path', '')} stopped; nothing was written",
            "estimate": "no estimate; nothing was written",
            "eval": "the evaluation stopped; nothing was written",
            "queue": "the queue stopped; a job that had started goes on (edgetune queue run continues the queue)",
            "ui": "the app stopped; runs it started go on training (edgetune runs lists them)"}[a.cmd]


# Commands that end at the first Ctrl-C (train and resume: the first one stops the run
# gracefully, the second kills its worker; see `watch`).
ENDS_AT_CTRL_C = ("export", "data", "estimate", "eval", "ui", "queue")


def _ctrl_c(signum, frame):
    """The first Ctrl-C: the command stops where it is and removes what it had half written
    (its `finally` blocks run); a second one, while it does, ends the process at once."""
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)
    raise KeyboardInterrupt


def main(argv=None) -> int:
    import signal

    a = build_parser().parse_args(argv)
    # only where Ctrl-C is Python's own (a background job ignores it; a caller may have its own)
    ours = a.cmd in ENDS_AT_CTRL_C and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    if ours:
        signal.signal(signal.SIGINT, _ctrl_c)
    try:
        _read_numbers(a)
        return a.fn(a)
    except KeyboardInterrupt:
        if a.cmd not in ENDS_AT_CTRL_C:
            raise
        if ours:  # the command has ended: a Ctrl-C from here to the exit changes nothing
            signal.signal(signal.SIGINT, signal.SIG_IGN)
            ours = False
        print(f"{chr(10) if sys.stderr.isatty() else ''}interrupted: {_interrupted(a)}", file=sys.stderr)
        return 130
    except EdgetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except BrokenPipeError:
        # the reader left (`edgetune estimate --json | head -1`): stop quietly, as cat does;
        # stdout goes to /dev/null so that flushing it at exit raises nothing either
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
    finally:
        if ours:
            signal.signal(signal.SIGINT, signal.default_int_handler)


if __name__ == "__main__":
    sys.exit(main())
