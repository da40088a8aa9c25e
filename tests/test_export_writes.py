"""How an export writes: never over a file of the user's, even one that appears while it
runs; --force replaces only an export's own files; no link followed; a full disk, a long
name or a killed export leave one line and no temporary; a diverged adapter is refused."""

import errno
import json
import os
import pickle
import shutil
import subprocess
import sys
import zipfile

import numpy as np
import pytest
from safetensors.numpy import save

from edgetune.engine.core.errors import EdgetuneError, ModelError

from edgetune.engine.models import export as export_mod
from edgetune.engine.models.export import EXPORT_MARKER, TEMP_OWNER, TEMP_PREFIX, export

from edgetune.engine import cli


def _weights(value: float) -> bytes:
    return save({"base_model.model.layers.0.q_proj.lora_B.weight": np.full((4, 2), value, dtype=np.float32)})


@pytest.fixture
def run(tmp_path):
    """A run folder with a final adapter, built by hand (export copies and checks bytes)."""
    r = tmp_path / "runs" / "r"
    (r / "adapter").mkdir(parents=True)
    (r / "config.yaml").write_text("method: sft\n")
    (r / "events.jsonl").write_text("")
    (r / "adapter" / "adapter_config.json").write_text(json.dumps({"r": 8}))
    (r / "adapter" / "adapter_model.safetensors").write_bytes(_weights(0.5))
    return r


def _error_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def _temps(folder):
    return [p.name for p in folder.iterdir() if p.name.startswith((TEMP_PREFIX, "edgetune-kept-"))]


@pytest.mark.parametrize("existed", [False, True])
def test_a_file_that_appears_in_out_while_exporting_survives(run, tmp_path, monkeypatch, capsys, existed):
    out = tmp_path / "out"
    if existed:
        out.mkdir()  # an empty folder at the start
    move = export_mod._move

    def user_writes_then_move(built, target, as_zip):
        target.mkdir(exist_ok=True)
        (target / "notes.txt").write_text("mine")
        return move(built, target, as_zip)

    monkeypatch.setattr(export_mod, "_move", user_writes_then_move)
    line = _error_line(["export", str(run), "--out", str(out)], capsys)
    assert f"{out}: notes.txt appeared there while the export ran; nothing was written" in line
    assert sorted(p.name for p in out.iterdir()) == ["notes.txt"] and (out / "notes.txt").read_text() == "mine"
    assert _temps(tmp_path) == []


def test_a_file_that_appears_in_a_previous_export_during_force_survives(run, tmp_path, monkeypatch, capsys):
    out = export(run, tmp_path / "out")
    before = {p.name: p.read_bytes() for p in out.iterdir()}
    check = export_mod.check_target

    def user_writes_after_the_check(*a, **k):
        check(*a, **k)
        (out / "results.csv").write_text("1,2")

    monkeypatch.setattr(export_mod, "check_target", user_writes_after_the_check)
    line = _error_line(["export", str(run), "--out", str(out), "--force"], capsys)
    assert "results.csv appeared in the previous export while this one ran; nothing was replaced" in line
    assert {p.name: p.read_bytes() for p in out.iterdir()} == {**before, "results.csv": b"1,2"}
    assert _temps(tmp_path) == []


def test_force_keeps_the_users_files_in_a_previous_export_and_names_them(run, tmp_path, capsys):
    out = export(run, tmp_path / "out")
    assert set(json.loads((out / EXPORT_MARKER).read_text())["files"]) == {
        "adapter_config.json", "adapter_model.safetensors", EXPORT_MARKER}
    (out / "notes.md").write_text("what I found")
    (out / "eval").mkdir()
    (out / "eval" / "scores.json").write_text("{}")
    line = _error_line(["export", str(run), "--out", str(out), "--force"], capsys)
    assert f"{out}: holds eval, notes.md, which the previous export did not write" in line
    assert (out / "notes.md").read_text() == "what I found" and (out / "eval" / "scores.json").is_file()
    # without them, --force replaces the export's own files
    shutil.rmtree(out / "eval")
    (out / "notes.md").unlink()
    (run / "adapter" / "adapter_model.safetensors").write_bytes(_weights(2.0))
    assert cli.main(["export", str(run), "--out", str(out), "--force"]) == 0
    assert (out / "adapter_model.safetensors").read_bytes() == _weights(2.0)
    assert _temps(tmp_path) == []


