"""GGUF export: the LoRA GGUF read back has llama.cpp's names, shapes, alpha and q/k row
order; a merged GGUF copies the base's metadata and folds the adapter in; a base or an
adapter llama.cpp cannot take is one line and nothing is written. The slow test runs the
exports in a real llama.cpp (llama-cpp-python) against edgetune's own chat."""

import json
import time
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from edgetune.engine.models.export_gguf import CHECK_FILE, LORA_FILE, Lora, write_merged

from edgetune.engine import cli

N_HEAD, N_KV, HEAD_DIM, HIDDEN, R = 4, 2, 4, 16, 2


def _adapter(tmp_path, arch="LlamaForCausalLM", **config):
    """An adapter folder by hand: q/k/v LoRA on a 2-layer Llama-shaped base (config.json only)."""
    base = tmp_path / "base"
    base.mkdir()
    (base / "config.json").write_text(json.dumps({"architectures": [arch], "num_attention_heads": N_HEAD,
                                                  "num_key_value_heads": N_KV, "num_hidden_layers": 2}))
    a = tmp_path / "adapter"
    a.mkdir()
    (a / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": R, "lora_alpha": 4,
                                                       "target_modules": ["q_proj", "k_proj", "v_proj"], **config}))
    (a / "edgetune.json").write_text(json.dumps({"base_model": "x", "base_path": str(base), "method": "sft"}))
    rng = np.random.default_rng(0)
    t = {}
    for layer in range(2):
        for proj, out in (("q_proj", N_HEAD * HEAD_DIM), ("k_proj", N_KV * HEAD_DIM), ("v_proj", N_KV * HEAD_DIM)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            t[f"{key}.lora_A.weight"] = rng.standard_normal((R, HIDDEN)).astype(np.float32)
            t[f"{key}.lora_B.weight"] = rng.standard_normal((out, R)).astype(np.float32)
    save_file(t, str(a / "adapter_model.safetensors"))
    return a, t


def _error_line(argv, capsys) -> str:
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in err, err
    return lines[0]


def test_lora_gguf_has_llama_cpp_names_shapes_alpha_and_row_order(tmp_path, capsys):
    import gguf

    adapter, t = _adapter(tmp_path)
    out = tmp_path / "exp"
    assert cli.main(["export", str(adapter), "--out", str(out), "--gguf"]) == 0
    printed = capsys.readouterr().out
    r = gguf.GGUFReader(str(out / "gguf" / LORA_FILE))
    assert r.fields["general.type"].contents() == "adapter"
    assert r.fields["general.architecture"].contents() == "llama"
    assert r.fields["adapter.type"].contents() == "lora"
    assert r.fields["adapter.lora.alpha"].contents() == pytest.approx(4.0)
    got = {x.name: np.asarray(x.data) for x in r.tensors}
    assert len(got) == 12 and {x.tensor_type.name for x in r.tensors} == {"F32"}
    src = "model.layers.1.self_attn.{}.lora_{}.weight"
    # A [r, in] as PEFT has it; v's B as is
    np.testing.assert_array_equal(got["blk.1.attn_q.weight.lora_a"], t["base_model.model." + src.format("q_proj", "A")])
    np.testing.assert_array_equal(got["blk.1.attn_v.weight.lora_b"], t["base_model.model." + src.format("v_proj", "B")])
    # q and k's B rows in llama.cpp's rotary order: row h*d + 2j + k of the GGUF is row h*d + k*d/2 + j
    for proj, heads, name in (("q_proj", N_HEAD, "attn_q"), ("k_proj", N_KV, "attn_k")):
        b = t["base_model.model." + src.format(proj, "B")]
        g = got[f"blk.1.{name}.weight.lora_b"]
        assert g.shape == b.shape == (heads * HEAD_DIM, R)
        for h in range(heads):
            for j in range(HEAD_DIM // 2):
                for k in range(2):
                    np.testing.assert_array_equal(g[h * HEAD_DIM + 2 * j + k], b[h * HEAD_DIM + k * HEAD_DIM // 2 + j])
    modelfile = (out / "gguf" / "Modelfile").read_text()
    assert f"ADAPTER ./{LORA_FILE}" in modelfile and "\nFROM ./base.gguf" in modelfile
    check = json.loads((out / "gguf" / CHECK_FILE).read_text())
    assert check["status"] == "not run"
    assert "llama.cpp check not run" in printed


def test_rslora_alpha_is_folded_into_llama_cpps_alpha_over_r(tmp_path):
    import gguf

    adapter, _ = _adapter(tmp_path, use_rslora=True)
    out = tmp_path / "exp"
    assert cli.main(["export", str(adapter), "--out", str(out), "--gguf"]) == 0
    alpha = gguf.GGUFReader(str(out / "gguf" / LORA_FILE)).fields["adapter.lora.alpha"].contents()
    assert alpha / R == pytest.approx(4 / np.sqrt(R))  # llama.cpp scales by alpha / r


@pytest.mark.parametrize("case,expect", [
    ("arch", "architecture GPT2LMHeadModel has no GGUF mapping"),
    ("dora", "DoRA"),
    ("merged", "a merged GGUF is written from the base's own GGUF file"),
    ("zip", "a GGUF export writes a folder; drop --zip"),
])
def test_what_llama_cpp_cannot_take_is_one_line_and_nothing_is_written(tmp_path, capsys, case, expect):
    adapter, _ = _adapter(tmp_path, **({"use_dora": True} if case == "dora" else {}),
                          **({"arch": "GPT2LMHeadModel"} if case == "arch" else {}))
    out = tmp_path / "exp"
    extra = {"merged": ["--merged"], "zip": ["--zip"]}.get(case, [])
    line = _error_line(["export", str(adapter), "--out", str(out), "--gguf", *extra], capsys)
    assert expect in line
    assert not out.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["adapter", "base"]


def test_merged_gguf_copies_the_metadata_and_folds_the_adapter_in(tmp_path):
    import gguf

    base = tmp_path / "base.gguf"
    w = gguf.GGUFWriter(str(base), "llama")
    w.add_block_count(1)
    w.add_chat_template("{{ messages }}<|im_end|>")
    w.add_token_list(["<unk>", "<s>", "<|im_end|>"])
    w.add_eos_token_id(2)
    rng = np.random.default_rng(1)
    q = rng.standard_normal((64, 64)).astype(np.float32)
    w.add_tensor("blk.0.attn_q.weight", gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                 raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(64, np.float32))
    w.add_tensor("blk.0.ffn_up.weight", rng.standard_normal((8, 20)).astype(np.float32))  # rows Q8_0 cannot block
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    a, b = rng.standard_normal((2, 64)).astype(np.float32), rng.standard_normal((64, 2)).astype(np.float32)
    lora = Lora(alpha=8.0, rank=2, pairs={"blk.0.attn_q.weight": (a, b)})
    want = gguf.quants.dequantize(gguf.quants.quantize(q, gguf.GGMLQuantizationType.Q8_0),
                                  gguf.GGMLQuantizationType.Q8_0) + 4.0 * (b @ a)
    for qtype, kind, tol in (("f16", "F16", 5e-3), ("q8_0", "Q8_0", 5e-2)):
        path = tmp_path / f"m-{qtype}.gguf"
        write_merged(base, lora, path, qtype)
        r = gguf.GGUFReader(str(path))
        assert r.fields["tokenizer.chat_template"].contents() == "{{ messages }}<|im_end|>"
        assert r.fields["tokenizer.ggml.tokens"].contents() == ["<unk>", "<s>", "<|im_end|>"]
        assert r.fields["general.architecture"].contents() == "llama"
        t = {x.name: x for x in r.tensors}
        assert t["blk.0.attn_q.weight"].tensor_type.name == kind
        assert t["blk.0.attn_norm.weight"].tensor_type.name == "F32"
        assert t["blk.0.ffn_up.weight"].tensor_type.name == "F16"
        merged = gguf.quants.dequantize(t["blk.0.attn_q.weight"].data, t["blk.0.attn_q.weight"].tensor_type)
        assert np.abs(merged - want).max() < tol * np.abs(want).max()


@pytest.mark.slow
def test_llama_cpp_runs_the_exports_as_edgetune_does(tmp_path, capsys):
    """A short SFT run on the embedded model, exported --merged --gguf: llama.cpp's greedy
    completions (base GGUF + LoRA GGUF, merged F16, merged Q8_0) match edgetune's chat."""
    pytest.importorskip("llama_cpp")
    runs = tmp_path / "runs"
    assert cli.main(["train", "--preset", "sft-quickstart", "--set", "sft.steps=30", "--set", "sft.eval_every=30",
                     "--set", "model.quant=none", "--name", "q", "--runs-dir", str(runs)]) == 0
    capsys.readouterr()
    t0 = time.time()
    assert cli.main(["export", str(runs / "q"), "--out", str(tmp_path / "exp"), "--merged", "--gguf"]) == 0
    printed = capsys.readouterr().out
    folder = tmp_path / "exp" / "gguf"
    check = json.loads((folder / CHECK_FILE).read_text())
    print(f"export + check {time.time() - t0:.0f} s:", json.dumps(check["per_file"], indent=1))
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [LORA_FILE, "Modelfile", "Modelfile.merged", "merged-f16.gguf", "merged-q8_0.gguf", CHECK_FILE,
         "SmolLM2-135M-Instruct.Q4_1.gguf"])  # the base, which the Modelfile's FROM names
    assert check["status"] == "passed", check.get("first_difference")
    assert len(check["files"]) == 3 and all(len(rows) == check["prompts"] for rows in check["per_file"].values())
    assert "llama.cpp check passed" in printed
    modelfile = (folder / "Modelfile").read_text()
    assert "FROM ./SmolLM2-135M-Instruct.Q4_1.gguf" in modelfile and 'PARAMETER stop "<|im_end|>"' in modelfile


def test_the_export_tab_shows_the_checks_line(tmp_path):
    """The app's folder export with GGUF ticked: one message naming the GGUF folder and the
    line of llama.cpp's check from gguf-check.json (here: not run, the base is a folder)."""
    from edgetune.engine.core import settings

    from edgetune.engine.run import api

    from edgetune.app.tab_export import ExportTab

    adapter, _ = _adapter(tmp_path)
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    adapter.rename(run / "adapter")
    cfg = settings.resolve(preset="sft-quickstart", overrides=[f"model.name={tmp_path / 'base'}"])
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text("")

    class Page:
        attached = "attached"
        run_of = staticmethod(api.open_run)

    import gradio as gr

    with gr.Blocks():
        tab = ExportTab(Page())
    out = tmp_path / "exp"
    done = tab.do_folder({"attached": str(run), tab.out_dir: str(out), tab.merged: False, tab.gguf: True})
    msg = done[tab.msg]
    check = json.loads((out / "gguf" / CHECK_FILE).read_text())
    assert "\n" not in msg.strip() and f"GGUF files in `{out / 'gguf'}`" in msg
    assert f"llama.cpp check not run: {check['why']}" in msg
    # the export to download from the page: the folder zipped, and each GGUF file, in the run folder
    import zipfile

    files = done[tab.files]  # as Gradio serves them (its copies of the files in the run folder)
    assert files.visible and [f["orig_name"] for f in files.value] == ["exp.zip", LORA_FILE]
    assert sorted(p.name for p in (run / "exports").rglob("*") if p.is_file()) == sorted(["exp.zip", LORA_FILE])
    with zipfile.ZipFile(files.value[0]["path"]) as z:
        assert sorted(z.namelist()) == sorted(f"exp/{p.relative_to(out)}" for p in out.rglob("*") if p.is_file())
    assert Path(files.value[1]["path"]).read_bytes() == (out / "gguf" / LORA_FILE).read_bytes()
    failed = tab.do_folder({"attached": str(run), tab.out_dir: str(out), tab.merged: False, tab.gguf: True})
    assert failed[tab.msg].startswith("✗") and not failed[tab.files].visible  # a second export: refused


def test_the_modelfile_points_at_the_base_inside_the_export(tmp_path):
    """A run trained on a GGUF file: the export holds that file (linked or copied) and the
    Modelfile's FROM names it there, not where the run found it (for the embedded model:
    inside the virtual environment)."""
    import gguf

    from edgetune.engine.core.settings import resolve

    from edgetune.engine.models.export_gguf import write_gguf

    run = tmp_path / "run"
    run.mkdir()
    adapter, _ = _adapter(run)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    base = elsewhere / "my-base.Q8_0.gguf"
    w = gguf.GGUFWriter(str(base), "llama")
    w.add_block_count(2)
    w.add_tensor("blk.0.attn_norm.weight", np.ones(HIDDEN, np.float32))
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    (run / "config.yaml").write_text(resolve(overrides=[f"model.name={base}"]).to_yaml())
    write_gguf(adapter, tmp_path / "out", merged=False)
    modelfile = (tmp_path / "out" / "Modelfile").read_text()
    assert "\nFROM ./my-base.Q8_0.gguf" in "\n" + modelfile and str(elsewhere) not in modelfile
    assert (tmp_path / "out" / "my-base.Q8_0.gguf").read_bytes() == base.read_bytes()
    assert f"ADAPTER ./{LORA_FILE}" in modelfile


@pytest.fixture(scope="module")
def embedded_run(tmp_path_factory):
    """A run folder on the embedded model (a GGUF base) holding an adapter as a run saves it."""
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.core import settings

    from edgetune.engine.models.export import write_adapter
    from edgetune.engine.models.model import check_model, load_tokenizer, lora_config

    root = tmp_path_factory.mktemp("embedded-run")
    cfg = settings.resolve(preset="sft-quickstart", overrides=["lora.r=2", "model.quant=none",
                                                                 f"run.runs_dir={root}"])
    path = check_model(cfg.model)
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(path), lora_config(cfg.lora))
    run = root / "r"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text("")
    write_adapter(run / "adapter", model, load_tokenizer(path), cfg, path, {})
    return run


# A llama_cpp as a native build for another CPU behaves: it dies of SIGILL while it loads the
# LoRA, it hangs, or it fails with an error of its own. It writes its pid where the test reads it.
FAKE_LLAMA_CPP = {
    "SIGILL": "os.kill(os.getpid(), signal.SIGILL)",
    "hang": "time.sleep(3600)",
    "error": "raise RuntimeError('llama_model_load: error loading model: unknown tensor type 41')",
}


@pytest.mark.parametrize("fault, why", [
    ("SIGILL", "it died with SIGILL (illegal instruction)"),
    ("hang", "it took longer than 5 s and was stopped"),
    ("error", "it ended with exit status 1: RuntimeError: llama_model_load: error loading model: unknown tensor "
              "type 41"),
])
def test_a_llama_cpp_that_crashes_or_hangs_leaves_a_complete_export(embedded_run, tmp_path, monkeypatch, capsys,
                                                                     fault, why):
    from edgetune.engine.core.runfolder import pid_alive

    from edgetune.engine.models import export_gguf

    fake = tmp_path / "site" / "llama_cpp"
    fake.mkdir(parents=True)
    pid_file = tmp_path / "llama.pid"
    (fake / "__init__.py").write_text(
        "import os, resource, signal, time\n"
        "resource.setrlimit(resource.RLIMIT_CORE, (0, 0))\n"
        "class Llama:\n"
        "    def __init__(self, **kw):\n"
        f"        open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
        "        print(\"lora for 'blk.0.attn_q.weight' cannot use buft 'AMX', fallback to CPU\", flush=True)\n"
        f"        {FAKE_LLAMA_CPP[fault]}\n")
    monkeypatch.setenv("PYTHONPATH", str(fake.parent))  # the check's process finds it; this one does not
    monkeypatch.setattr(export_gguf, "CHECK_TIME_LIMIT_S", 5)
    out = tmp_path / "exp"
    assert cli.main(["export", str(embedded_run), "--out", str(out), "--gguf"]) == 0
    printed = capsys.readouterr()
    line = (f"llama.cpp check could not run: {why}; the files are written, check them with llama.cpp's llama-cli, "
            "or with `ollama create -f Modelfile` in the gguf folder")
    assert printed.out.splitlines()[-1] == line and "Traceback" not in printed.err
    check = json.loads((out / "gguf" / CHECK_FILE).read_text())
    assert check == {"status": "could not run", "why": line.removeprefix("llama.cpp check could not run: ")}
    assert sorted(p.name for p in (out / "gguf").iterdir()) == sorted(
        [LORA_FILE, "Modelfile", CHECK_FILE, "SmolLM2-135M-Instruct.Q4_1.gguf"])  # the base the Modelfile names
    import gguf

    assert len(gguf.GGUFReader(str(out / "gguf" / LORA_FILE)).tensors) > 0  # the export is whole
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    assert not pid_alive(int(pid_file.read_text()))  # llama.cpp's process went with the check


def test_an_adapter_folder_copied_out_of_its_run_says_so_not_that_its_base_is_no_gguf(tmp_path):
    from edgetune.engine.models.export_gguf import Base, check_line, verify

    adapter = tmp_path / "my-adapter"  # copied out of runs/<name>/adapter
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    result = verify(adapter, tmp_path / "out", Base("llama", True, 4, 2, 2, None))
    assert check_line(result) == ("llama.cpp check not run: an adapter folder without its run (the check needs the "
                                  "run's model)")
