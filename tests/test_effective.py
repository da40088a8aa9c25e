"""Every `auto` setting is decided once (engine/planning/effective.py): the planner (what the app
shows before Start) and the engine (what a run does, recorded in its config.yaml) agree."""

import importlib.util
from types import SimpleNamespace

import pytest
import yaml

from edgetune.engine.core import settings
from edgetune.engine.core.arch import KNOWN_CONFIGS, arch_from_config, arch_of, read_model_config

from edgetune.engine.planning import effective, planner

GiB = 2**30
LIGER = importlib.util.find_spec("liger_kernel") is not None
MODELS = {"0.5B": "Qwen/Qwen2.5-0.5B", "7B": "Qwen/Qwen2.5-7B", "72B": "Qwen/Qwen2.5-72B"}
METHODS = {
    "sft": ["method=sft"],
    "sft packed": ["method=sft", "sft.packing=true"],
    "sft 8-bit, no SEBP": ["method=sft", "sft.optimizer=paged_adamw_8bit", "sft.sebp=off"],
    "sft auto checkpointing": ["method=sft", "model.gradient_checkpointing=auto", "sft.batch_size=8",
                               "data.max_seq_len=2048"],
    "fgrpo": ["method=fgrpo"],
    "essa sequential": ["method=essa", "essa.warm_start=/w", "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]"],
    "sft SEBP on": ["method=sft", "sft.sebp=on"],
    "sft fused LoRA off": ["method=sft", "sft.fused_lora=off"],
    "essa batched": ["method=essa", "essa.warm_start=/w", "essa.evaluation=batched", "essa.population=32",
                     "essa.prompts_per_generation=16", "data.max_seq_len=128",
                     "lora.target_modules=[q_proj, k_proj, v_proj, o_proj]"],
}

# What each configuration decides (device, model-independent part); K is checked separately.
EXPECTED = {
    ("cpu", "sft"): dict(dtype="fp32", autocast=False, attn_implementation="sdpa", liger=False, sebp=False,
                         optimizer="adamw", fused_optimizer=False, packing=False, fused_lora=False, nf4_kernel="off"),
    ("cuda", "sft"): dict(dtype="bf16", autocast=True, attn_implementation="sdpa", liger=LIGER, sebp=False,
                          optimizer="adamw", fused_optimizer=True, packing=False, fused_lora=True, nf4_kernel="auto"),
    ("cuda", "sft fused LoRA off"): dict(fused_lora=False),  # auto is on with CUDA; asking for off is honoured
    ("cpu", "sft packed"): dict(attn_implementation="sdpa", packing=True),
    ("cuda", "sft packed"): dict(attn_implementation="flex_attention", packing=True, liger=LIGER),
    ("cpu", "sft 8-bit, no SEBP"): dict(optimizer="paged_adamw_8bit", fused_optimizer=False, sebp=False),
    ("cuda", "sft 8-bit, no SEBP"): dict(optimizer="paged_adamw_8bit", fused_optimizer=False, sebp=False),
    ("cuda", "sft SEBP on"): dict(sebp=True),  # auto is off; asking for it is honoured
    ("cpu", "fgrpo"): dict(dtype="fp32", sebp=False, liger=False, optimizer="adamw"),
    ("cuda", "fgrpo"): dict(dtype="bf16", sebp=False, liger=False, optimizer="adamw", fused_optimizer=True,
                            fused_lora=False),  # an SFT lever
    ("cpu", "essa sequential"): dict(candidates_per_batch=1, optimizer="none", sebp=False),
    ("cuda", "essa sequential"): dict(candidates_per_batch=1, dtype="bf16", liger=False),
    ("cpu", "essa batched"): dict(candidates_per_batch=32),  # the whole population on a CPU
}


def _engine_arch(hub_id: str):
    """The engine's way to the shape: a transformers config object (what a loaded model
    carries), read through engine/core/arch.arch_of."""
    from transformers import AutoConfig

    cfg = AutoConfig.for_model(**KNOWN_CONFIGS[hub_id])
    return arch_of(SimpleNamespace(config=cfg))


