"""The adapter a run produces, and exporting it.

`adapter/` is a standard PEFT folder (adapter_config.json, adapter_model.safetensors)
plus the tokenizer files and a model card (README.md), so it loads anywhere PEFT does:

    base = AutoModelForCausalLM.from_pretrained(<base model>)
    model = PeftModel.from_pretrained(base, "runs/<run>/adapter")

An export is built in a temporary folder next to its target and moved into place only
while the target is still missing or empty (or, with --force, a previous export holding
nothing but the files its marker lists); it never follows a link inside the adapter.

A merged export folds the adapter into a bf16 copy of the base, loaded unquantised for
that purpose. We never merge into a 4-bit base: rounding the merged weights back to
NF4 would change the model the adapter was trained for.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
import socket
import tempfile
import time
import zipfile
from pathlib import Path

from edgetune.engine.core.errors import EdgetuneError, RunError, reason_line
from edgetune.engine.core.methods import METHODS as RECORDS
from edgetune.engine.core.runfolder import atomic_dir, atomic_write_text, disk_full, pid_alive
from edgetune.engine.core.settings import Config
from edgetune.engine.core.threads import worker_env


def model_card(cfg: Config, base_path: str, metrics: dict) -> str:
    from edgetune.engine.models.model import base_model_id

    base_id, note = base_model_id(cfg.model.name, base_path)
    record = RECORDS[cfg.method]
    method = f"{record.label} ({record.title})"
    lines = [
        "---", "library_name: peft", f"base_model: {base_id}", "tags: [edgetune, lora]", "---", "",
        f"# LoRA adapter trained with edgetune ({cfg.method})", "",
        f"- **Base model:** `{base_id}` ({note}; trained with the base in `{cfg.model.quant}`)",
        f"- **Method:** {method}",
        f"- **LoRA:** r={cfg.lora.r}, alpha={cfg.lora.alpha}, dropout={cfg.lora.dropout}, "
        f"targets={cfg.lora.target_modules}",
        f"- **Data:** `{cfg.data.path}` (format {cfg.data.format}, max_seq_len {cfg.data.max_seq_len})",
        f"- **Seed:** {cfg.run.seed}", "", "## Final metrics", "",
    ]
    lines += [f"- {k}: {v:.6g}" if isinstance(v, float) else f"- {k}: {v}" for k, v in metrics.items()] or ["- (none)"]
    lines += ["", "## Load it", "", "Run this in this folder (or set `adapter` to its path):", "", "```python",
              "from transformers import AutoModelForCausalLM, AutoTokenizer",
              "from peft import PeftModel",
              "",
              "adapter = '.'",
              f"base = AutoModelForCausalLM.from_pretrained({base_id!r})",
              "model = PeftModel.from_pretrained(base, adapter)",
              "tokenizer = AutoTokenizer.from_pretrained(adapter)",
              "messages = [{'role': 'user', 'content': 'Hello!'}]",
              "ids = tokenizer.apply_chat_template(messages, add_generation_prompt=True, return_tensors='pt',",
              "                                    return_dict=True)",
              "out = model.generate(**ids, max_new_tokens=32)",
              "print(tokenizer.decode(out[0, ids['input_ids'].shape[1]:], skip_special_tokens=True))", "```", "",
              "Settings of the run (all of them):", "", "```yaml", cfg.to_yaml().rstrip(), "```", ""]
    return "\n".join(lines)


def name_the_base(folder: Path, cfg: Config, base_path: str, **info) -> str:
    """Make an adapter folder PEFT just saved name its base as any machine finds it; every
    adapter folder a run writes goes through here (the final adapter and each checkpoint).

    PEFT records in adapter_config.json the folder the base was loaded from (for a GGUF or
    the embedded model, a cache folder of this machine); that becomes `base_model_id`'s
    name. Where this machine loaded the base from stays in edgetune.json (`base_path`),
    which a merge on this machine reads first. Returns the name."""
    from edgetune.engine.models.model import base_model_id

    base_id, _ = base_model_id(cfg.model.name, base_path)
    config_path = folder / "adapter_config.json"
    adapter_cfg = json.loads(config_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base_id
    config_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True))
    (folder / "edgetune.json").write_text(json.dumps({"base_model": base_id, "base_path": base_path,
                                                      "method": cfg.method, **info}, indent=2))
    return base_id


def write_adapter(out: Path, model, tokenizer, cfg: Config, base_path: str, metrics: dict,
                  state_dict: dict | None = None) -> Path:
    """Save adapter + tokenizer + model card into `out`, all or nothing. `state_dict`: the
    adapter's whole tensors when the model's own are shards (engine/models/fsdp.py)."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, state_dict=state_dict)
        name_the_base(tmp, cfg, base_path, metrics=metrics)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(cfg, base_path, metrics))
    return out


