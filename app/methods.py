"""The training methods the app offers: their records (engine/core/methods.py), which say
what the page plots and shows for each (`plots`, `samples`, `headline`, `basic`) beside its
label, description and step unit. Adding a method is a record there, never an entry here nor
a special case in the page code."""

from __future__ import annotations

from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.methods import Method, Plot, Series

__all__ = ["BY_KEY", "BY_LABEL", "COMPARABLE", "MAX_PLOTS", "METHODS", "Method", "Plot", "Series"]

METHODS = tuple(RECORDS.values())
BY_KEY = RECORDS  # by Config.method
BY_LABEL = {m.label: m for m in METHODS}

# What the Runs tab can compare across runs: every series of every method's plots, once
# per label ("train loss", "eval pass@1", ...), with the plot it belongs to.
COMPARABLE = {}
for _m in METHODS:
    for _p in _m.plots:
        for _s in _p.series:
            COMPARABLE.setdefault(_s.label, (_s, _p))

MAX_PLOTS = max(len(m.plots) for m in METHODS)
