"""The quantised base on disk: the first load of a local model in NF4 quantises it and keeps
the result in the cache ($EDGETUNE_CACHE/quantized/); a later run of the same model with
the same quantisation loads those 4-bit weights directly (a quarter of the bytes to read,
nothing to quantise).

The key is the source folder's weight and config files (name, size, modification time),
the quantisation settings (transformers' BitsAndBytesConfig as a dict, compute dtype) and
the transformers / bitsandbytes versions that wrote it: a changed file, another setting
or another library version gives another entry, never a stale one. Files are hashed by
size and mtime, not content, like the GGUF conversion cache (engine/models/model.py): reading
15 GB to hash it would cost what the cache saves.

Entries are written under a temporary name, flushed to disk (fsync) and renamed into
place, never over an existing entry (two runs storing the same model keep the first), so
an interrupted store or a power cut leaves no entry. Each entry lists its files' sizes and
sha256 in CHECKSUMS; a load checks them first, and an entry that fails the check
(truncated, edited, or written before checksums existed) is ours to drop: the load says so
in worker.log, deletes it and quantises the source again. Hashing reads the entry once
more, which the page cache makes cheap next to loading it. A store is skipped, with a
note, when the disk holds less than twice the entry's size.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from edgetune.engine.core.settings import cache_dir

SOURCE_PATTERNS = ("*.safetensors", "*.bin", "*.json")
CHECKSUMS = "edgetune-checksums.json"  # {"files": {name: {"size": bytes, "sha256": hex}}}


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


def lookup(name: str | None) -> tuple[Path | None, str]:
    """(the entry's folder, "") when it exists and passes its checksums; (None, why) after
    dropping an entry that fails them; (None, "") when there is none."""
    if name is None:
        return None, ""
    p = entry(name)
    if not p.exists():
        return None, ""
    problem = damage(p)
    if problem is None:
        return p, ""
    return None, drop(p, problem)


def drop(p: Path, problem: str) -> str:
    """Delete a damaged entry (ours: everything under quantized/ was written by store);
    returns the warning line for the log."""
    shutil.rmtree(p, ignore_errors=True)
    return f"the cached entry {p} {problem}; deleted it, quantising the source again"


def damage(p: Path) -> str | None:
    """What is wrong with an entry folder, or None when every file matches CHECKSUMS."""
    try:
        listed = json.loads((p / CHECKSUMS).read_text())["files"]
        if not isinstance(listed, dict):
            raise TypeError("files is not a mapping")
    except FileNotFoundError:
        return "has no checksums (stored by an older edgetune, or cut off while storing)"
    except (OSError, ValueError, KeyError, TypeError) as e:
        return f"has unreadable checksums ({type(e).__name__})"
    present = {f.relative_to(p).as_posix() for f in p.rglob("*") if f.is_file()} - {CHECKSUMS}
    if present - set(listed):
        return f"holds files it was not stored with ({', '.join(sorted(present - set(listed))[:3])})"
    for rel, want in sorted(listed.items()):
        f = p / rel
        if not f.is_file():
            return f"is missing {rel}"
        size = f.stat().st_size
        if size != want.get("size"):
            return f"is damaged: {rel} has {size} bytes, it was stored with {want.get('size')}"
        if _sha256(f) != want.get("sha256"):
            return f"is damaged: {rel} does not match its stored checksum"
    if "config.json" not in listed:
        return "has no config.json"
    return None


def _sha256(f: Path) -> str:
    h = hashlib.sha256()
    with open(f, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def store(model, name: str) -> str:
    """Save a freshly quantised model as the entry `name`; returns what was done, for the log."""
    out = entry(name)
    size = model.get_memory_footprint()
    out.parent.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(out.parent).free
    if free < 2 * size:
        return f"not stored: {free / 2**30:.1f} GiB free on disk, the entry needs {size / 2**30:.1f}"
    tmp = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".tmp"))
    try:
        model.save_pretrained(tmp)
        seal(tmp)
        try:
            os.rename(tmp, out)  # never over an entry: the system refuses a folder that is not empty
        except OSError as e:
            if e.errno not in (errno.EEXIST, errno.ENOTEMPTY):
                raise
            # Another run of the same model stored the same entry meanwhile (two runs started
            # together): keep theirs, which the next load checks against its own checksums.
            return f"not stored: {out} was stored by another run meanwhile"
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    _fsync(out.parent)  # the rename itself
    return f"stored in {out} ({size / 2**30:.1f} GiB)"


def seal(folder: Path) -> None:
    """Write CHECKSUMS for every file in `folder` and flush them all to disk, so that the
    rename that publishes the entry never publishes data still in the page cache."""
    files = sorted(f for f in folder.rglob("*") if f.is_file() and f.name != CHECKSUMS)
    listed = {f.relative_to(folder).as_posix(): {"size": f.stat().st_size, "sha256": _sha256(f)} for f in files}
    (folder / CHECKSUMS).write_text(json.dumps({"files": listed}, indent=1))
    for f in [*files, folder / CHECKSUMS]:
        _fsync(f)
    for d in sorted({f.parent for f in files} | {folder}, key=lambda d: -len(d.parts)):
        _fsync(d)
