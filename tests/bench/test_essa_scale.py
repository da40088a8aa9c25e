"""bench/essa_scale.py: the scaled copies of a warm-start adapter it evaluates."""

import bench_script


def test_essa_scale_multiplies_every_lora_b_and_nothing_else(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    src = tmp_path / "adapter"
    src.mkdir()
    w = {"m.q_proj.lora_A.weight": torch.randn(4, 8), "m.q_proj.lora_B.weight": torch.randn(8, 4)}
    save_file(w, str(src / "adapter_model.safetensors"))
    (src / "adapter_config.json").write_text("{}")
    out = bench_script.load("essa_scale").scaled_copy(src, 2.5, tmp_path / "scaled")
    got = load_file(str(out / "adapter_model.safetensors"))
    assert torch.equal(got["m.q_proj.lora_A.weight"], w["m.q_proj.lora_A.weight"])
    assert torch.allclose(got["m.q_proj.lora_B.weight"], 2.5 * w["m.q_proj.lora_B.weight"])
    assert (out / "adapter_config.json").read_text() == "{}"
    assert torch.equal(load_file(str(src / "adapter_model.safetensors"))["m.q_proj.lora_B.weight"],
                       w["m.q_proj.lora_B.weight"])  # the source is left as it was


def test_refuses_a_missing_adapter_and_an_existing_report(tmp_path, capsys):
    import pytest

    bench = bench_script.load("essa_scale")
    data = tmp_path / "data"
    data.mkdir()
    for f in ("train_rl.jsonl", "eval_rl.jsonl"):
        (data / f).write_text("")
    args = ["--adapter", str(tmp_path / "none"), "--data", str(data), "--task", "gcd", "--out", str(tmp_path / "out")]
    with pytest.raises(SystemExit):
        bench.main(args)
    assert "none/adapter_model.safetensors: no such file" in capsys.readouterr().err
    (tmp_path / "none").mkdir()
    (tmp_path / "none" / "adapter_model.safetensors").write_text("x")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "essa_scale.json").write_text("mine")
    with pytest.raises(SystemExit):
        bench.main(args)
    assert "exists" in capsys.readouterr().err
    assert (tmp_path / "out" / "essa_scale.json").read_text() == "mine"
