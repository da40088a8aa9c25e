"""Library notices that say something failed when nothing did, dropped where they are
logged (every other message of those libraries, and every other library's, still shows).

- bitsandbytes, on a CPU with AVX512-BF16, tries to fetch a faster 4-bit matmul from the
  hub (`kernels-community`) and logs "Failed to load CPU gemm_4bit_forward from
  kernels-community: ..." when it cannot: offline, or without the `kernels` package. Its
  own CPU path, which edgetune uses, runs either way.
- The `kernels` package, asked for that kernel offline, logs "Skipping publisher trust
  check ... because Hugging Face Hub is in offline mode": the user chose offline.

Installed when the engine is first imported (engine/__init__.py), so the filters are in
place before any process of ours imports bitsandbytes, in whatever order it imports.
"""

from __future__ import annotations

import logging

# logger name -> the start of each message it logs that is dropped
QUIET = {
    "bitsandbytes.backends.cpu.ops": ("Failed to load CPU gemm_4bit_forward from kernels-community",),
    "kernels._internals.hf_hub": ("Skipping publisher trust check",),
}


class _Drop(logging.Filter):
    def __init__(self, starts: tuple[str, ...]):
        super().__init__()
        self.starts = starts

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.starts)


def install() -> None:
    """Put the filters on their loggers (once per process)."""
    for name, starts in QUIET.items():
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) for f in logger.filters):
            logger.addFilter(_Drop(starts))
