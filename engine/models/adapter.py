"""What an adapter folder says about itself: the base it was trained on, and whether its
LoRA factors fit a loaded model (read from the weights' shapes, before PEFT loads them).
Used where an adapter is loaded (engine/models/model.py's init_from, engine/generation/chat.py)."""

from __future__ import annotations

import json
import re
from pathlib import Path

from edgetune.engine.core.errors import ModelError


def adapter_base(adapter: str | Path) -> str:
    """The base model an adapter was trained on, as it recorded it."""
    a = Path(adapter)
    try:
        info = json.loads((a / "edgetune.json").read_text()) if (a / "edgetune.json").is_file() else {}
        return info.get("base_path") or json.loads((a / "adapter_config.json").read_text()).get(
            "base_model_name_or_path") or "(not recorded)"
    except (OSError, ValueError, AttributeError):
        return "(not recorded)"


def check_adapter_weights(adapter: str | Path) -> None:
    """Refuse, in one line, an adapter whose weights PEFT would read as a pickle that holds
    more than tensors (`adapter_model.bin` without a safetensors file). PEFT itself reads
    it weights-only, so nothing runs either way; this turns its long traceback into a line."""
    a = Path(adapter)
    f = a / "adapter_model.bin"
    if (a / "adapter_model.safetensors").is_file() or not f.is_file():
        return
    import warnings

    import torch

    try:
        with warnings.catch_warnings():  # (torch warns about the pickle protocol on the way)
            warnings.simplefilter("ignore")
            torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:
        text = str(e).strip()
        # torch's message is a page of advice; its one specific line names what the pickle wanted
        why = re.search(r"WeightsUnpickler error:\s*([^\n]+)", text)
        why = why.group(1).split(" was not an allowed")[0] if why else (text.splitlines() or [type(e).__name__])[0]
        raise ModelError(f"{f}: not a safetensors file nor a weights-only pickle ({why[:120].rstrip('. ')}); only "
                         "adapter_model.safetensors or a weights-only adapter_model.bin is read, never a pickle "
                         "that runs code") from None


def check_adapter_fits(model, adapter: str | Path) -> None:
    """Refuse, in one line naming the base it expects, an adapter whose LoRA factors do not
    fit this model's layers (trained on another base). Reads only the weights' shapes;
    first `check_adapter_weights`."""
    from safetensors import safe_open

    check_adapter_weights(adapter)
    f = Path(adapter) / "adapter_model.safetensors"
    if not f.is_file():
        return  # another format: PEFT's own loading decides
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    modules = dict(base.named_modules())
    problem = None
    with safe_open(str(f), framework="pt") as w:
        for key in w.keys():
            name, _, kind = key.rpartition(".lora_")
            if kind not in ("A.weight", "B.weight"):
                continue
            mod = modules.get(name.removeprefix("base_model.model."))
            shape = w.get_slice(key).get_shape()
            if mod is None:
                problem = f"it has LoRA weights for {name.removeprefix('base_model.model.')}, which this model lacks"
            elif kind == "A.weight" and getattr(mod, "in_features", shape[1]) != shape[1]:
                problem = f"{name.removeprefix('base_model.model.')} takes {mod.in_features} inputs here, {shape[1]} there"
            elif kind == "B.weight" and getattr(mod, "out_features", shape[0]) != shape[0]:
                problem = f"{name.removeprefix('base_model.model.')} gives {mod.out_features} outputs here, {shape[0]} there"
            if problem:
                break
    if problem:
        here = getattr(getattr(base, "config", None), "_name_or_path", "") or "the loaded model"
        raise ModelError(f"{adapter}: trained on another base model ({adapter_base(adapter)}), not on {here}: "
                         f"{problem}; load it with model.name set to its base")