def _adapter_of(run_or_adapter: str | Path) -> Path:
    p = Path(run_or_adapter)
    if (p / "adapter").is_symlink():
        raise RunError(f"{p / 'adapter'}: is a symbolic link; export the folder it points to by its own path")
    if (p / "adapter_config.json").is_file():
        return p
    if (p / "adapter" / "adapter_config.json").is_file():
        return p / "adapter"
    if (p / "config.yaml").is_file():
        raise RunError(f"{p}: this run has no final adapter yet (still training, or it failed before saving)")
    raise RunError(f"{p}: neither a run folder nor an adapter folder")


EXPORT_MARKER = "edgetune-export.json"  # marks a folder (or zip) an export wrote and lists its files
TEMP_PREFIX = ".edgetune-tmp-"  # an export's temporary folder, next to its target
TEMP_OWNER = "edgetune-temp.json"  # inside each such folder: the process that made it


def _is_run_folder(p: Path) -> bool:
    return (p / "config.yaml").is_file() or (p / "events.jsonl").is_file()


def _is_previous_export(p: Path, as_zip: bool) -> bool:
    if p.is_symlink():
        return False
    if not as_zip:
        return p.is_dir() and (p / EXPORT_MARKER).is_file() and not _is_run_folder(p)
    if not p.is_file():
        return False
    try:
        with zipfile.ZipFile(p) as z:
            return EXPORT_MARKER in z.namelist()
    except (OSError, zipfile.BadZipFile):
        return False


def _not_exported(folder: Path) -> list[str]:
    """What a previous export folder holds that the export did not write (the files its
    marker lists; an older marker without the list: the adapter files an export copies)."""
    try:
        marker = json.loads((folder / EXPORT_MARKER).read_text())
    except (OSError, ValueError):
        marker = {}
    listed = marker.get("files") if isinstance(marker, dict) else None
    if not isinstance(listed, list):
        listed = [EXPORT_MARKER, "adapter_config.json", "adapter_model.safetensors", "adapter_model.bin",
                  "edgetune.json", "README.md", "tokenizer.json", "tokenizer_config.json",
                  "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt",
                  "tokenizer.model", "added_tokens.json"]
        listed_dirs = {"merged"}  # the older marker names no merged file: the whole folder was ours
    else:
        listed_dirs = set()
    files = {str(f) for f in listed}
    parents = {str(Path(f).parent) for f in files} | listed_dirs
    extra = []
    for dirpath, dirnames, filenames in os.walk(folder):
        rel = Path(dirpath).relative_to(folder)
        if str(rel) in listed_dirs:
            dirnames[:] = []
            continue
        for name in list(dirnames):
            r = str(rel / name)
            if (Path(dirpath) / name).is_symlink() or not any(p == r or p.startswith(r + "/") for p in parents):
                extra.append(r)
                dirnames.remove(name)
        extra += [str(rel / n) for n in filenames if str(rel / n) not in files]
    return sorted(extra)


def _names(items: list[str], at_most: int = 3) -> str:
    shown = ", ".join(items[:at_most])
    return shown + (f" and {len(items) - at_most} more" if len(items) > at_most else "")


def check_target(out: Path, src: Path, force: bool, as_zip: bool = False) -> None:
    """Refuse any target whose contents we would destroy: only a missing path, an empty
    folder, or (with `force`) a previous export holding nothing but its own files may be
    written. Checked again when the export moves into place (`_place`)."""
    real = out.resolve()
    if real == Path.cwd().resolve() or real == Path(real.anchor):
        raise RunError(f"{out}: export into a new folder (e.g. --out {out / 'my-adapter'}), "
                       "not the current or root folder")
    s = src.resolve()
    if real == s or s.is_relative_to(real) or real.is_relative_to(s):
        raise RunError(f"{out}: overlaps the adapter it would export ({src})")
    if out.is_dir() and _is_run_folder(out):
        raise RunError(f"{out}: is a run folder; export somewhere else (a run is never replaced)")
    if not out.exists() and not out.is_symlink():
        return
    if out.is_dir() and not out.is_symlink() and os.path.ismount(out):
        raise RunError(f"{out}: is a mount point; export into a new folder inside it (e.g. --out "
                       f"{out / 'my-adapter'})")
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if force and _is_previous_export(out, as_zip):
        extra = [] if as_zip else _not_exported(out)
        if extra:
            raise RunError(f"{out}: holds {_names(extra)}, which the previous export did not write; --force "
                           "replaces only an export's own files (move those out first)")
        return
    what = "a folder that is not empty" if out.is_dir() else "an existing file"
    hint = " (--force replaces only a previous export)" if not force else \
        " and not a previous export, so --force does not replace it"
    raise RunError(f"{out}: {what}; give a new or empty folder{hint}")


