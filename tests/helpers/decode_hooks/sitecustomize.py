"""Loaded into a worker process through PYTHONPATH (Python imports `sitecustomize` at
start-up), so the engine carries no test hooks. EDGETUNE_PLAIN_DECODE=1 keeps rollouts on
the CPU on the plain decode loop (no fp32 copy of the base): for a test that compares a run
with one whose ranks must decode on that loop (FSDP's ranks decode in step)."""

import os

if os.environ.get("EDGETUNE_PLAIN_DECODE") == "1":
    from edgetune.engine.generation import fast_decode

    fast_decode.host_copy_wanted = lambda model, device: False
