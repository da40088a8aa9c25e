"""The quantised-base cache (engine/models/quant_cache.py): the first NF4 load of a local folder
stores the 4-bit weights, the second loads them without quantising and computes the same
logits; a changed source file or quantisation setting gives another entry; a failed store
leaves none."""

import os
import shutil

import pytest
import torch

from edgetune.engine.core.settings import ModelSettings

from edgetune.engine.models import model as model_lib
from edgetune.engine.models import quant_cache


@pytest.fixture()
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETUNE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache" / "quantized"


@pytest.fixture()
def source(tmp_path, tiny_model_dir):
    d = tmp_path / "src"
    shutil.copytree(tiny_model_dir, d)
    return d


def _logits(model):
    ids = torch.tensor([[5, 17, 99, 3, 250, 8]])
    with torch.no_grad():
        return model(input_ids=ids).logits


def _dequantised(model):
    from bitsandbytes.functional import dequantize_4bit

    return {n: dequantize_4bit(m.weight.data, m.weight.quant_state) for n, m in model.named_modules()
            if type(m).__name__ == "Linear4bit"}


def test_second_load_reads_the_stored_4bit_weights(cache, source, capfd):
    ms = ModelSettings(name=str(source), quant="nf4", device="cpu")
    first, _, _ = model_lib.load_base(ms)
    err = capfd.readouterr().err
    assert "quantised base: stored in" in err
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1 and (entries[0] / "config.json").is_file()
    assert "quantization_config" in (entries[0] / "config.json").read_text()

    second, _, path = model_lib.load_base(ms)
    assert "quantised base: loaded from the cache" in capfd.readouterr().err
    assert path == str(source)  # the run still names the user's model, not the cache
    assert type(second.model.layers[0].mlp.down_proj).__name__ == "Linear4bit"
    a, b = _dequantised(first), _dequantised(second)
    assert a.keys() == b.keys() and len(a) == 2 * 7
    assert all(torch.equal(a[n], b[n]) for n in a)
    torch.testing.assert_close(_logits(second), _logits(first), rtol=0, atol=0)


def _entry(cache):
    entries = [p for p in cache.iterdir() if not p.name.startswith(".")]
    assert len(entries) == 1
    return entries[0]


def _truncate(f):
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])


def _flip_a_byte(f):
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size: only the checksum can tell
    f.write_bytes(bytes(data))


def _drop_checksums(f):
    (f.parent / quant_cache.CHECKSUMS).unlink()


@pytest.mark.parametrize("harm, said", [
    (_truncate, r"is damaged: model.safetensors has \d+ bytes, it was stored with \d+"),
    (_flip_a_byte, "is damaged: model.safetensors does not match its stored checksum"),
    (_drop_checksums, r"has no checksums \(stored by an older edgetune, or cut off while storing\)"),
])
def test_a_damaged_entry_is_named_dropped_and_stored_again(cache, source, capfd, harm, said):
    """A truncated (a crash, a full disk) or edited cache entry is ours: the next load says
    so in the log, deletes it, quantises the source again and stores a good entry."""
    import re

    ms = ModelSettings(name=str(source), quant="nf4", device="cpu")
    first, _, _ = model_lib.load_base(ms)
    entry = _entry(cache)
    assert quant_cache.damage(entry) is None
    harm(entry / "model.safetensors")
    capfd.readouterr()

    second, _, _ = model_lib.load_base(ms)
    err = capfd.readouterr().err
    assert re.search(f"warning: quantised base: the cached entry {re.escape(str(entry))} {said}; deleted it, "
                     "quantising the source again", err), err
    assert "quantised base: stored in" in err and "loaded from the cache" not in err
    assert _entry(cache) == entry and quant_cache.damage(entry) is None
    torch.testing.assert_close(_logits(second), _logits(first), rtol=0, atol=0)
    model_lib.load_base(ms)
    assert "quantised base: loaded from the cache" in capfd.readouterr().err