def zip_target(out: Path, src: Path) -> Path:
    """Where a zip export of `src` to `out` goes: `out/<run name>.zip` when `out` is an
    existing folder (or ends in a separator), `out` with .zip added when it has no
    extension, else `out` itself."""
    if out.is_dir() or str(out).endswith(os.sep) or out.name in ("", ".", ".."):
        name = src.resolve().parent.name if src.name == "adapter" else src.resolve().name
        return out / f"{name or 'adapter'}.zip"
    return out if out.suffix else out.with_name(out.name + ".zip")


def export(run_or_adapter: str | Path, out: str | Path, merged: bool = False, as_zip: bool = False,
           force: bool = False, gguf: bool = False) -> Path:
    """Copy a run's adapter to `out` (a folder, or a .zip when `as_zip`: `zip_target`); with
    `merged`, also write `out/merged/`: the base in bf16 with the adapter folded in. With
    `gguf`, write `out/gguf/` instead (engine/models/export_gguf.py): the LoRA as GGUF, with
    `merged` the merged model as GGUF, Ollama Modelfiles and llama.cpp's check. `out`
    must not exist or be an empty folder; `force` allows replacing a previous export's own
    files only. The export is built in a temporary folder next to `out` and moved into
    place in one rename that the system refuses if `out` is no longer empty; an export
    killed before that leaves the temporary folder, which the next export into the same
    folder removes (`clean_stale_temps`)."""
    src = _adapter_of(run_or_adapter)
    out = Path(out).expanduser()
    if as_zip:
        if gguf:
            raise RunError(f"{out}: a GGUF export writes a folder; drop --zip")
        out = zip_target(out, src)
    try:
        check_target(out, src, force, as_zip)
        if gguf:
            from edgetune.engine.models.export_gguf import check_exportable

            check_exportable(src, merged)  # a base or adapter llama.cpp cannot take: one line, nothing written
        files = safe_files(src, adapter_files(src))  # refuses links and anything but plain files
        for rel in files:
            if rel.endswith(".safetensors"):
                check_finite(src / rel)
        clean_stale_temps(out.parent)
        tmp = _new_temp(out.parent)
    except OSError as e:
        raise RunError(_write_problem(out, e)) from None
    try:
        if as_zip:
            built = tmp / "a.zip"
            _write_zip(src, files, built, merged=False)
        else:
            built = tmp / "x"
            _copy_files(src, files, built)
            if gguf:
                from edgetune.engine.models.export_gguf import write_gguf

                write_gguf(src, built / "gguf", merged)
            elif merged:
                _merge_into(built, built / "merged")
            _write_marker(built, src, merged)
        _place(built, out, tmp, force, as_zip)
    except OSError as e:
        raise RunError(_write_problem(out, e)) from None
    except EdgetuneError:
        raise
    except Exception as e:  # a library's own error for a full disk (safetensors' writer)
        if disk_full(e):
            raise RunError(_write_problem(out, e)) from None
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def _write_problem(out: Path, e: BaseException) -> str:
    if disk_full(e):
        return f"{out}: no space left on the disk; nothing was written (free some space and export again)"
    where = getattr(e, "filename", None)
    where = f" at {where}" if where and str(where) != str(out) else ""
    return f"{out}: cannot write the export{where} ({getattr(e, 'strerror', None) or e})"


# --------------------------------------------------------------------------- building


