"""The runs folder: `edgetune runs`, `rename`, `delete` (to its trash) and `restore`."""

from __future__ import annotations

from edgetune.engine.core.metric_words import metrics_text

from edgetune.engine.run import api

from edgetune.engine.cli.common import run_arg


def cmd_runs(a) -> int:
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
    where = api.rename_run(run_arg(a.run, a.runs_dir), a.new_name)
    print(f"renamed to {where}")
    return 0


def cmd_delete(a) -> int:
    """A run to <runs_dir>/.trash (never a training one); `edgetune restore` brings it back."""
    where = api.trash_run(run_arg(a.run, a.runs_dir))
    print(f"moved to {where} (edgetune restore {where.name} --runs-dir {a.runs_dir} brings it back)")
    return 0


def cmd_restore(a) -> int:
    if not a.name:
        names = api.trashed_runs(a.runs_dir)
        print("\n".join(names) if names else f"the trash of {a.runs_dir} is empty")
        return 0
    print(f"restored to {api.restore_run(a.runs_dir, a.name)}")
    return 0


def add_runs_parser(sub) -> None:
    """`edgetune runs`."""
    ls = sub.add_parser("runs", help="list runs")
    ls.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    ls.set_defaults(fn=cmd_runs)


def add_rename_parser(sub) -> None:
    """`edgetune rename`."""
    rn = sub.add_parser("rename", help="give a run (not a training one) a new name")
    rn.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    rn.add_argument("new_name")
    rn.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    rn.set_defaults(fn=cmd_rename)


def add_delete_parser(sub) -> None:
    """`edgetune delete`."""
    dl = sub.add_parser("delete", help="move a run (not a training one) to <runs-dir>/.trash; restore brings it back")
    dl.add_argument("run", help="a run folder, or a run name as `edgetune runs` prints it")
    dl.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    dl.set_defaults(fn=cmd_delete)


def add_restore_parser(sub) -> None:
    """`edgetune restore`."""
    rs = sub.add_parser("restore", help="bring a run back from <runs-dir>/.trash (no name: list the trash)")
    rs.add_argument("name", nargs="?", default="")
    rs.add_argument("--runs-dir", default="runs", help="the runs folder (default: runs)")
    rs.set_defaults(fn=cmd_restore)