def test_an_entry_that_passes_its_checksums_but_does_not_load_is_stored_again(cache, source, capfd):
    ms = ModelSettings(name=str(source), quant="nf4", device="cpu")
    model_lib.load_base(ms)
    entry = _entry(cache)
    (entry / "model.safetensors").write_bytes(b"not a safetensors file")
    quant_cache.seal(entry)  # consistent checksums over a bad file
    capfd.readouterr()
    model_lib.load_base(ms)
    err = capfd.readouterr().err
    assert f"warning: quantised base: the cached entry {entry} does not load (" in err, err
    assert "quantised base: stored in" in err and quant_cache.damage(entry) is None


def test_key_follows_source_files_and_settings(source):
    q = model_lib.quantization_config(ModelSettings(quant="nf4"), torch.float32).to_dict()
    k = quant_cache.key(source, q, "torch.float32")
    assert k == quant_cache.key(source, q, "torch.float32")
    assert k != quant_cache.key(source, q, "torch.bfloat16")
    assert k != quant_cache.key(source, {**q, "bnb_4bit_use_double_quant": False}, "torch.float32")
    cfg = source / "config.json"
    st = cfg.stat()
    os.utime(cfg, ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # the user edited the model
    assert quant_cache.key(source, q, "torch.float32") != k
    assert quant_cache.key("Qwen/Qwen2.5-7B", q, "torch.float32") is None  # hub ids are not cached


def test_a_failed_store_leaves_no_entry(cache, source, monkeypatch):
    from transformers import PreTrainedModel

    def broken(self, *a, **kw):
        raise OSError("disk full")

    monkeypatch.setattr(PreTrainedModel, "save_pretrained", broken)
    with pytest.raises(OSError, match="disk full"):
        model_lib.load_base(ModelSettings(name=str(source), quant="nf4", device="cpu"))
    assert not cache.exists() or not any(cache.iterdir())


def test_two_runs_storing_the_same_entry_keep_the_first(cache, source, capfd):
    """Two runs of one model started together both quantise it; the second store finds the
    entry published and keeps it, rather than failing or replacing a folder being read."""
    ms = ModelSettings(name=str(source), quant="nf4", device="cpu")
    model, _, _ = model_lib.load_base(ms)
    (entry,) = [p for p in cache.iterdir() if not p.name.startswith(".")]
    before = {f.name: f.stat().st_mtime_ns for f in entry.iterdir()}
    said = quant_cache.store(model, entry.name)
    assert said == f"not stored: {entry} was stored by another run meanwhile"
    assert {f.name: f.stat().st_mtime_ns for f in entry.iterdir()} == before
    assert quant_cache.damage(entry) is None
    assert [p.name for p in cache.iterdir()] == [entry.name]  # no temporary left


def test_plain_weights_are_not_cached(cache, source):
    model_lib.load_base(ModelSettings(name=str(source), quant="none", device="cpu"))
    assert not cache.exists()


def test_quant_cache_off_stores_nothing(cache, source):
    model_lib.load_base(ModelSettings(name=str(source), quant="nf4", device="cpu", quant_cache=False))
    assert not cache.exists()


def test_a_gguf_met_by_several_processes_at_once_is_dequantised_once(tmp_path, monkeypatch):
    """The app's worker and its chat worker (or test processes side by side) meeting a GGUF
    file for the first time: one dequantises it, the others wait for its folder."""
    import subprocess
    import sys
    import textwrap

    monkeypatch.setenv("EDGETUNE_CACHE", str(tmp_path / "cache"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    code = textwrap.dedent(f"""
        import time
        from edgetune.engine.models import model
        from edgetune.engine.core.runfolder import atomic_dir

        def dequantise(gguf, out):  # the real one takes 10-30 CPU-seconds
            with open({str(tmp_path / 'calls')!r}, "a") as f:
                f.write("x")
            time.sleep(1.0)
            with atomic_dir(out) as tmp:
                (tmp / "config.json").write_text("{{}}")
            return out

        model._dequantise_into = dequantise
        print(model._gguf_to_folder(model.Path({str(gguf)!r})))
    """)
    procs = [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120)[0].strip() for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert (tmp_path / "calls").read_text() == "x"
    assert len(set(outs)) == 1 and (model_lib.Path(outs[0]) / "config.json").is_file()
