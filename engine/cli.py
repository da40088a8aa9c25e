"""The command line: every UI action, scriptable.

    edgetune train --preset sft-quickstart            # embedded default model + data, offline
    edgetune train --config my.yaml --set lora.r=32   # any setting overridable
    edgetune resume runs/<run>                        # continue from the last checkpoint
    edgetune export runs/<run> --out my-adapter/      # PEFT adapter (--zip, --merged)
    edgetune runs | presets | data FILE | estimate --preset X
    edgetune ui                                       # the Gradio app

Errors in the user's input print one line `error: ...` and exit with status 2; a run
that fails exits with 1 and its run folder says why.
"""

from __future__ import annotations

import argparse
import json
import sys

from .errors import EdgetuneError


def _config(a):
    from .settings import resolve

    if not a.preset and not a.config:
        raise EdgetuneError("give --preset NAME or --config FILE (edgetune presets lists the presets)")
    overrides = list(a.set or [])
    if getattr(a, "name", None):
        overrides.append(f"run.name={a.name}")
    if getattr(a, "runs_dir", None):
        overrides.append(f"run.runs_dir={a.runs_dir}")
    return resolve(preset=a.preset, config=a.config, overrides=overrides)


def _fmt_bytes(n) -> str:
    return f"{(n or 0) / 2**30:.2f} GiB"


def watch(run, start: int = 0, quiet: bool = False) -> int:
    """Follow a run's events with a progress bar; Ctrl-C stops gracefully, twice kills."""
    from tqdm import tqdm

    bar = None
    status = 1
    try:
        for ev in run.events(start, follow_live=True):
            t = ev["type"]
            if t == "started" and not quiet:
                tqdm.write(f"run {run.name}: {ev['method']} on {ev['device']}"
                           + (f", resumed from step {ev['resumed_from']}" if ev.get("resumed_from") else ""))
            elif t == "data" and not quiet:
                r = ev["report"]
                tqdm.write(f"data: {r.get('rows_kept')}/{r.get('rows_total')} rows kept ({r.get('format')}), "
                           f"dropped {r.get('dropped')}, truncated {r.get('truncated')}")
            elif t == "step":
                if bar is None:
                    bar = tqdm(total=ev.get("total"), initial=ev["step"] - 1, disable=quiet, unit="step",
                               dynamic_ncols=True)
                bar.n = ev["step"]
                shown = {k: ev[k] for k in ("loss", "reward_mean", "success_rate", "best", "mean") if k in ev}
                post = {k: f"{v:.4g}" for k, v in shown.items() if isinstance(v, (int, float))}
                if ev.get("gpu", {}).get("total"):
                    post["gpu"] = _fmt_bytes(ev["gpu"]["peak"])
                bar.set_postfix(post, refresh=False)
                bar.refresh()
            elif t == "eval" and not quiet:
                tqdm.write("eval: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                                for k, v in ev.items() if k not in ("i", "time", "type")))
            elif t == "warm_start" and not quiet and ev.get("event") in ("step", "eval", "finished"):
                inner = ev.get("event")
                if inner == "step":
                    tqdm.write(f"warm start (SFT) step {ev.get('step')}/{ev.get('total')}: loss {ev.get('loss', 0):.4g}")
                elif inner == "eval":
                    tqdm.write(f"warm start (SFT) eval loss {ev.get('eval_loss', 0):.4g}")
                else:
                    tqdm.write("warm start (SFT) finished")
            elif t in ("warning",) and not quiet:
                tqdm.write(f"warning: {ev['message']}")
            elif t == "sample" and not quiet:
                tqdm.write(f"sample (step {ev.get('step')}): {ev.get('completion', '')[:200]!r}")
            elif t == "error":
                tqdm.write(f"error: {ev['message']}", file=sys.stderr)
                status = 2 if ev.get("kind") == "input" else 1
            elif t in ("finished", "stopped"):
                if bar is not None:
                    bar.close()
                tqdm.write(f"{t}: adapter in {ev['adapter']}; metrics "
                           + json.dumps({k: round(v, 5) if isinstance(v, float) else v
                                         for k, v in ev.get("metrics", {}).items()}))
                status = 0
    except KeyboardInterrupt:
        print("\nstopping after the current step (Ctrl-C again to kill)...", file=sys.stderr)
        run.stop()
        try:
            return watch(run, start=0, quiet=True)
        except KeyboardInterrupt:
            run.kill()
            return 130
    finally:
        if bar is not None:
            bar.close()
    if status == 1 and run.status() == "crashed":
        print(f"error: the worker died without a word; see {run.dir.log_path}", file=sys.stderr)
    return status


def cmd_train(a) -> int:
    from . import api

    cfg = _config(a)
    run = api.start(cfg)
    print(f"run folder: {run.path}")
    if a.detach:
        return 0
    return watch(run)


def cmd_resume(a) -> int:
    from . import api

    run = api.resume(a.run)
    start = len(list(run.events()))
    return 0 if a.detach else watch(run, start=max(0, start - 0))


def cmd_export(a) -> int:
    from . import api

    out = api.export(a.run, a.out, merged=a.merged, as_zip=a.zip, force=a.force)
    print(f"exported to {out}")
    return 0


def cmd_runs(a) -> int:
    from . import api

    for r in api.list_runs(a.runs_dir):
        s = r.summary()
        metrics = ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in s["metrics"].items())
        print(f"{s['name']:32s} {s['status']:9s} {s['method'] or '':6s} step {s['step']}/{s['total']}  {metrics}")
    return 0


