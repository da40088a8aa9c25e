"""The quantised base on disk: the first load of a local model in NF4 quantises it and keeps
the result in the cache ($EDGETUNE_CACHE/quantized/); a later run of the same model with
the same quantisation loads those 4-bit weights directly (a quarter of the bytes to read,
nothing to quantise).

The key is the source folder's weight and config files (name, size, modification time),
the quantisation settings (transformers' BitsAndBytesConfig as a dict, compute dtype) and
the transformers / bitsandbytes versions that wrote it: a changed file, another setting
or another library version gives another entry, never a stale one. Files are hashed by
size and mtime, not content, like the GGUF conversion cache (engine/model.py): reading
15 GB to hash it would cost what the cache saves.

Entries are written under a temporary name and renamed into place (runfolder.atomic_dir),
so an interrupted store leaves no entry. A store is skipped, with a note, when the disk
holds less than twice the entry's size.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

from .runfolder import atomic_dir
from .settings import cache_dir

SOURCE_PATTERNS = ("*.safetensors", "*.bin", "*.json")


def key(source: str | Path, quant: dict, dtype: str) -> str | None:
    """The entry name for a local source folder and quantisation, or None for a hub id."""
    import bitsandbytes
    import transformers

    src = Path(source)
    if not src.is_dir():
        return None
    files = sorted({f for pat in SOURCE_PATTERNS for f in src.glob(pat) if f.is_file()})
    h = hashlib.sha1()
    for f in files:
        st = f.stat()
        h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}\n".encode())
    h.update(json.dumps(quant, sort_keys=True, default=str).encode())
    h.update(f"{dtype}:{transformers.__version__}:{bitsandbytes.__version__}".encode())
    return f"{src.resolve().name}-{h.hexdigest()[:16]}"


def entry(name: str) -> Path:
    return cache_dir() / "quantized" / name


def lookup(name: str | None) -> Path | None:
    if name is None:
        return None
    p = entry(name)
    return p if (p / "config.json").is_file() else None


def store(model, name: str) -> str:
    """Save a freshly quantised model as the entry `name`; returns what was done, for the log."""
    out = entry(name)
    size = model.get_memory_footprint()
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < 2 * size:
        return f"not stored: {free / 2**30:.1f} GiB free on disk, the entry needs {size / 2**30:.1f}"
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
    return f"stored in {out} ({size / 2**30:.1f} GiB)"
