"""The adapter a run produces, and exporting it.

`adapter/` is a standard PEFT folder (adapter_config.json, adapter_model.safetensors)
plus the tokenizer files and a model card (README.md), so it loads anywhere PEFT does:

    base = AutoModelForCausalLM.from_pretrained(<base model>)
    model = PeftModel.from_pretrained(base, "runs/<run>/adapter")

A merged export folds the adapter into a bf16 copy of the base, loaded unquantised for
that purpose. We never merge into a 4-bit base: rounding the merged weights back to
NF4 would change the model the adapter was trained for.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
import zipfile
from pathlib import Path

from .errors import RunError
from .runfolder import RunDir, atomic_dir, atomic_write_text
from .settings import Config


def model_card(cfg: Config, base_path: str, metrics: dict) -> str:
    from .model import base_model_id

    base_id, note = base_model_id(cfg.model.name, base_path)
    method = {"sft": "SFT (supervised fine-tuning)", "fgrpo": "F-GRPO (focal group-relative RL)",
              "essa": "ESSA (evolution strategies over LoRA singular values)"}[cfg.method]
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
    from .model import base_model_id

    base_id, _ = base_model_id(cfg.model.name, base_path)
    config_path = folder / "adapter_config.json"
    adapter_cfg = json.loads(config_path.read_text())
    adapter_cfg["base_model_name_or_path"] = base_id
    config_path.write_text(json.dumps(adapter_cfg, indent=2, sort_keys=True))
    (folder / "edgetune.json").write_text(json.dumps({"base_model": base_id, "base_path": base_path,
                                                      "method": cfg.method, **info}, indent=2))
    return base_id


def write_adapter(out: Path, model, tokenizer, cfg: Config, base_path: str, metrics: dict) -> Path:
    """Save adapter + tokenizer + model card into `out`, all or nothing."""
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp)
        name_the_base(tmp, cfg, base_path, metrics=metrics)
        tokenizer.save_pretrained(tmp)
        (tmp / "README.md").write_text(model_card(cfg, base_path, metrics))
    return out


def _adapter_of(run_or_adapter: str | Path) -> Path:
    p = Path(run_or_adapter)
    if (p / "adapter_config.json").is_file():
        return p
    if (p / "adapter" / "adapter_config.json").is_file():
        return p / "adapter"
    if (p / "config.yaml").is_file():
        raise RunError(f"{p}: this run has no final adapter yet (still training, or it failed before saving)")
    raise RunError(f"{p}: neither a run folder nor an adapter folder")


EXPORT_MARKER = "edgetune-export.json"  # marks a folder (or zip) an export wrote, so --force may replace it


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


def check_target(out: Path, src: Path, force: bool, as_zip: bool = False) -> None:
    """Refuse any target whose contents we would destroy: only a missing path, an empty
    folder, or (with `force`) a previous export may be written."""
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
    if out.is_dir() and not out.is_symlink() and not any(out.iterdir()):
        return
    if force and _is_previous_export(out, as_zip):
        return
    what = "a folder that is not empty" if out.is_dir() else "an existing file"
    hint = " (--force replaces only a previous export)" if not force else \
        " and not a previous export, so --force does not replace it"
    raise RunError(f"{out}: {what}; give a new or empty folder{hint}")


def _refuse_a_training_run(p: Path) -> None:
    """A run that trains (a resumed one, too) holds the previous attempt's adapter, if any,
    until it ends: exporting it now would hand out a stale adapter under the run's name."""
    from .api import ACTIVE, Run

    for run in (p, p.parent) if p.name == "adapter" else (p,):
        if (run / "config.yaml").is_file():
            status = Run(run).status()
            if status in ACTIVE:
                raise RunError(f"{run}: the run is {status}: its adapter is written when it ends (until then "
                               "adapter/ is missing or a previous attempt's); export after it stops or finishes")


def export(run_or_adapter: str | Path, out: str | Path, merged: bool = False, as_zip: bool = False,
           force: bool = False) -> Path:
    """Copy a run's adapter to `out` (a folder, or a .zip when `as_zip`); with `merged`,
    also write `out/merged/`: the base in bf16 with the adapter folded in. `out` must not
    exist or be an empty folder; `force` allows replacing a previous export only."""
    _refuse_a_training_run(Path(run_or_adapter))
    src = _adapter_of(run_or_adapter)
    out = Path(out).expanduser()
    check_target(out, src, force, as_zip)
    marker = json.dumps({"source": str(src.resolve()), "merged": merged}, indent=2)
    if as_zip:
        return zip_adapter(src, out, marker)
    with atomic_dir(out) as tmp:
        shutil.copytree(src, tmp, dirs_exist_ok=True)
        (tmp / EXPORT_MARKER).write_text(marker)
        if merged:
            _merge_into(src, tmp / "merged")
    return out


def export_isolated(run_or_adapter: str | Path, out: str | Path, merged: bool = False, as_zip: bool = False,
                    force: bool = False, timeout: float | None = None) -> Path:
    """`export()` in a fresh Python process (`python -m edgetune.engine.export`): the
    caller imports no torch and keeps none of the base model's memory. An error of the
    user's (EdgetuneError) is raised here again with its class and one-line message."""
    import subprocess
    import sys

    from . import errors

    request = {"run_or_adapter": str(run_or_adapter), "out": str(out), "merged": merged, "as_zip": as_zip,
               "force": force}
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONUNBUFFERED="1")
    try:
        proc = subprocess.run([sys.executable, "-m", "edgetune.engine.export"], input=json.dumps(request),
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
    import sys

    from .errors import EdgetuneError

    request = json.loads(sys.stdin.read())
    try:
        out = export(request["run_or_adapter"], request["out"], merged=request.get("merged", False),
                     as_zip=request.get("as_zip", False), force=request.get("force", False))
    except EdgetuneError as e:
        print(json.dumps({"ok": False, "error": str(e), "kind": type(e).__name__}))
        return 2
    print(json.dumps({"ok": True, "out": str(out)}))
    return 0


def zip_adapter(src: Path, zip_path: Path, marker: str | None = None) -> Path:
    zip_path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=zip_path.parent, prefix=f".{zip_path.name}.", suffix=".tmp")
    os.close(fd)
    tmp = Path(tmp)
    try:
        with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
            for f in sorted(src.rglob("*")):
                if f.is_file():
                    z.write(f, f.relative_to(src))
            if marker is not None:
                z.writestr(EXPORT_MARKER, marker)
        tmp.replace(zip_path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return zip_path


def _merge_into(adapter: Path, out: Path) -> None:
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

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


def run_adapter_dir(run: str | Path) -> Path:
    return RunDir(run).adapter


if __name__ == "__main__":
    import sys

    sys.exit(_main())
