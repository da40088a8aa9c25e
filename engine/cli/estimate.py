"""`edgetune estimate`: the planner's peak memory of a configuration, as a table or JSON."""

from __future__ import annotations

import json

from edgetune.engine.planning import long_context
from edgetune.engine.planning.timing import words as timing_words

from edgetune.engine.run import api

from edgetune.engine.cli.common import config_args, config_from
from edgetune.engine.cli.tables import estimate_table


def cmd_estimate(a) -> int:
    cfg = config_from(a)
    est = {**api.estimate(cfg, gpus=a.gpus), "time": api.time_estimate(cfg)}
    if a.fit_seq_len is not None:  # the longest data.max_seq_len per memory, as set and with each lever
        est["fit_seq_len"] = long_context.fit_rows(cfg, long_context.parse_memories(a.fit_seq_len))
    print(json.dumps(est, indent=2) if a.json else estimate_table(est) + "\n" + timing_words(est["time"]) + (
        "\n\n" + long_context.fit_text(est["fit_seq_len"], cfg) if "fit_seq_len" in est else ""))
    return 0


def add_parser(sub) -> None:
    """`edgetune estimate`'s flags."""
    es = sub.add_parser("estimate", help="predict peak memory of a configuration")
    config_args(es)
    es.add_argument("--json", action="store_true", help="the planner's raw numbers (bytes) as JSON")
    es.add_argument("--gpus", default=1, help="the peak of each GPU of a data-parallel run on that many")
    es.add_argument("--fit-seq-len", nargs="?", const="", metavar="GIB,...",
                    help="also the longest data.max_seq_len that fits each memory (default 24,48,80 GiB), "
                         "as set and with each long-sequence lever")
    es.set_defaults(fn=cmd_estimate)
