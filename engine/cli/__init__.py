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
    edgetune serve                                    # the base + adapters, OpenAI-compatible API
    edgetune merge RUN_A RUN_B --method ties --out m/ # adapters combined into a new one

Errors in the user's input print one line `error: ...` and exit with status 2; a run
that fails exits with 1 and its run folder says why.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys

# Nothing here imports more than the standard library: a Ctrl-C while the commands' modules
# load is answered in one line by main(), which can only do so once this module has loaded.
from edgetune.engine.core import interrupts

__all__ = ["build_parser", "flag_ranges", "main"]


def build_parser() -> argparse.ArgumentParser:
    """`edgetune`'s commands, each one's flags from its own module, in the order `--help` lists them."""
    # lazy: each command's module imports the engine, seconds on a loaded machine; main()
    # answers a Ctrl-C during those imports in one line
    from edgetune.engine.run import merge, serve  # the commands' own modules, flags beside their code

    from edgetune.engine.cli import data, estimate, evaluate, export, presets, queue, runs, train, ui

    p = argparse.ArgumentParser(prog="edgetune", description="Fine-tune LoRA adapters on a 4-bit model.")
    sub = p.add_subparsers(dest="cmd", required=True)
    train.add_train_parser(sub)
    queue.add_parser(sub)
    train.add_resume_parser(sub)
    export.add_parser(sub)
    runs.add_runs_parser(sub)
    runs.add_rename_parser(sub)
    runs.add_delete_parser(sub)
    runs.add_restore_parser(sub)
    presets.add_parser(sub)
    data.add_parser(sub)
    estimate.add_parser(sub)
    evaluate.add_parser(sub)
    ui.add_parser(sub)
    serve.add_parser(sub)
    merge.add_parser(sub)
    return p


def flag_ranges() -> dict:
    """The numeric flags that are not settings: their dest -> (the flag, its Range). A
    setting's own flag (--max-seq-len) takes the setting's range."""
    from edgetune.engine.core import settings as S

    return {"gpus": ("--gpus", S.GPUS), "nnodes": ("--nnodes", S.NODES), "node_rank": ("--node-rank", S.NODE_RANK),
            "more_steps": ("--more-steps", S.MORE_STEPS), "port": ("--port", S.PORT),
            "job": ("job", S.QUEUE_NUMBER), "to": ("--to", S.QUEUE_NUMBER),
            "max_seq_len": ("--max-seq-len", S.declared()["data.max_seq_len"].metadata["range"]),
            "chunk_overlap": ("--chunk-overlap", S.declared()["data.chunk_overlap"].metadata["range"])}


def _read_numbers(a) -> None:
    """Each numeric flag given, as an int within its range, or the one-line refusal."""
    from edgetune.engine.core import settings as S

    for dest, (flag, rng) in flag_ranges().items():
        if getattr(a, dest, None) is not None:
            setattr(a, dest, S.typed_number(flag, getattr(a, dest), rng))


def _interrupted(a) -> str:
    """What a Ctrl-C left, in words, for the commands that end at the first one."""
    if a.cmd == "export":
        return (f"nothing was exported to {a.out} (what the export had written so far is removed)"
                if a.out else "nothing was exported")
    return {"data": f"the check of {getattr(a, 'path', '')} stopped; nothing was written",
            "estimate": "no estimate; nothing was written",
            "eval": "the evaluation stopped; nothing was written",
            "merge": f"nothing was merged into {getattr(a, 'out', '')}",
            "queue": "the queue stopped; a job that had started goes on (edgetune queue run continues the queue)",
            "ui": "the app stopped; runs it started go on training (edgetune runs lists them)"}[a.cmd]


# Commands that end at the first Ctrl-C (train and resume: the first one stops the run
# gracefully, the second kills its worker; see `watch`).
ENDS_AT_CTRL_C = ("export", "data", "estimate", "eval", "ui", "queue", "merge")


def main(argv=None) -> int:
    # only where Ctrl-C is Python's own (a background job ignores it; a caller may have its own)
    default = signal.getsignal(signal.SIGINT) is signal.default_int_handler
    early: list = []  # a Ctrl-C while the commands' modules load: answered once they have (no work began)
    if default:
        signal.signal(signal.SIGINT, lambda *_: early.append(True))
    try:
        a = build_parser().parse_args(argv)
    finally:
        if default:
            signal.signal(signal.SIGINT, signal.default_int_handler)
    ours = a.cmd in ENDS_AT_CTRL_C and default
    if early:
        if a.cmd not in ENDS_AT_CTRL_C:
            raise KeyboardInterrupt
        print(f"{chr(10) if sys.stderr.isatty() else ''}interrupted: {_interrupted(a)}", file=sys.stderr)
        return 130
    if ours:  # the first Ctrl-C: the command stops where it is and removes what it had half
        # written (its `finally` blocks run); a second one, while it does, ends the process at once
        interrupts.install(signal.SIGINT)
    from edgetune.engine.core.errors import EdgetuneError, os_error_line

    try:
        _read_numbers(a)
        return a.fn(a)
    except (KeyboardInterrupt, Exception) as e:
        # a Ctrl-C may come out as another error, which a library turned it into (an import's
        # RecursionError, torch's RuntimeError): the command stopped all the same
        if isinstance(e, KeyboardInterrupt) or (ours and interrupts.asked()):
            if a.cmd not in ENDS_AT_CTRL_C:
                raise
            if ours:  # the command has ended: a Ctrl-C from here to the exit changes nothing
                interrupts.ended(signal.SIGINT)
                ours = False
            print(f"{chr(10) if sys.stderr.isatty() else ''}interrupted: {_interrupted(a)}", file=sys.stderr)
            return 130
        if isinstance(e, EdgetuneError):
            print(f"error: {e}", file=sys.stderr)
            return 2
        if isinstance(e, BrokenPipeError):
            # the reader left (`edgetune estimate --json | head -1`): stop quietly, as cat does;
            # stdout goes to /dev/null so that flushing it at exit raises nothing either
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            return 141  # 128 + SIGPIPE, what a shell reports for a writer killed by the pipe
        if isinstance(e, OSError):  # a full disk, a read-only folder: the user's condition, in one line
            print(f"error: {os_error_line(e)}", file=sys.stderr)
            return 2
        raise
    finally:
        if ours:
            interrupts.ended(signal.SIGINT, signal.default_int_handler)
