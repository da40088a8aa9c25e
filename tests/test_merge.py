"""`edgetune merge`: adapters of the tiny model combined by PEFT's add_weighted_adapter into
a folder that records where it came from, loads in PEFT and is served by the decode loop."""

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def _adapter(out: Path, model_dir: Path, seed: int, layers, r: int) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(model_dir),
                           LoraConfig(r=r, lora_alpha=2 * r, target_modules=layers, init_lora_weights=False))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def parts(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("merge")
    return {"a": _adapter(root / "a", tiny_model_dir, 0, ["q_proj", "v_proj"], 4),
            "b": _adapter(root / "b", tiny_model_dir, 1, ["q_proj", "v_proj"], 4),
            "c": _adapter(root / "c", tiny_model_dir, 2, ["k_proj", "down_proj"], 8)}


def edgetune(*args, cwd):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *map(str, args)], cwd=cwd,
                          capture_output=True, text=True, timeout=600, env={"PYTHONPATH": str(ROOT),
                                                                           "PATH": "/usr/bin:/bin",
                                                                           "HF_HUB_OFFLINE": "1"})


def _delta(model, name) -> dict:
    """Each layer's full update B A * scaling of adapter `name`."""
    out = {}
    for mod_name, m in model.named_modules():
        if hasattr(m, "lora_A") and name in m.lora_A:
            out[mod_name] = m.get_delta_weight(name)
    return out


@pytest.mark.parametrize("method", ["linear", "ties", "dare", "svd"])
def test_merge_writes_what_peft_combines_with_its_provenance(parts, tiny_model_dir, tmp_path, method):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    out = tmp_path / "merged"
    p = edgetune("merge", parts["a"], parts["b"], "--method", method, "--weights", "0.7,0.3", "--base", tiny_model_dir,
                 "--quant", "none", "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stdout.strip() == f"merged 2 adapters ({method}) into {out}"
    info = json.loads((out / "edgetune.json").read_text())
    assert info["merge"]["method"] == method and info["merge"]["weights"] == [0.7, 0.3]
    assert [x["adapter"] for x in info["merge"]["from"]] == [str(parts["a"].resolve()), str(parts["b"].resolve())]
    assert info["base_path"] == str(tiny_model_dir)

    # the same combination, made by PEFT here: the saved adapter is it
    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), parts["a"],
                                      adapter_name="a")
    model.load_adapter(parts["b"], adapter_name="b")
    kind = {"dare": "dare_linear"}.get(method, method)
    torch.manual_seed(0)  # (dare drops at random: compare its shapes and layers only)
    model.add_weighted_adapter(["a", "b"], [0.7, 0.3], "here", combination_type=kind,
                               density=0.5 if method in ("ties", "dare") else None,
                               svd_rank=4 if method == "svd" else None)
    model.load_adapter(out, adapter_name="saved")
    here, saved = _delta(model, "here"), _delta(model, "saved")
    assert here.keys() == saved.keys() and len(here) == 4  # q and v of both layers
    for k in here:
        if method == "dare":
            assert here[k].shape == saved[k].shape
        else:
            torch.testing.assert_close(saved[k], here[k])
    assert any(saved[k].abs().sum() > 0 for k in saved)


def test_a_merged_adapter_is_served_and_svd_takes_any_ranks_and_layers(parts, tiny_model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import load_tokenizer

    from edgetune.engine.generation.batcher import Batcher, adapter_problem

    out = tmp_path / "svd"
    p = edgetune("merge", parts["a"], parts["c"], "--method", "svd", "--base", tiny_model_dir, "--quant", "none",
                 "--out", out, cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads((out / "edgetune.json").read_text())["merge"]["weights"] == [0.5, 0.5]
    assert adapter_problem(out) is None
    b = Batcher(AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval(), load_tokenizer(str(tiny_model_dir)))
    try:
        b.add_adapter("svd", out)
        assert b.adapters() == {"svd": str(out)}
    finally:
        b.close()


def test_merge_refuses_in_one_line(parts, tiny_model_dir, tmp_path):
    taken = tmp_path / "taken"
    taken.mkdir()
    (taken / "mine.txt").write_text("the user's")
    p = edgetune("merge", parts["a"], parts["b"], "--base", tiny_model_dir, "--out", taken, cwd=tmp_path)
    assert p.returncode == 2 and p.stderr == f"error: {taken} exists and is not an empty folder: merge into a new one\n"
    assert (taken / "mine.txt").read_text() == "the user's"
    p = edgetune("merge", parts["a"], parts["b"], "--weights", "1", "--base", tiny_model_dir, "--out", tmp_path / "x",
                 cwd=tmp_path)
    assert p.stderr == "error: --weights 1: 1 weights for 2 adapters\n"
    p = edgetune("merge", parts["a"], parts["c"], "--method", "linear", "--base", tiny_model_dir, "--quant", "none",
                 "--out", tmp_path / "y", cwd=tmp_path)
    assert p.returncode == 2 and p.stderr.startswith("error: merge --method linear: ") and \
        p.stderr.rstrip().endswith("; svd takes adapters of any ranks and layers"), p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and not (tmp_path / "y").exists()


def test_a_merged_adapter_is_evaluated_against_its_parts(parts, tiny_model_dir, tmp_path):
    """`edgetune eval --adapter merged/ --adapter a/ --adapter b/ --base`: the merged folder is
    graded beside its parts and the base on the same task, each in the table by its name,
    with the paired comparisons."""
    import shutil

    for name in ("a", "b"):  # the folders where the user works, named as typed
        shutil.copytree(parts[name], tmp_path / name)
    p = edgetune("merge", "a", "b", "--method", "linear", "--base", tiny_model_dir, "--quant", "none",
                 "--out", "merged", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    (tmp_path / "sums.jsonl").write_text("".join(json.dumps({"prompt": f"What is {i} + {i}?", "answer": str(2 * i)})
                                                 + "\n" for i in range(1, 5)))
    p = edgetune("eval", "--preset", "fgrpo-quickstart", "--base", "--adapter", "merged", "--adapter", "a",
                 "--adapter", "b", "--task", "sums.jsonl", "--set", f"model.name={tiny_model_dir}",
                 "--set", "model.quant=none", "--set", "fgrpo.max_new_tokens=4", cwd=tmp_path)
    assert p.returncode == 0, p.stderr[-2000:]
    table = [ln.split()[0] for ln in p.stdout.splitlines() if re.match(r"^(the base|merged|a|b)\s+\d", ln)]
    assert table == ["the", "merged", "a", "b"], p.stdout
    for pair in ("merged vs the base, success_rate", "a vs merged, success_rate", "b vs merged, success_rate"):
        assert pair in p.stdout, (pair, p.stdout)
