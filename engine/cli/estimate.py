"""`edgetune estimate`: the planner's peak memory of a configuration, as a table or JSON."""

from __future__ import annotations

import json

from edgetune.engine.run import api

from edgetune.engine.cli.common import config_args, config_from
from edgetune.engine.cli.tables import estimate_table


def cmd_estimate(a) -> int:
    est = api.estimate(config_from(a), gpus=a.gpus)
    print(json.dumps(est, indent=2) if a.json else estimate_table(est))
    return 0


def add_parser(sub) -> None:
    """`edgetune estimate`'s flags."""
    es = sub.add_parser("estimate", help="predict peak memory of a configuration")
    config_args(es)
    es.add_argument("--json", action="store_true", help="the planner's raw numbers (bytes) as JSON")
    es.add_argument("--gpus", default=1, help="the peak of each GPU of a data-parallel run on that many")
    es.set_defaults(fn=cmd_estimate)