def cmd_presets(a) -> int:
    from .settings import list_presets

    for name, path in list_presets().items():
        first = next((ln.lstrip("# ").strip() for ln in path.read_text().splitlines() if ln.startswith("#")), "")
        print(f"{name:24s} {first}")
    return 0


def cmd_data(a) -> int:
    from . import data as data_lib
    from . import model as model_lib
    from .settings import DataSettings, ModelSettings

    ds = DataSettings(path=a.path, format=a.format, max_seq_len=a.max_seq_len)
    fmt = data_lib.preview(a.path, a.format, 1)[1]
    if fmt == "rl":
        report = data_lib.load_rl(ds, 0).report
    else:
        tok = model_lib.load_tokenizer(model_lib.resolve_model_path(a.model or ModelSettings().name))
        report = data_lib.load_sft(ds, tok, 0).report
    print(report.summary())
    return 0


def cmd_estimate(a) -> int:
    from . import api

    print(json.dumps(api.estimate(_config(a)), indent=2))
    return 0


def cmd_eval(a) -> int:
    from .fgrpo import evaluate_adapter

    cfg = _config(a)
    print(json.dumps(evaluate_adapter(cfg, a.adapter), indent=2))
    return 0


def cmd_ui(a) -> int:
    from edgetune.app.main import launch

    launch(host=a.host, port=a.port, runs_dir=a.runs_dir)
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="edgetune", description="Fine-tune LoRA adapters on a 4-bit model.")
    sub = p.add_subparsers(dest="cmd", required=True)

    def config_args(sp):
        sp.add_argument("--preset", help="a preset name from presets/ (edgetune presets)")
        sp.add_argument("--config", help="a YAML file of settings")
        sp.add_argument("--set", action="append", metavar="KEY=VALUE", help="override a setting, e.g. lora.r=32")

    t = sub.add_parser("train", help="start a run and follow it")
    config_args(t)
    t.add_argument("--name")
    t.add_argument("--runs-dir")
    t.add_argument("--detach", action="store_true", help="start and return; follow it later")
    t.set_defaults(fn=cmd_train)

    r = sub.add_parser("resume", help="continue a stopped or crashed run from its last checkpoint")
    r.add_argument("run")
    r.add_argument("--detach", action="store_true")
    r.set_defaults(fn=cmd_resume)

    e = sub.add_parser("export", help="copy a run's adapter (PEFT format) to a new or empty folder")
    e.add_argument("run")
    e.add_argument("--out", required=True)
    e.add_argument("--merged", action="store_true", help="also fold the adapter into a bf16 copy of the base")
    e.add_argument("--zip", action="store_true", help="write a .zip instead of a folder")
    e.add_argument("--force", action="store_true",
                   help="replace a previous export at --out (never anything else: a non-empty folder or a file "
                        "that an export did not write is refused)")
    e.set_defaults(fn=cmd_export)

    ls = sub.add_parser("runs", help="list runs")
    ls.add_argument("--runs-dir", default="runs")
    ls.set_defaults(fn=cmd_runs)

    ps = sub.add_parser("presets", help="list presets")
    ps.set_defaults(fn=cmd_presets)

    d = sub.add_parser("data", help="validate a data file and print its report")
    d.add_argument("path")
    d.add_argument("--format", default="auto")
    d.add_argument("--max-seq-len", type=int, default=512)
    d.add_argument("--model", help="tokenizer of this model (default: the embedded one)")
    d.set_defaults(fn=cmd_data)

    es = sub.add_parser("estimate", help="predict peak memory of a configuration")
    config_args(es)
    es.set_defaults(fn=cmd_estimate)

    ev = sub.add_parser("eval", help="pass@1 / pass@k of an adapter on the held-out prompts")
    config_args(ev)
    ev.add_argument("--adapter", required=True)
    ev.set_defaults(fn=cmd_eval)

    u = sub.add_parser("ui", help="start the browser app")
    u.add_argument("--host", default="127.0.0.1")
    u.add_argument("--port", type=int, default=7860)
    u.add_argument("--runs-dir", default="runs")
    u.set_defaults(fn=cmd_ui)
    return p


def main(argv=None) -> int:
    a = build_parser().parse_args(argv)
    try:
        return a.fn(a)
    except EdgetuneError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
