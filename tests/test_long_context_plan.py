"""Long sequences in the memory planner (engine/planning/long_context.py): its tables in
docs/performance.md are the planner's, each lever's model against what autograd saves in a
real layer, the longest length that fits, and the refusal of a run past it."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.settings import resolve

from edgetune.engine.planning import long_context as L
from edgetune.engine.planning import planner

GiB = 1024**3
DOC = Path(__file__).resolve().parents[1] / "docs" / "performance.md"


def test_docs_tables_are_the_planners_own():
    text = DOC.read_text()
    assert L.growth_markdown() in text
    assert L.fit_markdown() in text


def test_what_grows_and_what_each_lever_takes_away():
    plain = L.growth(L.long_config("Qwen/Qwen2.5-7B", 131072))
    levers = L.growth(L.long_config("Qwen/Qwen2.5-7B", 131072, L.all_levers()))
    # without levers: 28 layer inputs of 131,072 x 3,584 bf16 values, and a packed row's boolean mask
    assert plain["checkpointed_inputs"] == 28 * 131072 * 3584 * 2
    assert plain["attention"] >= 131072**2
    # offloaded: two inputs on the GPU, the rest in host memory; the MLP one chunk at a time; no mask
    assert levers["checkpointed_inputs"] == 2 * 131072 * 3584 * 2
    assert levers["host_pinned"] == 28 * 131072 * 3584 * 2
    assert levers["mlp"] * 131072 == plain["mlp"] * L.MLP_CHUNK_SUGGESTED
    assert levers["attention"] == 0
    assert levers["layer_recompute"] < plain["layer_recompute"] / 3 and levers["total"] < plain["total"] / 3
    assert levers["logits_chunk"] == plain["logits_chunk"]  # 512 rows whatever the length


def test_a_chunk_longer_than_the_row_changes_nothing():
    a = planner.estimate(L.long_config("Qwen/Qwen2.5-7B", 2048), device="cuda", detect_gpu=False)
    b = planner.estimate(L.long_config("Qwen/Qwen2.5-7B", 2048, ["model.mlp_chunk_tokens=4096"]), device="cuda",
                         detect_gpu=False)
    assert a["total"] == b["total"]


@pytest.mark.parametrize("lever", ["chunk", "mask_free_padded"])
def test_lever_models_match_what_autograd_saves(tmp_path, embedded_dir, lever):
    """One decoder layer of the engine's NF4 + LoRA Qwen2 under bf16 autocast (as
    tests/test_planner.py measures the plain layer): the bytes autograd keeps with the MLP in
    chunks of 16 tokens, or with a padded batch through the mask-free attention."""
    import torch
    from layer_probe import saved_bytes_of_first_layer, tiny_nf4_qwen2

    from edgetune.engine.models import long_context as levers

    model, c = tiny_nf4_qwen2(tmp_path, embedded_dir)
    ids = torch.randint(0, 512, (4, 64))
    ctx, _ = planner.make_ctx(c, "cuda", "auto")
    ctx = replace(ctx, liger=False)
    if lever == "chunk":
        levers.chunk_mlp(model, 16)
        measured = saved_bytes_of_first_layer(model, ids, autocast=True)
        predicted = planner.layer_activation_bytes(replace(ctx, mlp_chunk=16), ids.numel())
        assert predicted < 0.5 * planner.layer_activation_bytes(ctx, ids.numel())
    else:
        mask = torch.ones_like(ids)
        mask[1:, 40:] = 0
        with levers.mask_free_attention(model):
            measured = saved_bytes_of_first_layer(model, ids, mask, autocast=True)
        # no mask and no repeated keys and values: what an unpadded batch keeps
        predicted = planner.layer_activation_bytes(ctx, ids.numel(), masked=False)
        parts = planner.train_activation_parts(replace(ctx, mask_free=True), 4, 64, 4 * 64)
        assert parts == planner.train_activation_parts(ctx, 4, 64, 4 * 64, masked=False)
    assert abs(predicted - measured) / measured < 0.05, (predicted, measured)


def test_longest_is_the_edge_of_the_prediction():
    cfg = L.long_config("Qwen/Qwen2.5-7B", 1024, L.all_levers())
    n = L.longest(cfg, 24 * GiB)
    assert L._total(cfg, n) <= 24 * GiB < L._total(cfg, n + 1)
    assert L.longest(cfg, 80 * GiB) > 3 * n  # more memory, a longer row
    assert L.longest(L.long_config("Qwen/Qwen2.5-72B", 1024), 24 * GiB) == 0  # the weights alone do not fit


def test_fit_rows_name_every_lever_not_on_yet():
    cfg = L.long_config("Qwen/Qwen2.5-7B", 1024)
    (row,) = L.fit_rows(cfg, (24,))
    assert list(row["levers"]) == ["model.offload_activations=true", "model.mlp_chunk_tokens=4096",
                                   "model.mask_free_attention=true",
                                   "model.offload_activations=true + model.mlp_chunk_tokens=4096 + "
                                   "model.mask_free_attention=true"]
    assert row["levers"]["model.offload_activations=true"] > row["as_set"]
    assert max(row["levers"].values()) > 4 * row["as_set"]
    assert L.fit_rows(L.long_config("Qwen/Qwen2.5-7B", 1024, L.all_levers()), (24,))[0]["levers"] == {}
    assert L.parse_memories("") == (24, 48, 80) and L.parse_memories("12.5,40") == (12.5, 40.0)
    with pytest.raises(ConfigError, match="--fit-seq-len"):
        L.parse_memories("24,lots")


def test_a_run_past_the_longest_is_refused_naming_the_lever():
    offload_fits = L.long_config("Qwen/Qwen2.5-7B", 48000)
    with pytest.raises(ConfigError) as e:
        L.refuse_too_long(offload_fits, "cuda", memory=24 * GiB)
    msg = str(e.value)
    assert "\n" not in msg and "data.max_seq_len=48,000" in msg and "set model.offload_activations=true (" in msg
    with pytest.raises(ConfigError, match=r"set model\.offload_activations=true \+ model\.mlp_chunk_tokens=4096"):
        L.refuse_too_long(L.long_config("Qwen/Qwen2.5-7B", 140000), "cuda", memory=24 * GiB)
    with pytest.raises(ConfigError, match="even with every long-sequence lever"):
        L.refuse_too_long(L.long_config("Qwen/Qwen2.5-7B", 400000, L.all_levers()), "cuda", memory=24 * GiB)
    L.refuse_too_long(L.long_config("Qwen/Qwen2.5-7B", 140000, L.all_levers()), "cuda", memory=24 * GiB)  # fits
    L.refuse_too_long(L.long_config("Qwen/Qwen2.5-7B", 35000), "cuda", memory=24 * GiB)  # a close call: the run's
    L.refuse_too_long(offload_fits, "cpu", memory=24 * GiB)  # the levers are for a CUDA card


def test_estimate_fit_seq_len_on_the_command_line(tmp_path):
    p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "estimate", "--preset", "sft-long-7b",
                        "--fit-seq-len", "24,80"], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    at = lines.index(next(x for x in lines if x.startswith("longest data.max_seq_len")))
    cfg = resolve(preset="sft-long-7b")
    assert lines[at + 1] == f"  24 GiB: {L.longest(cfg, 24 * GiB):,} tokens as set"
    assert L.longest(cfg, 24 * GiB) >= cfg.data.max_seq_len  # the preset fits the card it is meant for
    assert lines[at + 2].startswith("  80 GiB: ")
    bad = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "estimate", "--preset", "sft-long-7b", "--fit-seq-len", "x"],
                         capture_output=True, text=True, timeout=300)
    assert bad.returncode != 0 and len(bad.stderr.strip().splitlines()) == 1 and "--fit-seq-len" in bad.stderr


def test_the_72b_preset_fits_80_gb():
    cfg = resolve(preset="sft-long-72b")
    assert L.longest(cfg, 80 * GiB) >= cfg.data.max_seq_len


def test_the_model_tab_shows_the_longest_sequence():
    from edgetune.app import tab_model

    cfg = resolve(preset="sft-qlora-7b")
    text = tab_model.estimate_text(cfg)
    as_set = L.longest(cfg, 24 * GiB)
    every = L.longest(L._with(cfg, L.lever_settings(cfg)[-1][1]), 24 * GiB)
    assert f"- 24 GiB: {as_set:,} tokens as set; with model.offload_activations=true + " in text
    assert text.splitlines()[-3].endswith(f": {every:,}") and every > 4 * as_set
    assert "Longest" not in tab_model.estimate_text(resolve(preset="fgrpo-quickstart"))  # no levers in its step
