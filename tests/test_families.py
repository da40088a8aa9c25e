"""Every model family people bring (bench/support_table.py lists them): a tiny random-init
model of each, built offline from transformers' config class with the embedded model's
tokenizer, and the embedded SmolLM2 itself.

Fast, per family: one SFT step, the run's adapter exported, reloaded with plain
`peft.PeftModel.from_pretrained` on the base with the same logits (to 1e-5) as the engine's
own model with that adapter, packed rows equal to rows one at a time, and the planner's plan of it
deciding what the run decided. Slow, per family: two F-GRPO steps, two ESSA generations
from the SFT adapter and two DPO steps. And docs/support.md equals what bench/support_table.py writes now."""

import json
from types import SimpleNamespace

import pytest
import torch
from bench_script import load
from inline_run import run_inline

from edgetune.engine.core.settings import resolve

from edgetune.engine.planning import planner

from edgetune.engine.models import export
from edgetune.engine.models import model as model_lib

from edgetune.engine.methods.dpo import dpo
from edgetune.engine.methods.essa import essa
from edgetune.engine.methods.fgrpo import fgrpo
from edgetune.engine.methods.sft import sft

support = load("support_table")
FAMILIES = [*support.FAMILIES, support.EMBEDDED]
REWARD_PY = "def reward(completion, answer, row):\n    return (sum(map(ord, completion)) % 7) / 6\n"


@pytest.fixture(scope="module")
def family_root(tmp_path_factory):
    """A folder with rl.jsonl and reward.py (and the runs trained below)."""
    root = tmp_path_factory.mktemp("families")
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (root / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD_PY)
    return root


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    """{family: model folder}: the tiny models (bench/support_table.folders) and the embedded one."""
    return support.folders(tmp_path_factory.mktemp("family-models"))


_TRAINED = {}


def trained(family, root, folders):
    """(model folder, SFT run folder, settings) of `family`, trained one SFT step once per process."""
    if family not in _TRAINED:
        model_dir = folders[family]
        cfg = support.sft_settings(model_dir, root / "runs")
        run, _, events = run_inline(sft.train, cfg, root / "runs" / f"sft-{family}")
        assert events[-1]["type"] == "finished", events[-1]
        _TRAINED[family] = (model_dir, run.path, cfg)
    return _TRAINED[family]


@pytest.mark.parametrize("family", FAMILIES)
def test_sft_export_reload_and_plan(family, family_root, family_dirs, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    model_dir, run_path, cfg = trained(family, family_root, family_dirs)
    out = export.export(run_path, tmp_path / "exported")
    ids = torch.tensor([[5, 17, 300, 41, 9, 2000, 77]])

    # The engine's own model with the exported adapter (the loader an adapter is trained on from).
    engine_cfg = resolve(overrides={**cfg.to_dict(), "lora": {"r": 4, "alpha": 8, "init_from": str(out)}})
    engine_model, _, _ = model_lib.load(engine_cfg)
    plain = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model_dir), out).eval()
    with torch.no_grad():
        want = engine_model.eval()(input_ids=ids).logits
        got = plain(input_ids=ids).logits
        with plain.disable_adapter():
            base = plain(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()
    assert (got - base).abs().max() > 1e-4  # the step changed the adapter: the comparison means something

    # Packed rows (engine/data/packing.py) give each row's own logits with the family's attention
    # (up to fp32 rounding: 3e-7 on the tiny models, 8e-4 of logits near 20 over SmolLM2's 30 layers).
    from edgetune.engine.data.packing import collate_packed

    rows = [SimpleNamespace(input_ids=list(range(5, 12)), labels=list(range(5, 12))),
            SimpleNamespace(input_ids=list(range(20, 25)), labels=list(range(20, 25)))]
    packed = collate_packed(rows)
    with torch.no_grad():
        together = plain(input_ids=packed["input_ids"], position_ids=packed["position_ids"],
                         use_cache=False).logits[0]
        apart = torch.cat([plain(input_ids=torch.tensor([r.input_ids]), use_cache=False).logits[0] for r in rows])
    assert torch.allclose(together, apart, rtol=1e-4, atol=2e-3), (together - apart).abs().max()

    # The planner plans it, and decides on the CPU what the run decided (its config.yaml).
    import yaml

    plan = planner.estimate(cfg, device="cpu", detect_gpu=False)
    assert plan["total"] > 0 and plan["model"]["type"] == engine_model.get_base_model().config.model_type
    ran = yaml.safe_load((run_path / "config.yaml").read_text())["effective"]
    for key in ("dtype", "attn_implementation", "liger", "sebp", "packing", "optimizer"):
        assert plan["effective"][key] == ran[key], key


@pytest.mark.slow
@pytest.mark.parametrize("family", FAMILIES)
def test_fgrpo_essa_and_dpo(family, family_root, family_dirs, tmp_path):
    model_dir, run_path, _ = trained(family, family_root, family_dirs)
    common = {"model": {"name": str(model_dir), "quant": "none", "gradient_checkpointing": False},
              "lora": {"r": 4, "alpha": 8}, "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
              "data": {"path": str(family_root / "rl.jsonl"), "eval_fraction": 0}}
    reward = {"reward": "file", "reward_file": str(family_root / "reward.py"), "max_new_tokens": 4,
              "eval_prompts": 0}
    cfg = resolve(overrides={**common, "method": "fgrpo", "fgrpo": {
        "num_generations": 2, "prompts_per_step": 2, "steps": 2, "micro_batch_size": 4, **reward}})
    _, _, events = run_inline(fgrpo.train, cfg, tmp_path / "fgrpo")
    assert events[-1]["type"] == "finished" and [e["step"] for e in events if e["type"] == "step"] == [1, 2]
    assert (tmp_path / "fgrpo" / "adapter" / "adapter_config.json").is_file()

    cfg = resolve(overrides={**common, "method": "essa", "essa": {
        "warm_start": str(run_path / "adapter"), "population": 4, "generations": 2, "prompts_per_generation": 2,
        "eval_every": 0, **reward}})
    _, _, events = run_inline(essa.train, cfg, tmp_path / "essa")
    assert events[-1]["type"] == "finished" and [e["step"] for e in events if e["type"] == "step"] == [1, 2]
    assert (tmp_path / "essa" / "adapter" / "adapter_config.json").is_file()

    cfg = resolve(overrides={**common, "method": "dpo", "data": {"path": "embedded:arith-pairs", "max_rows": 8,
                                                                  "max_seq_len": 64},
                             "dpo": {"steps": 2, "batch_size": 2, "eval_every": 0, "samples": 0}})
    _, _, events = run_inline(dpo.train, cfg, tmp_path / "dpo")
    steps = [e for e in events if e["type"] == "step"]
    assert events[-1]["type"] == "finished" and [e["step"] for e in steps] == [1, 2]
    assert all(e["loss"] == e["loss"] for e in steps) and (tmp_path / "dpo" / "adapter" / "adapter_config.json").is_file()


def test_support_page_is_what_the_script_writes(family_dirs):
    assert list(family_dirs) == FAMILIES  # the page's rows are the families the tests above run
    assert support.OUT.read_text() == support.table(family_dirs), "run: python bench/support_table.py"
