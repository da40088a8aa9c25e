"""An adapter as GGUF files for llama.cpp and Ollama, and the check that llama.cpp runs them
as edgetune does.

`edgetune export <run> --gguf` writes `gguf/` in the export folder:
- `adapter-lora.gguf`: the LoRA in llama.cpp's adapter format (general.type "adapter",
  adapter.type "lora", adapter.lora.alpha; tensors `<base tensor>.lora_a` [r, in] and
  `.lora_b` [out, r], as llama.cpp's convert_lora_to_gguf.py writes them), applied beside
  the base model's GGUF (`llama-cli -m base.gguf --lora adapter-lora.gguf`);
- `Modelfile`: for Ollama, FROM the base GGUF (put in the folder beside it: a hard link where
  the file system allows, else a copy), ADAPTER the LoRA;
- with `--merged`, `merged-f16.gguf` and `merged-q8_0.gguf`: the base GGUF's metadata
  (tokenizer, chat template) and tensors with the adapter folded in, and `Modelfile.merged`;
- `gguf-check.json`: greedy completions of a fixed set of prompts in llama.cpp
  (llama-cpp-python) against edgetune's own, or why the check did not run.

llama.cpp runs in a child process of its own, with a time limit: it is native code that
pip builds for the CPU it was built on (and that can die of an illegal instruction on
another, or hang), so its crash, hang or absence ends the check with one line and never
the export, whose files are all written by then.

Tensor names come from gguf's TensorNameMap. llama.cpp's converter permutes the rows of
Llama's q and k projections (rotary pairs interleaved); the transformers GGUF loader undoes
that, so the adapter, trained on transformers' layout, gets the same row permutation on its
B matrices (the output side) here. A merged GGUF needs a GGUF base (its tokenizer metadata
is copied as is); for a Hugging Face folder base, merge with `--merged` and convert that
folder with llama.cpp's convert_hf_to_gguf.py.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

from edgetune.engine.core.errors import RunError

# Hugging Face architectures whose GGUF layout we know: (llama.cpp architecture, whether
# llama.cpp's converter permutes the q/k rows). From llama.cpp's conversion/ (LlamaModel
# and MistralModel permute, Qwen2Model and Qwen3Model do not).
ARCHITECTURES = {"LlamaForCausalLM": ("llama", True), "MistralForCausalLM": ("llama", True),
                 "Qwen2ForCausalLM": ("qwen2", False), "Qwen3ForCausalLM": ("qwen3", False)}

LORA_FILE, MERGED_FILES, CHECK_FILE = "adapter-lora.gguf", ("merged-f16.gguf", "merged-q8_0.gguf"), "gguf-check.json"

# Tokens that end a turn in common chat templates: each one the template writes becomes an
# Ollama stop token, beside the tokenizer's end of sequence.
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>", "</s>")


@dataclasses.dataclass
class Base:
    arch: str  # llama.cpp's architecture name (general.architecture)
    permute_qk: bool
    n_head: int
    n_kv_head: int
    n_layers: int
    gguf: Path | None  # the base model's GGUF file, when it was trained from one


@dataclasses.dataclass
class Lora:
    alpha: float  # llama.cpp scales B @ A by alpha / r; rsLoRA's alpha / sqrt(r) is folded in
    rank: int
    pairs: dict[str, tuple[np.ndarray, np.ndarray]]  # GGUF tensor name -> (A [r, in], B [out, r]) in GGUF layout


# --------------------------------------------------------------------------- reading


def _run_of(adapter: Path) -> Path | None:
    run = adapter.parent
    return run if adapter.name == "adapter" and (run / "config.yaml").is_file() else None


def base_gguf_file(adapter: Path) -> Path | None:
    """The GGUF file the adapter's run trained on (the embedded model or a .gguf path), or None."""
    from edgetune.engine.core.settings import EMBEDDED_MODEL, load_run_config

    from edgetune.engine.models.model import EMBEDDED_GGUF

    run = _run_of(adapter)
    if run is None:
        return None
    name = load_run_config(run / "config.yaml").model.name
    if name == EMBEDDED_MODEL:
        import importlib.util

        spec = importlib.util.find_spec(EMBEDDED_GGUF[0])
        return Path(spec.submodule_search_locations[0]) / EMBEDDED_GGUF[1] if spec else None
    p = Path(name).expanduser()
    return p if p.suffix == ".gguf" and p.is_file() else None


