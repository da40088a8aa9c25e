"""The memory planner: its parts add up, move the right way with batch / length / rank /
checkpointing, give plausible numbers for the embedded model, and its static part
(weights + LoRA + optimizer state) matches the bytes of a really loaded NF4 model."""

import json
import subprocess
import sys

import pytest

from edgetune.engine.core.errors import ModelError
from edgetune.engine.core.settings import resolve

from edgetune.engine.planning import planner

GiB = 1024**3
QWEN7B = dict(model_type="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
              num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False)


@pytest.fixture(scope="module")
def q7b(tmp_path_factory):
    d = tmp_path_factory.mktemp("q7b")
    (d / "config.json").write_text(json.dumps(QWEN7B))
    return str(d)


def plan(name, *sets, **kw):
    kw.setdefault("detect_gpu", False)
    return planner.estimate(resolve(overrides=[f"model.name={name}", *sets]), **kw)


@pytest.mark.parametrize("method", ["sft", "fgrpo", "essa"])
def test_parts_add_up(q7b, method):
    p = plan(q7b, f"method={method}", gpu_total=80 * GiB)
    assert p["total"] == sum(p[k] for k in p["parts"])
    assert all(p[k] >= 0 for k in p["parts"])
    assert 0 < p["allocated_peak"] <= p["total"]


def test_monotone_in_batch_seq_rank(q7b):
    base = plan(q7b, "sft.batch_size=2", "data.max_seq_len=512", "lora.r=8")
    for change in ("sft.batch_size=4", "data.max_seq_len=1024", "lora.r=32"):
        bigger = plan(q7b, "sft.batch_size=2", "data.max_seq_len=512", "lora.r=8", change)
        assert bigger["total"] > base["total"], change
    assert plan(q7b, "lora.r=32")["lora"] == 4 * plan(q7b, "lora.r=8")["lora"]


def test_checkpointing_lowers_activations(q7b):
    on = plan(q7b, "sft.batch_size=4", "data.max_seq_len=1024")
    off = plan(q7b, "sft.batch_size=4", "data.max_seq_len=1024", "model.gradient_checkpointing=false")
    assert on["activations"] * 5 < off["activations"]
    assert on["total"] < off["total"]


def test_verdict_suggests_a_change_that_fits(q7b):
    p = plan(q7b, "sft.batch_size=8", "data.max_seq_len=4096", "model.gradient_checkpointing=false",
             gpu_total=24 * GiB)
    assert p["fits"] is False and "try: " in p["verdict"]
    assert plan(q7b, gpu_total=80 * GiB)["fits"] is True
    assert plan(q7b)["fits"] is None  # no card known


def test_embedded_model_is_plausible():
    p = plan("embedded:smollm2-135m")
    # 135M params: ~106M in NF4 linears (~56 MB) + 28M embedding in bf16 (~57 MB)
    assert 0.09 * GiB < p["weights"] < 0.15 * GiB
    assert 0.3 * GiB < p["total"] < 4 * GiB
    assert p["model"]["layers"] == 30


def test_7b_numbers_are_plausible(q7b):
    p = plan(q7b, "sft.batch_size=8", "data.max_seq_len=1024")
    # 3.4 GiB of NF4 blocks + 2.0 GiB bf16 embed / lm_head; bench/essa.py measured 5.24 GiB after load
    assert 4.8 * GiB < p["weights"] < 6 * GiB
    assert 10 * GiB < p["total"] < 30 * GiB
    f = plan(q7b, "method=fgrpo", "fgrpo.prompts_per_step=16", "fgrpo.num_generations=16",
             "fgrpo.max_new_tokens=1024")
    assert f["phase"] == "rollout" and f["kv_cache"] > 2 * GiB


def test_unknown_hub_id_says_so():
    with pytest.raises(ModelError, match="not in the local Hugging Face cache"):
        plan("someone/not-a-cached-model-xyz")


def test_import_loads_no_torch():
    code = "import sys, edgetune.engine.planning.planner as p; print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "False"


def _tensor_bytes(t) -> int:
    return t.numel() * t.element_size()


