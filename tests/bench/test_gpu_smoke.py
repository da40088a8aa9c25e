"""bench/gpu_smoke.py --tiny: the GPU smoke run's user path (CLI commands, presets, a model
folder written with save_pretrained) end to end on the CPU, every part with its result."""

import json

import bench_script
import pytest


@pytest.mark.slow
def test_smoke_dry_run_drives_every_part(tmp_path):
    smoke = bench_script.load("gpu_smoke")
    rc = smoke.main(["--tiny", "--out", str(tmp_path), "--work", str(tmp_path / "work")])
    R = json.loads((tmp_path / "gpu_smoke.json").read_text())
    parts = R["parts"]
    assert rc == 0 and R["ok"], json.dumps(parts)[:2000]
    assert list(parts) == ["estimate", "sft_first", "sft_second", "padded_sebp_on", "padded_sebp_runs",
                           "padded_sebp_off", "export", "fgrpo", "essa"]
    assert parts["estimate"]["predicted_peak_GiB"] > 0
    assert parts["sft_first"]["steps"] == 6 and parts["sft_first"]["last"] == "finished"
    assert parts["sft_second"]["command_to_first_step_s"] > 0 and "loading->training" in parts["sft_second"]["phases_s"]
    # SEBP is exact: the same losses with it on and off
    on, off = parts["padded_sebp_on"]["last_step"], parts["padded_sebp_off"]["last_step"]
    assert on["loss"] == pytest.approx(off["loss"], rel=1e-5)
    assert parts["padded_sebp_runs"]["last_step"]["loss"] == pytest.approx(off["loss"], rel=1e-5)
    assert len(parts["padded_sebp_on"]["step_s"]) == 5
    assert "adapter_model.safetensors" in parts["export"]["peft"]["files"]
    assert "gguf/adapter-lora.gguf" in parts["export"]["gguf"]["files"]
    assert parts["fgrpo"]["update_ran"] and parts["fgrpo"]["steps"] == 3
    assert all(s > 0 for s in parts["fgrpo"]["reward_std"])
    assert len(parts["essa"]["generations"]) == 2