def adapter_files(src: Path) -> list[str]:
    """The adapter folder's files (paths relative to it). A symbolic link is refused, never
    followed: an export carries the adapter's own bytes, not whatever a link points to."""
    out = []

    def walk(folder: Path, rel: str) -> None:
        with os.scandir(folder) as entries:
            for e in sorted(entries, key=lambda e: e.name):
                r = f"{rel}{e.name}"
                if e.is_symlink():
                    raise RunError(f"{folder / e.name}: is a symbolic link; an export copies only the adapter's "
                                   "own files (put the file itself there)")
                if e.is_dir(follow_symlinks=False):
                    walk(Path(e.path), r + "/")
                elif e.is_file(follow_symlinks=False):
                    out.append(r)
                else:
                    raise RunError(f"{folder / e.name}: not a plain file; an export copies only plain files")

    walk(src, "")
    return out


# Files an export leaves out: Python pickles, which run code when they are read (PEFT's
# older adapter_model.bin, a trainer's training_args.bin). Eval, init_from and a merge read
# only the safetensors weights; the export carries what they read.
PICKLES = (".bin", ".pt", ".pth", ".pkl", ".pickle", ".ckpt")


def safe_files(src: Path, files: list[str]) -> list[str]:
    """`files` without the pickles; an adapter whose weights are only a pickle is refused."""
    if "adapter_model.safetensors" not in files:
        pickled = next((f for f in files if f.lower().endswith(PICKLES)), None)
        held = f" (its weights are {pickled}, a pickle)" if pickled else ""
        raise RunError(f"{src}: no adapter_model.safetensors{held}; an export carries the weights as safetensors "
                       "only, which load without running code")
    return [f for f in files if not f.lower().endswith(PICKLES)]


def _open_plain(path: Path):
    """Open a file for reading without following a link (one swapped in after the walk)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise RunError(f"{path}: is a symbolic link; an export copies only the adapter's own files") from None
        raise
    return os.fdopen(fd, "rb")


def _copy_files(src: Path, files: list[str], dest: Path) -> None:
    dest.mkdir()
    for rel in files:
        target = dest / rel
        target.parent.mkdir(parents=True, exist_ok=True)
        with _open_plain(src / rel) as fin, open(target, "xb") as fout:
            shutil.copyfileobj(fin, fout, 1 << 20)
        shutil.copystat(src / rel, target, follow_symlinks=False)


def _write_marker(built: Path, src: Path, merged: bool) -> None:
    """The marker, written last: the source, and every file this export wrote (what a later
    --force may replace)."""
    files = sorted(str(f.relative_to(built)) for f in built.rglob("*") if f.is_file())
    (built / EXPORT_MARKER).write_text(json.dumps({"source": str(src.resolve()), "merged": merged,
                                                   "files": sorted(files + [EXPORT_MARKER])}, indent=2))


def _write_zip(src: Path, files: list[str], zip_path: Path, merged: bool) -> None:
    with zipfile.ZipFile(zip_path, "w", zipfile.ZIP_DEFLATED) as z:
        for rel in files:
            with _open_plain(src / rel) as fin:
                st = os.fstat(fin.fileno())
                info = zipfile.ZipInfo(rel, date_time=time.localtime(max(st.st_mtime, 315532800))[:6])
                info.compress_type = zipfile.ZIP_DEFLATED
                info.file_size = st.st_size  # so that a file over 2 GiB gets its zip64 entry
                with z.open(info, "w") as fout:
                    shutil.copyfileobj(fin, fout, 1 << 20)
        marker = {"source": str(src.resolve()), "merged": merged, "files": sorted(files + [EXPORT_MARKER])}
        z.writestr(EXPORT_MARKER, json.dumps(marker, indent=2))


# float dtypes of safetensors -> (unsigned view, exponent bits): all exponent bits set is NaN or inf
_EXPONENT_BITS = {"F64": ("<u8", 0x7FF0000000000000), "F32": ("<u4", 0x7F800000), "F16": ("<u2", 0x7C00),
                  "BF16": ("<u2", 0x7F80)}


def check_finite(path: Path) -> None:
    """Refuse an adapter weights file holding a NaN or infinite value, naming the tensor
    (a run that diverged). Reads the safetensors layout directly: no torch needed here."""
    import numpy as np

    try:
        with _open_plain(path) as f:
            n = int.from_bytes(f.read(8), "little")
            size = os.fstat(f.fileno()).st_size
            if n <= 0 or 8 + n > size:
                raise ValueError("bad header size")
            header = json.loads(f.read(n))
            data = np.fromfile(f, dtype=np.uint8)
        tensors = {k: v for k, v in header.items() if k != "__metadata__"}
        for name, info in tensors.items():
            begin, end = info["data_offsets"]
            if end > data.size:
                raise ValueError(f"{name} ends past the file")
            kind = _EXPONENT_BITS.get(info["dtype"])
            if kind is None or end == begin:
                continue
            bits = data[begin:end].view(kind[0])
            if bool(((bits & kind[1]) == kind[1]).any()):
                raise RunError(f"{path}: tensor {name} holds NaN or infinite values (the run diverged); "
                               "not exported")
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        why = reason_line(str(e), 120) or type(e).__name__
        raise RunError(f"{path}: not a readable safetensors file ({why})") from None


# --------------------------------------------------------------------------- moving into place


def _new_temp(parent: Path) -> Path:
    """A temporary folder in `parent` for one export, marked with the process that made it.
    Its name is short whatever the target's (a name near the 255-byte limit plus a suffix
    would not fit)."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=TEMP_PREFIX))
    try:
        (tmp / TEMP_OWNER).write_text(json.dumps({"pid": os.getpid(), "host": socket.gethostname()}))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return tmp