def test_zip_into_a_folder_is_named_after_the_run(run, tmp_path, capsys):
    work = tmp_path / "work"
    work.mkdir()
    cwd = os.getcwd()
    os.chdir(work)
    try:
        assert cli.main(["export", str(run), "--out", "./", "--zip"]) == 0
    finally:
        os.chdir(cwd)
    assert sorted(p.name for p in work.iterdir()) == ["r.zip"]
    folder = tmp_path / "zips"
    folder.mkdir()
    (folder / "old.txt").write_text("keep")
    for arg in (str(folder), str(folder) + "/"):
        (folder / "r.zip").unlink(missing_ok=True)
        assert cli.main(["export", str(run), "--out", arg, "--zip"]) == 0
        assert sorted(p.name for p in folder.iterdir()) == ["old.txt", "r.zip"]
    assert "adapter_config.json" in zipfile.ZipFile(folder / "r.zip").namelist()
    assert cli.main(["export", str(run), "--out", str(tmp_path / "plain"), "--zip"]) == 0
    assert (tmp_path / "plain.zip").is_file()


@pytest.mark.parametrize("as_zip", [False, True])
def test_a_link_inside_the_adapter_is_refused_not_followed(run, tmp_path, capsys, as_zip):
    secret = tmp_path / "id_rsa"
    secret.write_text("PRIVATE KEY")
    (run / "adapter" / "tokenizer.json").symlink_to(secret)
    out = tmp_path / "out"
    line = _error_line(["export", str(run), "--out", str(out), *(["--zip"] if as_zip else [])], capsys)
    assert f"{run / 'adapter' / 'tokenizer.json'}: is a symbolic link" in line
    assert not out.exists() and not (tmp_path / "out.zip").exists() and _temps(tmp_path) == []


@pytest.mark.parametrize("as_zip", [False, True])
def test_a_full_disk_is_one_line_and_leaves_no_temporary(run, tmp_path, monkeypatch, capsys, as_zip):
    def disk_full(fin, fout, length=0):
        fout.write(fin.read(3))
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(shutil, "copyfileobj", disk_full)
    out = tmp_path / "out"
    line = _error_line(["export", str(run), "--out", str(out), *(["--zip"] if as_zip else [])], capsys)
    target = tmp_path / "out.zip" if as_zip else out
    assert line == f"error: {target}: no space left on the disk; nothing was written (free some space and export again)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["runs"]


def test_out_names_up_to_the_filesystems_limit(run, tmp_path, capsys):
    longest = tmp_path / ("a" * 255)
    assert cli.main(["export", str(run), "--out", str(longest)]) == 0
    assert (longest / "adapter_config.json").is_file()
    line = _error_line(["export", str(run), "--out", str(tmp_path / ("b" * 256))], capsys)
    assert "File name too long" in line
    line = _error_line(["export", str(run), "--out", str(tmp_path / ("c" * 253)), "--zip"], capsys)  # + .zip
    assert "File name too long" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["runs", longest.name])


def test_stale_temporaries_of_killed_exports_are_removed_and_only_those(run, tmp_path):
    done = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_pid = int(done.stdout)
    import socket

    def temp(name, owner):
        p = tmp_path / name
        (p / "x").mkdir(parents=True)
        (p / "x" / "merged.safetensors").write_bytes(b"big")
        if owner is not None:
            (p / TEMP_OWNER).write_text(json.dumps(owner))
        return p

    stale = temp(TEMP_PREFIX + "dead", {"pid": dead_pid, "host": socket.gethostname()})
    live = temp(TEMP_PREFIX + "live", {"pid": os.getpid(), "host": socket.gethostname()})
    unmarked = temp(TEMP_PREFIX + "user", None)
    export(run, tmp_path / "out")
    assert not stale.exists() and live.exists() and unmarked.exists()