def test_static_part_matches_a_loaded_nf4_model(tmp_path, embedded_dir):
    """weights + LoRA + optimizer state, predicted vs the storage of a tiny NF4 model
    loaded by the engine on the CPU (fp32 compute, AdamW) after one optimizer step."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import make_optimizer

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=2048, hidden_size=256, intermediate_size=1024, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(tmp_path)
    model_lib.load_tokenizer(str(embedded_dir)).save_pretrained(tmp_path)
    c = resolve(overrides=[f"model.name={tmp_path}", "model.quant=nf4", "model.device=cpu", "lora.r=16"])
    model, _, _ = model_lib.load(c)
    opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, "cpu")
    ids = torch.randint(0, 2048, (1, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()

    weights = lora = 0
    for name, p in model.named_parameters():
        if p.requires_grad:
            lora += _tensor_bytes(p)
            continue
        weights += _tensor_bytes(p)
        qs = getattr(p, "quant_state", None)
        if qs is not None:
            weights += _tensor_bytes(qs.absmax) + _tensor_bytes(qs.code)
            if qs.nested:
                weights += _tensor_bytes(qs.state2.absmax) + _tensor_bytes(qs.state2.code) + _tensor_bytes(qs.offset)
    weights += sum(_tensor_bytes(b) for _, b in model.named_buffers())
    optim = sum(_tensor_bytes(t) for st in opt.state.values() for t in st.values() if torch.is_tensor(t))
    actual = weights + lora + optim

    p = planner.estimate(c, device="cpu", detect_gpu=False)
    predicted = p["weights"] + p["lora"] + p["optimizer"]
    assert abs(predicted - actual) / actual < 0.15, (predicted, actual, p["weights"], weights, p["lora"], lora,
                                                     p["optimizer"], optim)
    assert abs(p["lora"] - lora) / lora < 0.01


@pytest.mark.parametrize("autocast", [False, True])
@pytest.mark.parametrize("padded", [False, True])
def test_layer_activations_match_what_autograd_saves(tmp_path, embedded_dir, padded, autocast):
    """One decoder layer of an NF4 + LoRA (all 7 projections) Qwen2 loaded by the engine
    (bf16 compute, frozen parameters kept in bf16, so a bf16 residual): the bytes autograd
    saves inside it, against layer_activation_bytes; with and without a padding mask, with
    and without bf16 autocast (the engine's CUDA forward; the CPU's autocast stands in)."""
    from dataclasses import replace

    import torch
    from layer_probe import saved_bytes_of_first_layer, tiny_nf4_qwen2

    model, c = tiny_nf4_qwen2(tmp_path, embedded_dir)
    assert model.get_base_model().model.embed_tokens.weight.dtype == torch.bfloat16
    ids = torch.randint(0, 512, (4, 64))
    mask = torch.ones_like(ids)
    if padded:
        mask[1:, 40:] = 0
    measured = saved_bytes_of_first_layer(model, ids, mask, autocast=autocast)
    ctx, _ = planner.make_ctx(c, "cuda", "auto")
    assert ctx.act_bytes == 2 and ctx.autocast  # on CUDA the engine runs autocast
    ctx = replace(ctx, autocast=autocast, liger=False)  # measured here without Liger (tests/test_liger.py: with)
    predicted = planner.layer_activation_bytes(ctx, ids.numel(), masked=padded)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_preset_hub_model_is_planned_offline(q7b):
    """The 7B presets name a hub id: its shape comes from the table when it is not cached."""
    p = plan("Qwen/Qwen2.5-7B-Instruct", "sft.batch_size=8", "data.max_seq_len=1024")
    assert p["total"] == plan(q7b, "sft.batch_size=8", "data.max_seq_len=1024")["total"]


def test_batched_essa_without_a_known_card_plans_one_candidate(q7b):
    """The engine picks K from the card's free memory at run time; with no card known the
    planner must not assume the whole population shares a pass (48 x 128 rows of 1,536
    tokens would be 1.5 TB), and it says what it assumed."""
    sets = ("method=essa", "essa.evaluation=batched", "essa.population=48", "essa.prompts_per_generation=128",
            "data.max_seq_len=1024", "essa.max_new_tokens=512", "essa.warm_start=given")
    p = plan(q7b, *sets)
    assert p["candidates_per_batch"] == 1
    assert any("candidates per batch are picked at run time" in n for n in p["notes"])
    small = sets + ("essa.prompts_per_generation=8",)
    with_card = plan(q7b, *small, gpu_total=141 * GiB, gpu_free=135 * GiB)
    assert 1 < with_card["candidates_per_batch"] <= 48 and with_card["total"] < 141 * GiB


def test_the_time_estimate_counts_each_phase_and_the_first_steps_correct_it(tiny_model_dir):
    """Before Start: each phase's seconds from the model's matmuls at this machine's measured
    rate; twice the steps, twice the training; no held-out split, no evaluations; after
    the first steps, training from the measured step time and the evaluations scaled alike."""
    from edgetune.engine.core.settings import from_dict

    from edgetune.engine.planning import timing

    def cfg(steps, eval_every=0, method="sft"):
        return from_dict({"method": method, "model": {"name": str(tiny_model_dir), "device": "cpu"},
                          "data": {"path": "embedded:arith-sft", "max_seq_len": 64},
                          method: {"steps": steps, "eval_every": eval_every} if method == "sft" else {}})

    report = {"train_rows": 300, "eval_rows": 30, "token_lengths": {"mean": 50.0}}
    one = timing.estimate(cfg(100_000), report)  # long enough that the phases' 0.1 s rounding is noise
    two = timing.estimate(cfg(200_000), report)
    assert one["assumed"] == [] and one["phases"]["initial_eval"] == 0 == one["phases"]["final_eval"]
    assert one["phases"]["training"] > 0 and two["phases"]["training"] == pytest.approx(
        2 * one["phases"]["training"], rel=0.02)
    # a held-out split large enough that its evaluation is well above the phases' 0.1 s rounding
    evals = timing.estimate(cfg(10, eval_every=10), {**report, "eval_rows": 3000})
    assert evals["phases"]["initial_eval"] > 0 and evals["phases"]["final_eval"] == evals["phases"]["initial_eval"]
    assert evals["total_s"] == pytest.approx(sum(evals["phases"].values()), abs=0.2)
    guessed = timing.estimate(cfg(100_000), None)  # no data report: rows of max_seq_len tokens, an upper bound
    assert guessed["assumed"] and guessed["phases"]["training"] > one["phases"]["training"]
    measured = 3 * evals["per_step_s"]
    later = timing.refine(evals, steps_done=2, seconds_per_step=measured, steps_total=1000)
    assert later["phases"]["training"] == pytest.approx(1000 * measured, rel=0.01)
    # (phases are rounded to 0.1 s: a small evaluation's tripling is compared to that)
    assert later["phases"]["final_eval"] == pytest.approx(3 * evals["phases"]["final_eval"], rel=0.05, abs=0.15)
    assert timing.estimate(cfg(4, method="essa"), report)["total_s"] is None  # not modelled: says so


def test_the_apps_time_estimate_times_the_machine_without_loading_torch():
    """The page's line before Start (app/tab_model.time_text): the matmul rate timed once in a
    process of its own, the app's process still without torch; from the Data tab's report
    when there is one, else an upper bound that says so."""
    import subprocess
    import sys

    code = """
import sys
from edgetune.engine.core.settings import resolve
from edgetune.app.tab_model import time_text
cfg = resolve(preset="sft-quickstart")
bound = time_text(cfg, None)
own = time_text(cfg, {"train_rows": 40, "eval_rows": 10, "token_lengths": {"mean": 20.0}})
assert "torch" not in sys.modules
print(bound); print(own)
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    bound, own = out.stdout.strip().splitlines()
    assert bound.startswith("**Time on this machine: about") and "assumed rows of data.max_seq_len" in bound
    assert "Check the data on the Data tab" in bound
    assert "initial eval" in own and "final eval" in own and "assumed rows" not in own