def read_base(adapter: Path) -> Base:
    """The base's architecture and shape, from the config of the folder it was loaded from."""
    info = json.loads((adapter / "edgetune.json").read_text()) if (adapter / "edgetune.json").is_file() else {}
    config = Path(info.get("base_path") or "") / "config.json"
    if not info.get("base_path") or not config.is_file():
        raise RunError(f"{adapter}: a GGUF export needs the base model's config.json on this machine "
                       "(edgetune.json names no base folder that exists here)")
    hf = json.loads(config.read_text())
    names = hf.get("architectures") or [hf.get("model_type", "?")]
    if names[0] not in ARCHITECTURES:
        raise RunError(f"{config}: architecture {names[0]} has no GGUF mapping in edgetune (known: "
                       f"{', '.join(sorted(ARCHITECTURES))}); export the PEFT adapter and convert it with "
                       "llama.cpp's convert_lora_to_gguf.py")
    arch, permute = ARCHITECTURES[names[0]]
    n_head = hf["num_attention_heads"]
    return Base(arch, permute, n_head, hf.get("num_key_value_heads") or n_head, hf["num_hidden_layers"],
                base_gguf_file(adapter))


def permute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's LlamaModel.permute on the output rows of a q or k projection."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def read_lora(adapter: Path, base: Base) -> Lora:
    """The adapter's A and B matrices under their GGUF names; an adapter llama.cpp cannot
    apply is refused in one line."""
    import gguf
    from safetensors.numpy import load_file

    cfg_path = adapter / "adapter_config.json"
    cfg = json.loads(cfg_path.read_text())
    kind = cfg.get("peft_type", "LORA")
    if kind != "LORA":
        raise RunError(f"{cfg_path}: a {kind} adapter; llama.cpp applies only LoRA adapters")
    for key, why in (("use_dora", "DoRA's magnitude vectors"), ("rank_pattern", "a rank per module"),
                     ("alpha_pattern", "an alpha per module"), ("modules_to_save", "fully trained modules"),
                     ("lora_bias", "LoRA biases")):
        if cfg.get(key):
            raise RunError(f"{cfg_path}: the adapter has {why} ({key}); llama.cpp's LoRA format holds plain "
                           "A/B pairs with one alpha only")
    rank, alpha = int(cfg["r"]), float(cfg["lora_alpha"])
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    weights = adapter / "adapter_model.safetensors"
    if not weights.is_file():
        raise RunError(f"{adapter}: no adapter_model.safetensors (a GGUF export reads the safetensors weights)")
    tensors = load_file(str(weights))
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH[base.arch.upper()], base.n_layers)
    pairs: dict[str, list] = {}
    for key, t in tensors.items():
        for side in ("lora_A", "lora_B"):
            if key.endswith(f".{side}.weight"):
                hf_name = key.removeprefix("base_model.model.").removesuffix(f".{side}.weight") + ".weight"
                break
        else:
            raise RunError(f"{weights}: tensor {key} is not a LoRA A/B matrix; llama.cpp cannot apply it")
        name = names.get_name(hf_name, try_suffixes=(".weight",))
        if name is None:
            raise RunError(f"{weights}: {hf_name} has no GGUF tensor name for {base.arch}")
        if name.startswith(("token_embd.", "output.")):
            raise RunError(f"{weights}: a LoRA on {hf_name} (the embedding or output layer); edgetune's GGUF "
                           "export covers the linear layers inside the blocks only")
        pairs.setdefault(name, [None, None])[side == "lora_B"] = t.astype(np.float32)
    out = {}
    for name, (a, b) in sorted(pairs.items()):
        if a is None or b is None:
            raise RunError(f"{weights}: {name} has only one of its LoRA A/B matrices")
        if base.permute_qk and ".attn_q." in name:
            b = permute_rows(b, base.n_head)
        elif base.permute_qk and ".attn_k." in name:
            b = permute_rows(b, base.n_kv_head)
        out[name] = (a, b)
    if not out:
        raise RunError(f"{weights}: holds no LoRA matrices")
    return Lora(alpha=scaling * rank, rank=rank, pairs=out)


# --------------------------------------------------------------------------- writing


