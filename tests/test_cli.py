"""The command line on bad input: one line naming the problem, a non-zero exit, and no
half-written run folder (a run that fails after it started is marked failed)."""

import json
import subprocess
import sys

import pytest

from edgetune.engine.events import read_events


def edgetune(*args, cwd=None, timeout=600):
    return subprocess.run([sys.executable, "-m", "edgetune.engine.cli", *args], capture_output=True,
                          text=True, cwd=cwd, timeout=timeout)


def _train(tmp_path, *sets, preset="sft-quickstart"):
    args = ["train", "--preset", preset, "--runs-dir", str(tmp_path / "runs"), "--name", "r"]
    for s in sets:
        args += ["--set", s]
    return edgetune(*args)


def _one_error_line(p):
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("error:")]
    assert len(lines) == 1, p.stderr[-2000:]
    assert "Traceback" not in p.stderr
    return lines[0]


@pytest.mark.parametrize("sets, needle", [
    (["lora.alpah=4"], "unknown setting 'lora.alpah' (did you mean 'alpha'?)"),
    (["sft.lr=-0.1"], "sft.lr must be positive"),
    (["sft.steps=0"], "sft.steps must be positive"),
    (["sft.optimizer=adamw8bit"], "sft.optimizer: 'adamw8bit' is not one of auto, adamw, adamw_8bit"),
    (["sft.sebp=maybe"], "sft.sebp: 'maybe' is not one of auto, on, off"),
    (["model.name=./no/such/model"], "model path does not exist: ./no/such/model"),
    (["data.path=/no/such/file.jsonl"], "/no/such/file.jsonl: data.path: file not found"),
])
def test_errors_before_any_run_folder(tmp_path, sets, needle):
    p = _train(tmp_path, *sets)
    assert p.returncode == 2
    assert needle in _one_error_line(p)
    assert not (tmp_path / "runs").exists() or not any((tmp_path / "runs").iterdir())


def _failed_run(tmp_path, p, needle):
    assert p.returncode == 2, p.stderr[-2000:]
    assert needle in _one_error_line(p)
    run = tmp_path / "runs" / "r"
    events = read_events(run / "events.jsonl")
    assert events[-1]["type"] == "error" and events[-1]["kind"] == "input"
    assert needle in events[-1]["message"]
    assert not (run / "adapter").exists()
    return events


def test_malformed_json_line_names_file_and_row(tmp_path, tiny_model_dir):
    bad = tmp_path / "bad.jsonl"
    good = json.dumps({"prompt": "What is 1 plus 2?", "completion": "3"})
    bad.write_text("\n".join([good, good, '{"prompt": "x", "completion": ', good]) + "\n")
    p = _train(tmp_path, f"model.name={tiny_model_dir}", f"data.path={bad}")
    _failed_run(tmp_path, p, f"{bad}, row 3")


def test_empty_dataset(tmp_path, tiny_model_dir):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    p = _train(tmp_path, f"model.name={tiny_model_dir}", f"data.path={empty}")
    _failed_run(tmp_path, p, str(empty))


def test_row_without_target(tmp_path, tiny_model_dir):
    f = tmp_path / "d.jsonl"
    rows = [{"prompt": "What is 1 plus 2?", "completion": "3"}] * 3 + [{"prompt": "What is 2 plus 2?", "completion": ""}]
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    p = _train(tmp_path, f"model.name={tiny_model_dir}", f"data.path={f}")
    _failed_run(tmp_path, p, "row 4")


def test_unknown_columns(tmp_path, tiny_model_dir):
    f = tmp_path / "d.jsonl"
    f.write_text(json.dumps({"question": "q", "reply": "r"}) + "\n")
    p = _train(tmp_path, f"model.name={tiny_model_dir}", f"data.path={f}")
    line = _one_error_line(p)
    assert "question" in line and "reply" in line


def test_unsupported_architecture(tmp_path):
    from transformers import ViTConfig

    folder = tmp_path / "vit"
    ViTConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(folder)
    p = _train(tmp_path, f"model.name={folder}")
    assert p.returncode == 2
    assert "architecture 'vit' is not a causal language model" in _one_error_line(p)


def test_presets_and_runs_listing(tmp_path):
    p = edgetune("presets")
    assert p.returncode == 0 and "sft-quickstart" in p.stdout
    p = edgetune("runs", "--runs-dir", str(tmp_path))
    assert p.returncode == 0