def clean_stale_temps(parent: Path) -> list[Path]:
    """Remove the temporary folders of exports into `parent` whose process is gone (killed
    mid-way, e.g. a merge of a 7B model). Only folders named and marked as ours, made on
    this machine by a process that no longer runs; returns what was removed."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for p in parent.iterdir():
        if not p.name.startswith(TEMP_PREFIX) or p.is_symlink() or not p.is_dir():
            continue
        try:
            owner = json.loads((p / TEMP_OWNER).read_text())
            mine = owner["host"] == socket.gethostname() and not pid_alive(int(owner["pid"]))
        except (OSError, ValueError, KeyError, TypeError):
            continue  # no marker of ours: not ours to remove
        if mine:
            shutil.rmtree(p, ignore_errors=True)
            removed.append(p)
    return removed


_OCCUPIED = {errno.ENOTEMPTY, errno.EEXIST, errno.ENOTDIR, errno.EISDIR}


def _appeared(out: Path) -> RunError:
    try:
        found = sorted(p.name for p in out.iterdir()) if out.is_dir() and not out.is_symlink() else []
    except OSError:
        found = []
    what = _names(found) if found else "a file"
    return RunError(f"{out}: {what} appeared there while the export ran; nothing was written "
                    "(export again into a new or empty folder)")


def _keep(aside: Path, out: Path) -> Path:
    """Put a previous export moved aside back at `out`, never over anything; when `out` is
    taken again, under a visible name next to it. Returns where it is."""
    try:
        if aside.is_dir():
            os.rename(aside, out)  # refused unless `out` is missing or an empty folder
        else:
            os.link(aside, out)  # refused when `out` exists
            os.unlink(aside)
        return out
    except OSError:
        kept = Path(tempfile.mkdtemp(dir=out.parent, prefix="edgetune-kept-"))
        os.rename(aside, kept / out.name)
        return kept / out.name


def _move(built: Path, out: Path, as_zip: bool) -> None:
    """Move `built` to `out` without ever replacing anything there (OSError EEXIST/ENOTEMPTY)."""
    if not as_zip:
        os.rename(built, out)  # a folder onto a folder that is not empty, or onto a file: refused
        return
    try:
        os.link(built, out)  # refused when `out` exists, whatever it is
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EMLINK):
            raise
        # a filesystem without hard links (FAT, some network shares): check, then rename
        if out.exists() or out.is_symlink():
            raise FileExistsError(errno.EEXIST, "exists", str(out)) from None
        os.rename(built, out)


def _place(built: Path, out: Path, tmp: Path, force: bool, as_zip: bool) -> None:
    """Move the finished export to `out`. Never over anything that is not ours: a folder is
    renamed onto `out` only while `out` is missing or empty (the system's rename refuses
    otherwise); a zip is linked to `out`, which fails when `out` exists. With `force`, a
    previous export is first moved aside (into our temporary folder) and checked there:
    if a file of the user's turned up in it, it goes back and the export is refused."""
    if force and _is_previous_export(out, as_zip):
        aside = tmp / "old"
        os.rename(out, aside)
        if as_zip and not _is_previous_export(aside, True):
            where = _keep(aside, out)
            moved = "" if where == out else f"; that file is at {where}"
            raise RunError(f"{out}: was replaced by another file while the export ran; nothing was replaced{moved}")
        extra = [] if as_zip else _not_exported(aside)
        if extra:
            where = _keep(aside, out)
            moved = "" if where == out else f"; the previous export is at {where}"
            raise RunError(f"{out}: {_names(extra)} appeared in the previous export while this one ran; nothing "
                           f"was replaced{moved}")
    try:
        _move(built, out, as_zip)
    except OSError as e:
        if (tmp / "old").exists():  # the previous export goes back (or next to it), never lost
            _keep(tmp / "old", out)
        if e.errno in _OCCUPIED:
            raise _appeared(out) from None
        if e.errno in (errno.EXDEV, errno.EBUSY):
            raise RunError(f"{out}: cannot be moved into place (a mount point, or on another device than "
                           f"{out.parent}); export into a new folder inside it") from None
        raise
    if force and (tmp / "old").exists():
        extra = _not_exported(tmp / "old") if not as_zip else []
        if extra:  # turned up in the moment between the check and the swap: kept, never deleted
            kept = Path(tempfile.mkdtemp(dir=out.parent, prefix="edgetune-kept-"))
            os.rename(tmp / "old", kept / out.name)
            raise RunError(f"{out}: exported; {_names(extra)} turned up in the previous export as it was "
                           f"replaced and is kept in {kept / out.name}")