def write_lora(lora: Lora, base: Base, path: Path) -> None:
    """The LoRA GGUF, in fp32 (an adapter is small; no rounding on top of training's)."""
    import gguf

    w = gguf.GGUFWriter(str(path), base.arch)
    w.add_type(gguf.GGUFType.ADAPTER)
    w.add_string(gguf.Keys.Adapter.TYPE, "lora")
    w.add_float32(gguf.Keys.Adapter.LORA_ALPHA, lora.alpha)
    for name, (a, b) in lora.pairs.items():
        w.add_tensor(name + ".lora_a", np.ascontiguousarray(a))
        w.add_tensor(name + ".lora_b", np.ascontiguousarray(b))
    _finish(w)


def _finish(w) -> None:
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_merged(base_gguf: Path, lora: Lora, path: Path, qtype: str) -> None:
    """The base GGUF with the adapter folded in: every metadata field copied (tokenizer, chat
    template), each weight matrix dequantised, merged where the adapter touches it, and
    written as F16 or Q8_0 (a row length Q8_0's blocks do not divide stays F16, as
    llama.cpp's own quantiser does); 1-D tensors (norms) stay F32."""
    import gguf
    from gguf.quants import dequantize, quantize

    reader = gguf.GGUFReader(str(base_gguf))
    arch = reader.fields["general.architecture"].contents()
    w = gguf.GGUFWriter(str(path), arch)
    for name, field in reader.fields.items():
        if name.startswith("GGUF.") or name in ("general.architecture", "general.file_type"):
            continue
        sub = field.types[-1] if field.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(name, field.contents(), field.types[0], sub)
    q8 = qtype == "q8_0"
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0 if q8 else gguf.LlamaFileType.MOSTLY_F16)
    scale = lora.alpha / lora.rank
    block = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q8_0][0]
    for t in reader.tensors:
        try:
            x = dequantize(t.data, t.tensor_type).astype(np.float32)
        except NotImplementedError:
            raise RunError(f"{base_gguf}: tensor {t.name} is {t.tensor_type.name}, which the gguf package cannot "
                           "dequantise; merge from a base GGUF in another type") from None
        if t.name in lora.pairs:
            a, b = lora.pairs[t.name]
            x = x + scale * (b @ a)
        if x.ndim == 1:
            w.add_tensor(t.name, x)
        elif q8 and x.shape[-1] % block == 0:
            w.add_tensor(t.name, quantize(x, gguf.GGMLQuantizationType.Q8_0), raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(t.name, x.astype(np.float16))
    _finish(w)


def modelfile(from_line: str, adapter_line: str | None, base_gguf: Path | None) -> str:
    """An Ollama Modelfile: the model, the adapter, stop tokens (end of sequence and the
    template's end-of-turn token) and the chat template as a comment (Ollama picks its own
    template by likeness to the GGUF's; converting Jinja to Go templates is not done here)."""
    template, stops = "", []
    if base_gguf is not None:
        import gguf

        fields = gguf.GGUFReader(str(base_gguf)).fields
        if "tokenizer.chat_template" in fields:
            template = fields["tokenizer.chat_template"].contents()
        if "tokenizer.ggml.eos_token_id" in fields and "tokenizer.ggml.tokens" in fields:
            eos = fields["tokenizer.ggml.eos_token_id"].contents()
            tokens = fields["tokenizer.ggml.tokens"]
            stops.append(str(tokens.parts[tokens.data[eos]], "utf-8"))
    stops += [t for t in END_OF_TURN if t in template and t not in stops]
    lines = ["# Ollama: `ollama create my-model -f <this file>` in this folder, then `ollama run my-model`.",
             from_line]
    if adapter_line:
        lines.append(adapter_line)
    lines += [f'PARAMETER stop "{s}"' for s in stops]
    if template:
        lines += ["", "# No TEMPLATE line: `ollama create` looks up the nearest of its own named templates to the",
                  "# GGUF's tokenizer.chat_template (a lookup, not a conversion). Where it finds none, or one that",
                  "# renders differently (a default system prompt, say), write a TEMPLATE in Go template syntax",
                  "# that renders as this chat template (Jinja) does; edgetune trained and checks with it:"]
        lines += [f"#   {line}" for line in template.splitlines()]
    return "\n".join(lines) + "\n"


def check_exportable(adapter: Path, merged: bool) -> tuple[Base, Lora]:
    """Everything a GGUF export refuses, before anything is written."""
    base = read_base(adapter)
    lora = read_lora(adapter, base)
    if base.gguf is not None:
        import gguf

        arch = gguf.GGUFReader(str(base.gguf)).fields["general.architecture"].contents()
        if arch != base.arch:
            raise RunError(f"{base.gguf}: a GGUF of architecture {arch}, where the adapter's base is {base.arch}")
    if merged and base.gguf is None:
        raise RunError(f"{adapter}: a merged GGUF is written from the base's own GGUF file, and this run's base "
                       "is not one; export --merged (a Hugging Face folder) and convert it with llama.cpp's "
                       "convert_hf_to_gguf.py")
    return base, lora


def link_or_copy(src: Path, dest: Path) -> None:
    """`dest` as a hard link to `src` (no space taken twice), a copy across file systems."""
    import shutil

    try:
        os.link(src, dest)
    except OSError:
        shutil.copyfile(src, dest)


def write_gguf(adapter: Path, out: Path, merged: bool) -> dict:
    """All GGUF files of one export into the new folder `out`; returns the check's result."""
    base, lora = check_exportable(adapter, merged)
    out.mkdir()
    write_lora(lora, base, out / LORA_FILE)
    if base.gguf is not None:  # the folder is whole: Ollama and llama.cpp need nothing outside it
        link_or_copy(base.gguf.resolve(), out / base.gguf.name)
    from_line = f"FROM ./{base.gguf.name}" if base.gguf else \
        "FROM ./base.gguf  # the base model as GGUF (llama.cpp's convert_hf_to_gguf.py); edgetune trained on a folder"
    (out / "Modelfile").write_text(modelfile(from_line, f"ADAPTER ./{LORA_FILE}", base.gguf))
    if merged:
        for name, qtype in zip(MERGED_FILES, ("f16", "q8_0")):
            write_merged(base.gguf, lora, out / name, qtype)
        (out / "Modelfile.merged").write_text(modelfile(f"FROM ./{MERGED_FILES[1]}", None, base.gguf))
    result = verify(adapter, out, base)
    (out / CHECK_FILE).write_text(json.dumps(result, indent=2))
    return result


# --------------------------------------------------------------------------- the check

# Prompts the check completes greedily: the embedded data's kind of task and a plain chat turn.
CHECK_PROMPTS = ("What is 3 + 4?", "What is 7 + 2?", "What is 5 + 8?", "Name a colour.")
CHECK_NEW_TOKENS = 16
# A prompt passes when llama.cpp's first-token logits are within LOGIT_TOL of edgetune's
# (largest difference over the vocabulary) and its greedy completion matches token for
# token, or parts where edgetune's own logits for its token and llama.cpp's are within
# NEAR_TIE: a near tie that a GGUF's quantised weights (a Q4_1 base, a Q8_0 merge) may tip.
# A q/k permutation or a scale gone wrong moves logits by tens.
LOGIT_TOL, NEAR_TIE = 2.0, 1.0


# The most seconds llama.cpp may take for the whole check (loading each GGUF, its greedy
# completions): a 7B merged F16 on a CPU takes minutes; past this it is taken for hung.
CHECK_TIME_LIMIT_S = 900
CHILD_LOG = "llama-cpp.log"  # in the check's temporary folder: what llama.cpp printed


def check_line(result: dict) -> str:
    """One line for the app and the CLI."""
    if result.get("status") == "passed":
        ties = sum(not r["match"] for rows in result["per_file"].values() for r in rows)
        tie_note = f"; {ties} of them part at a near tie" if ties else ""
        return (f"llama.cpp check passed: {result['prompts']} prompts' greedy completions match edgetune's "
                f"({', '.join(result['files'])}{tie_note})")
    if result.get("status") == "failed":
        return f"llama.cpp check FAILED: {result['first_difference']}"
    if result.get("status") == "could not run":
        return f"llama.cpp check could not run: {result.get('why', '?')}"
    return f"llama.cpp check not run: {result.get('why', '?')}"


def verify(adapter: Path, out: Path, base: Base) -> dict:
    """Greedy completions of CHECK_PROMPTS by llama.cpp (the base GGUF with the LoRA GGUF, and
    each merged GGUF) against edgetune's own greedy completions with the same adapter, on the base's own
    weights unquantised (what a GGUF holds; a run trained on a 4-bit copy of them). Prompts
    are rendered by edgetune (engine/data/prompts.py) and given to both as token ids."""
    run = _run_of(adapter)  # first: without its run, which base it had is not known (not that it is no GGUF)
    if run is None:
        return {"status": "not run", "why": "an adapter folder without its run (the check needs the run's model)"}
    if base.gguf is None:
        return {"status": "not run", "why": "the base is not a GGUF file; llama.cpp needs the base as GGUF"}
    if not _llama_cpp_installed():
        return {"status": "not run", "why": "llama-cpp-python not installed (pip install edgetune[gguf-check])"}
    from edgetune.engine.core.settings import load_run_config

    from edgetune.engine.data.prompts import prompt_ids

    from edgetune.engine.models.model import check_model, load_tokenizer

    # the model as the app's chat loads it (engine/generation/chat.py), on the GGUF's own weights
    model = dataclasses.replace(load_run_config(run / "config.yaml").model, quant="none", dtype="fp32")
    tok = load_tokenizer(check_model(model))
    prompts = prompt_ids(tok, [[{"role": "user", "content": p}] for p in CHECK_PROMPTS])
    eos = {tok.eos_token_id}  # where generate stops (engine/models/model.load_base sets it): llama.cpp stops there too
    runs = {f"{base.gguf.name} + {LORA_FILE}": dict(model_path=str(base.gguf), lora_path=str(out / LORA_FILE))}
    for name in MERGED_FILES:
        if (out / name).is_file():
            runs[name] = dict(model_path=str(out / name))
    llama = llama_in_child(runs, prompts, eos)  # first: a llama.cpp that cannot run costs no reference
    if isinstance(llama, str):
        return {"status": "could not run", "why": f"{llama}; the files are written, check them with llama.cpp's "
                                                  "llama-cli, or with `ollama create -f Modelfile` in the gguf folder"}
    import torch
    from peft import PeftModel

    from edgetune.engine.models.adapter import check_adapter_fits
    from edgetune.engine.models.model import load_base

    plain, _, _ = load_base(model)
    check_adapter_fits(plain, str(adapter))
    peft = PeftModel.from_pretrained(plain, str(adapter)).eval()
    ours = []
    with torch.no_grad():
        for ids in prompts:
            row = torch.tensor([ids])
            gen = peft.generate(input_ids=row, attention_mask=torch.ones_like(row), max_new_tokens=CHECK_NEW_TOKENS,
                                do_sample=False, pad_token_id=tok.pad_token_id, output_logits=True,
                                return_dict_in_generate=True)
            ours.append((gen.sequences[0, len(ids):].tolist(), [x[0].float().numpy() for x in gen.logits]))
    result = {"status": "passed", "reference": "edgetune, base unquantised fp32 + adapter", "prompts":
              len(prompts), "new_tokens": CHECK_NEW_TOKENS, "logit_tolerance": LOGIT_TOL, "near_tie_logits": NEAR_TIE, "files": list(runs),
              "per_file": {}}
    for label in runs:
        got = llama[label]
        rows = []
        for prompt, (toks, logits), (ltoks, llogits) in zip(CHECK_PROMPTS, ours, got):
            row = {"prompt": prompt, "match": toks == ltoks,
                   "first_logits_max_abs_diff": round(float(np.abs(logits[0] - llogits).max()), 4)}
            if toks != ltoks:  # where they part, how far apart edgetune itself put the two tokens
                k = next(i for i, (a, b) in enumerate(zip(toks + [-1], ltoks + [-1])) if a != b)
                if k < min(len(toks), len(ltoks)):
                    row["differs_at"] = k
                    row["edgetune_margin"] = round(float(logits[k][toks[k]] - logits[k][ltoks[k]]), 4)
            rows.append(row)
            ok = row["first_logits_max_abs_diff"] <= LOGIT_TOL and (
                row["match"] or row.get("edgetune_margin", NEAR_TIE) < NEAR_TIE)
            if not ok and result["status"] == "passed":
                text = tok.decode
                result["status"] = "failed"
                result["first_difference"] = (f"{label}: prompt {prompt!r}: llama.cpp {text(ltoks)!r}, "
                                              f"edgetune {text(toks)!r} (first-token logits differ by up to "
                                              f"{row['first_logits_max_abs_diff']})")
        result["per_file"][label] = rows
    return result


def _llama_cpp_installed() -> bool:
    """Whether a child process finds llama_cpp (a look-up: its native library is not loaded)."""
    code = "import importlib.util, sys; sys.exit(importlib.util.find_spec('llama_cpp') is None)"
    try:
        return subprocess.run([sys.executable, "-c", code], stdin=subprocess.DEVNULL, capture_output=True,
                              timeout=60).returncode == 0
    except (OSError, subprocess.SubprocessError):
        return False


def _death_words(code: int) -> str:
    """How a child process ended, as a user reads it: `SIGILL (illegal instruction)`."""
    try:
        sig = signal.Signals(-code)
        return f"it died with {sig.name} ({(signal.strsignal(sig) or sig.name).lower()})"
    except ValueError:
        return f"it died with signal {-code}"


def llama_in_child(runs: dict[str, dict], prompts: list[list[int]], eos: set[int],
                   limit: float | None = None) -> dict | str:
    """_llama_greedy for each of `runs` (label -> Llama's file arguments), in a child
    process of its own session, within `limit` seconds (CHECK_TIME_LIMIT_S): {label: [(ids,
    first logits), ...]}, or one line saying why it could not run (the signal it died of,
    its exit status and last line, or the time limit)."""
    limit = CHECK_TIME_LIMIT_S if limit is None else limit
    with tempfile.TemporaryDirectory(prefix="edgetune-llama-") as tmp:
        request = Path(tmp) / "request.json"
        request.write_text(json.dumps({"runs": runs, "prompts": prompts, "eos": sorted(eos)}))
        with open(Path(tmp) / CHILD_LOG, "w") as log:
            proc = subprocess.Popen([sys.executable, "-m", "edgetune.engine.models.export_gguf", str(request), tmp],
                                    stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=True)
            try:
                code = proc.wait(limit)
            except subprocess.TimeoutExpired:
                code = None
            finally:  # timed out, or the export itself interrupted: llama.cpp goes with it
                if proc.poll() is None:
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
        if code is None:
            return f"it took longer than {limit:g} s and was stopped"
        if code < 0:
            return _death_words(code)
        if code != 0:
            last = next((ln.strip() for ln in reversed((Path(tmp) / CHILD_LOG).read_text(errors="replace")
                                                       .splitlines()) if ln.strip()), "")
            return f"it ended with exit status {code}" + (f": {last[:300]}" if last else "")
        found = json.loads((Path(tmp) / "result.json").read_text())
        logits = np.load(Path(tmp) / "logits.npz")
        return {label: [(ids, logits[f"{i}-{j}"]) for j, ids in enumerate(found[label])]
                for i, label in enumerate(runs)}


def _child(request_path: str, out_dir: str) -> int:
    """The child process of llama_in_child: the greedy completions of every file of the
    request, written to out_dir (result.json: the ids; logits.npz: the first logits)."""
    req = json.loads(Path(request_path).read_text())
    found, logits = {}, {}
    for i, (label, kw) in enumerate(req["runs"].items()):
        rows = _llama_greedy(kw, req["prompts"], set(req["eos"]))
        found[label] = [ids for ids, _ in rows]
        logits.update({f"{i}-{j}": first for j, (_, first) in enumerate(rows)})
    np.savez(Path(out_dir) / "logits.npz", **logits)
    (Path(out_dir) / "result.json").write_text(json.dumps(found))
    return 0


def _llama_greedy(kw: dict, prompts: list[list[int]], eos: set[int]) -> list[tuple[list[int], np.ndarray]]:
    """Greedy token ids (up to CHECK_NEW_TOKENS, ending at an eos as transformers' generate does)
    and the first new token's logits, from llama.cpp on the CPU."""
    from llama_cpp import Llama

    # logits_all: llama-cpp-python keeps a step's logits in `scores` only then
    llm = Llama(n_ctx=512, n_threads=max(1, min(4, os.cpu_count() or 1)), verbose=False, seed=0, logits_all=True,
                **kw)
    out = []
    for ids in prompts:
        llm.reset()
        llm.eval(ids)
        first = np.array(llm.scores[llm.n_tokens - 1], dtype=np.float32)
        toks = []
        while len(toks) < CHECK_NEW_TOKENS:
            nxt = int(np.argmax(llm.scores[llm.n_tokens - 1]))
            toks.append(nxt)
            if nxt in eos:
                break
            llm.eval([nxt])
        out.append((toks, first))
    llm.close()
    return out


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1], sys.argv[2]))
