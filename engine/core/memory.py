"""Memory readouts (GPU allocated/reserved/peak/total, host RSS) for events and benches."""

from __future__ import annotations

import os

import psutil


def gpu_memory() -> dict:
    """Bytes; all zero on a machine without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return {"allocated": 0, "reserved": 0, "peak": 0, "total": 0}
    dev = torch.cuda.current_device()
    return {
        "allocated": torch.cuda.memory_allocated(dev),
        "reserved": torch.cuda.memory_reserved(dev),
        "peak": torch.cuda.max_memory_allocated(dev),
        "total": torch.cuda.get_device_properties(dev).total_memory,
    }


def host_rss() -> int:
    return psutil.Process(os.getpid()).memory_info().rss


def snapshot() -> dict:
    """The memory fields every `step` event carries."""
    return {"gpu": gpu_memory(), "host_rss": host_rss()}
