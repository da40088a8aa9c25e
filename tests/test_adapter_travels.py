"""An exported adapter names its base as another machine finds it: the hub id for the
embedded SmolLM2 (noting the GGUF it was dequantised from) or a local folder's name,
never a path of the machine that trained it; the model card's snippet runs as written."""

import json
import re
import subprocess
import sys
from pathlib import Path

from edgetune.engine.core import settings

from edgetune.engine.models.export import write_adapter


def _adapter(model_dir, name: str, out: Path, tmp_path) -> Path:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import load_tokenizer, lora_config

    cfg = settings.from_dict({"method": "sft", "model": {"name": name, "quant": "none"},
                              "lora": {"r": 4, "alpha": 8}, "run": {"runs_dir": str(tmp_path)}})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir), lora_config(cfg.lora))
    return write_adapter(out, model, load_tokenizer(str(model_dir)), cfg, str(model_dir), {"loss": 1.0})


def _snippet(card: str) -> str:
    return re.search(r"```python\n(.*?)```", card, re.S).group(1)


def test_embedded_base_is_named_by_its_hub_id(embedded_dir, tmp_path):
    out = _adapter(embedded_dir, "embedded:smollm2-135m", tmp_path / "adapter", tmp_path)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    card = (out / "README.md").read_text()
    assert "base_model: HuggingFaceTB/SmolLM2-135M-Instruct" in card and "Q4_1" in card
    assert str(embedded_dir) not in _snippet(card)
    for f in out.glob("*.json"):  # the cache folder of this machine appears in no config but our own note
        if f.name != "edgetune.json":
            assert str(embedded_dir) not in f.read_text(), f.name


def test_local_folder_base_and_the_card_snippet_runs_elsewhere(tiny_model_dir, tmp_path):
    out = _adapter(tiny_model_dir, str(tiny_model_dir), tmp_path / "adapter", tmp_path)
    base = json.loads((out / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert not Path(base).is_absolute() and str(tiny_model_dir) not in base
    assert base == tiny_model_dir.name
    # "Another machine": the adapter folder alone, moved elsewhere, with the base where
    # that machine keeps it under the name the adapter gives (here: next to the adapter).
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = out.rename(elsewhere / "adapter")
    (elsewhere / base).symlink_to(tiny_model_dir, target_is_directory=True)
    code = _snippet((moved / "README.md").read_text()).replace(f"{base!r}", repr(f"../{base}"))
    run = subprocess.run([sys.executable, "-c", code], cwd=moved, capture_output=True, text=True, timeout=300,
                         env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert run.returncode == 0, run.stderr[-2000:]


def test_a_checkpoint_names_its_base_like_the_final_adapter(tiny_model_dir, tmp_path):
    """A checkpoint folder is an adapter too (export, lora.init_from and essa.warm_start take
    one): its adapter_config.json names the base as the final adapter's does, never this
    machine's path, and a merge here still finds the base through edgetune.json."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.core.runfolder import RunDir

    from edgetune.engine.models.export import export
    from edgetune.engine.models.model import lora_config

    from edgetune.engine.training.loop import RunContext, load_checkpoint, save_checkpoint

    cfg = settings.from_dict({"method": "sft", "model": {"name": str(tiny_model_dir), "quant": "none"},
                              "lora": {"r": 4, "alpha": 8}, "run": {"runs_dir": str(tmp_path)}})
    run = RunDir(tmp_path / "run")
    run.path.mkdir()
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(cfg.lora))
    ckpt = save_checkpoint(RunContext(cfg=cfg, run=run, emit=lambda *a, **k: None), 3, model)
    final = _adapter(tiny_model_dir, str(tiny_model_dir), tmp_path / "adapter", tmp_path)
    named = json.loads((ckpt / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert named == tiny_model_dir.name and str(tiny_model_dir) not in (ckpt / "adapter_config.json").read_text()
    info = json.loads((ckpt / "edgetune.json").read_text())
    assert info["base_path"] == str(tiny_model_dir) and info["step"] == 3 and info["base_model"] == named
    # still a checkpoint: the training state loads back
    assert load_checkpoint(ckpt, model)["step"] == 3
    # elsewhere: the folder alone with the base under the name it gives
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    moved = export(ckpt, elsewhere / "ckpt")
    (elsewhere / named).symlink_to(tiny_model_dir, target_is_directory=True)
    code = ("import json; from transformers import AutoModelForCausalLM; from peft import PeftModel; "
            "base = json.load(open('ckpt/adapter_config.json'))['base_model_name_or_path']; "
            "PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), 'ckpt'); print('LOADED', base)")
    done = subprocess.run([sys.executable, "-c", code], cwd=moved.parent, capture_output=True, text=True,
                          timeout=300, env={"HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin", "HOME": str(tmp_path)})
    assert done.returncode == 0 and f"LOADED {named}" in done.stdout, done.stderr[-2000:]
    # here: a merged export of the checkpoint finds the base where it was loaded from
    merged = export(ckpt, tmp_path / "merged-export", merged=True)
    assert (merged / "merged" / "config.json").is_file()