def export_isolated(run_or_adapter: str | Path, out: str | Path, merged: bool = False, as_zip: bool = False,
                    force: bool = False, timeout: float | None = None, gguf: bool = False) -> Path:
    """`export()` in a fresh Python process (`python -m edgetune.engine.models.export`): the
    caller imports no torch and keeps none of the base model's memory. An error of the
    user's (EdgetuneError) is raised here again with its class and one-line message."""
    import subprocess
    import sys

    from edgetune.engine.core import errors

    request = {"run_or_adapter": str(run_or_adapter), "out": str(out), "merged": merged, "as_zip": as_zip,
               "force": force, "gguf": gguf}
    env = worker_env(TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "edgetune.engine.models.export"], input=json.dumps(request),
                              capture_output=True, text=True, timeout=timeout, env=env, cwd=os.getcwd())
    except subprocess.TimeoutExpired:
        raise RunError(f"{out}: the export took longer than {timeout:.0f} s") from None
    try:
        answer = json.loads(proc.stdout.strip().splitlines()[-1])
    except (IndexError, json.JSONDecodeError):
        last = (proc.stderr.strip().splitlines() or ["no output"])[-1]
        raise RunError(f"{out}: the export failed: {last}") from None
    if not answer.get("ok"):
        kind = getattr(errors, answer.get("kind", ""), None)
        if not (isinstance(kind, type) and issubclass(kind, errors.EdgetuneError)):
            kind = RunError
        raise kind(answer.get("error", "the export failed"))
    return Path(answer["out"])


def _main() -> int:
    """One export requested as JSON on stdin; the answer is one JSON line on stdout."""
    import signal
    import sys

    from edgetune.engine.core.errors import EdgetuneError

    # SIGTERM (the app closing, a timeout) ends through `export`'s cleanup: no temporary left
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    request = json.loads(sys.stdin.read())
    try:
        out = export(request["run_or_adapter"], request["out"], merged=request.get("merged", False),
                     as_zip=request.get("as_zip", False), force=request.get("force", False),
                     gguf=request.get("gguf", False))
    except EdgetuneError as e:
        print(json.dumps({"ok": False, "error": str(e), "kind": type(e).__name__}))
        return 2
    print(json.dumps({"ok": True, "out": str(out)}))
    return 0


def _merge_into(adapter: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.adapter import check_adapter_weights

    check_adapter_weights(adapter)
    info = json.loads((adapter / "edgetune.json").read_text()) if (adapter / "edgetune.json").is_file() else {}
    base_path = info.get("base_path")
    if not base_path or not Path(base_path).exists():  # exported from another machine: the hub id
        base_path = json.loads((adapter / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16)
    merged = PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    merged.save_pretrained(out)
    atomic_write_text(out / "MERGED.md",
                      "Base weights in bf16 with the LoRA adapter folded in. The adapter was trained on a "
                      "quantised base; this merge uses the unquantised base, so outputs differ slightly from "
                      "the training-time model. Merging into the 4-bit base would be lossier still and is "
                      "never done.\n")


if __name__ == "__main__":
    import sys

    sys.exit(_main())