def test_a_mount_point_or_another_device_is_one_line(run, tmp_path, monkeypatch, capsys):
    mount = tmp_path / "usb"
    mount.mkdir()
    real_ismount = os.path.ismount
    monkeypatch.setattr(os.path, "ismount", lambda p: str(p) == str(mount) or real_ismount(p))
    line = _error_line(["export", str(run), "--out", str(mount)], capsys)
    assert f"{mount}: is a mount point; export into a new folder inside it" in line
    monkeypatch.setattr(export_mod, "_move", lambda *a: (_ for _ in ()).throw(OSError(errno.EXDEV, "cross-device")))
    line = _error_line(["export", str(run), "--out", str(tmp_path / "new")], capsys)
    assert "cannot be moved into place" in line
    assert list(mount.iterdir()) == [] and _temps(tmp_path) == []


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_diverged_adapter_is_not_exported(run, tmp_path, capsys, value):
    (run / "adapter" / "adapter_model.safetensors").write_bytes(_weights(value))
    line = _error_line(["export", str(run), "--out", str(tmp_path / "out")], capsys)
    assert "tensor base_model.model.layers.0.q_proj.lora_B.weight holds NaN or infinite values" in line
    assert not (tmp_path / "out").exists() and _temps(tmp_path) == []


def test_half_precision_non_finite_weights_are_found(tmp_path):
    import torch
    from safetensors.torch import save_file

    from edgetune.engine.models.export import check_finite

    def write(t):
        save_file({"a": torch.zeros(3, dtype=t.dtype), "b": t}, str(tmp_path / "w.safetensors"))
        return tmp_path / "w.safetensors"

    for dtype in (torch.bfloat16, torch.float16):
        check_finite(write(torch.tensor([1.0, -2.0, 65504.0], dtype=dtype)))
        for bad in (float("inf"), float("-inf"), float("nan")):
            with pytest.raises(EdgetuneError, match="tensor b holds NaN or infinite values"):
                check_finite(write(torch.tensor([1.0, bad], dtype=dtype)))


class _RunsCode:
    def __reduce__(self):
        return (print, ("this must never run",))


def test_an_unsafe_pickled_adapter_is_one_line(tmp_path, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.models.model import add_lora

    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 4,
                                                             "target_modules": ["q_proj"]}))
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"w": _RunsCode()}, protocol=2))
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    with pytest.raises(ModelError) as e:
        add_lora(model, LoraSettings(init_from=str(adapter)), gradient_checkpointing=False)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"{adapter / 'adapter_model.bin'}: not a safetensors file nor a "
                                               "weights-only pickle (Unsupported global: GLOBAL ")
    assert "only adapter_model.safetensors or a weights-only adapter_model.bin is read" in msg


def test_an_export_carries_the_safetensors_weights_and_no_pickle(run, tmp_path, capsys):
    """A pickle beside the weights (an older PEFT's adapter_model.bin, a trainer's
    training_args.bin) stays behind: eval, init_from and a merge never read one. An
    adapter whose weights are only a pickle is refused in one line, nothing written."""
    adapter = run / "adapter"
    (adapter / "adapter_model.bin").write_bytes(pickle.dumps({"w": _RunsCode()}, protocol=2))
    (adapter / "training_args.bin").write_bytes(pickle.dumps({"lr": 1e-4}))
    (adapter / "sub").mkdir()
    (adapter / "sub" / "optimizer.pt").write_bytes(pickle.dumps([1]))
    for as_zip, out in ((False, tmp_path / "exp"), (True, tmp_path / "exp.zip")):
        export(run, out, as_zip=as_zip)
        names = set(zipfile.ZipFile(out).namelist()) if as_zip else \
            {str(p.relative_to(out)) for p in out.rglob("*") if p.is_file()}
        assert {"adapter_config.json", "adapter_model.safetensors"} <= names
        assert not [n for n in names if n.endswith((".bin", ".pt"))], names
    (adapter / "adapter_model.safetensors").unlink()
    line = _error_line(["export", str(run), "--out", str(tmp_path / "again")], capsys)
    assert line == (f"error: {adapter}: no adapter_model.safetensors (its weights are adapter_model.bin, a pickle); "
                    "an export carries the weights as safetensors only, which load without running code")
    assert not (tmp_path / "again").exists()