@pytest.mark.parametrize("device", ["cpu", "cuda"])
@pytest.mark.parametrize("size", sorted(MODELS))
@pytest.mark.parametrize("method", sorted(METHODS))
def test_planner_and_engine_decide_the_same(device, size, method):
    cfg = settings.resolve(overrides=[f"model.name={MODELS[size]}", f"model.device={device}", *METHODS[method]])
    free = 60 * GiB
    plan = planner.estimate(cfg, gpu_total=80 * GiB, gpu_free=free, device=device, detect_gpu=False)
    ctx, _ = planner.make_ctx(cfg, device, "auto")
    # the engine measures the free memory once its model is loaded; the planner predicts it
    after_load = planner.essa_free_after_load(ctx, free) if device == "cuda" else None
    # the layers the engine checkpoints are chosen before the weights load (engine/models/model.checkpointing_for)
    split = planner.checkpoint_split(cfg, device=device, gpu_free=free)["checkpointed"]
    engine = effective.decide(cfg, device, _engine_arch(MODELS[size]), gpu_free=after_load, checkpointed=split)
    assert plan["effective"] == engine.to_dict()
    for key, value in EXPECTED.get((device, method), {}).items():
        assert plan["effective"][key] == value, (key, plan["effective"])
    if method.startswith("essa"):
        assert plan["candidates_per_batch"] == engine.candidates_per_batch
    layers = _engine_arch(MODELS[size]).layers
    if method.startswith("essa"):
        assert engine.checkpointed_layers == 0  # no backward in the search
    elif method != "sft auto checkpointing" or device == "cpu":
        assert engine.checkpointed_layers == layers  # true, or auto with no budget known: all
    else:
        assert plan["effective"]["checkpointed_layers"] == plan["model"]["checkpointed_layers"]
        assert 0 <= engine.checkpointed_layers <= layers


def test_batched_essa_on_a_card_takes_what_half_the_free_memory_holds():
    cfg = settings.resolve(overrides=["model.name=Qwen/Qwen2.5-7B", "model.device=cuda", *METHODS["essa batched"]])
    arch = _engine_arch("Qwen/Qwen2.5-7B")
    per = effective.essa_candidate_bytes(cfg, arch, "bf16")
    for free, k in ((0, 1), (2 * per, 1), (10 * per, 5), (1000 * per, 32)):
        assert effective.decide(cfg, "cuda", arch, gpu_free=free).candidates_per_batch == k
    # shorter prompts than data.max_seq_len (the engine knows them from the data): more fit
    assert effective.essa_candidate_bytes(cfg, arch, "bf16", prompt_tokens=32) < per
    cfg.essa.candidates_per_batch = 64  # asked: at most the population
    assert effective.decide(cfg, "cuda", arch, gpu_free=0).candidates_per_batch == 32


def test_rollout_copies_stay_inside_the_runs_memory_budget():
    # the opportunistic bf16 copy of the base reads free memory, capped by the budget when set
    assert effective.copy_budget(settings.resolve(overrides=["method=fgrpo"])) is None
    cfg = settings.resolve(overrides=["method=essa", "model.memory_budget_gib=24"])
    assert effective.copy_budget(cfg) == 24 * 2**30


def test_a_run_records_what_it_decided_and_reads_back(tiny_model_dir, tmp_path):
    from inline_run import run_inline

    from edgetune.engine.methods.sft import sft

    cfg = settings.from_dict({
        "method": "sft", "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "data": {"path": "embedded:arith-sft", "max_rows": 16, "max_seq_len": 64},
        "run": {"runs_dir": str(tmp_path), "checkpoint_every": 0},
        "sft": {"steps": 1, "batch_size": 2, "eval_every": 0, "sebp": "auto", "optimizer": "auto"}})
    run, _, events = run_inline(sft.train, cfg, tmp_path / "r")
    assert events[-1]["type"] == "finished"
    written = yaml.safe_load(run.config_path.read_text())
    arch = arch_from_config(read_model_config(str(tiny_model_dir)))
    assert written["effective"] == effective.decide(cfg, "cpu", arch).to_dict()
    assert written["sft"]["sebp"] == "auto" and written["effective"]["sebp"] is False
    assert written["effective"]["checkpointed_layers"] == 0  # model.gradient_checkpointing false
    # the record is not a setting: the file resolves back to the same settings
    assert settings.from_dict(written).to_dict() == cfg.to_dict()
    assert settings.resolve(config=run.config_path).to_dict() == cfg.to_dict()


def test_a_family_without_sdpa_gets_eager_attention_and_liger_off_names_why():
    from edgetune.engine.core.arch import Arch

    assert effective.attention("auto", False, "cuda", "gemma2") == "eager"
    assert effective.attention("auto", True, "cuda", "gemma2") == "flex_attention"  # flex soft-caps
    assert effective.attention("auto", False, "cpu", "llama") == "sdpa"
    assert effective.attention("sdpa", False, "cpu", "gemma2") == "sdpa"  # asked for: honoured
    gemma = Arch(hidden=64, intermediate=128, layers=2, heads=4, kv_heads=2, head_dim=16, vocab=100, tied=True,
                 model_type="gemma2")
    assert "'gemma2' is not one whose RMSNorm + SwiGLU it patches" in effective.liger_off_reason(
        "auto", "cuda", "sft", gemma)
    assert effective.liger_off_reason("auto", "cpu", "sft", gemma) == "the run is on cpu, not CUDA"
    assert effective.liger_off_reason("auto", "cuda", "fgrpo", gemma) == "Liger is used in SFT only, not F-GRPO"
