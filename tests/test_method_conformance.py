"""Every method's record (engine/core/methods.py) run through every part that reads it: a
preset's config, the planner on 1 and 2 GPUs, a far-beyond refusal, the out-of-memory advice,
the data loader, the worker's dispatch, the app's form and plots, and a 1-step run on the
tiny model exported. A record made here (a copy of SFT under another name, with a settings
group of its own) passes with no other file touched; a record with any field left empty
fails."""

import dataclasses
import importlib
import inspect
import math
import sys

import pytest
from inline_run import run_inline

from edgetune.engine.core import distributed as dist
from edgetune.engine.core import settings as S
from edgetune.engine.core.config_files import list_presets
from edgetune.engine.core.errors import ConfigError
from edgetune.engine.core.methods import FIELDS, METHODS

from edgetune.engine.planning import oom, planner

from edgetune.engine.models.export import export
from edgetune.engine.models.model import load_tokenizer

from edgetune.engine.training.loop import step_rows

from edgetune.engine.run import worker

from edgetune.app import form, live
from edgetune.engine import data as data_lib

GiB = 2**30
ORIGINAL = tuple(METHODS)  # the shipped records, before a test registers another


def _get(cfg, key: str):
    group, name = key.split(".")
    return getattr(getattr(cfg, group), name)


def _set(cfg, key: str, value) -> None:
    group, name = key.split(".")
    setattr(getattr(cfg, group), name, value)


def register(monkeypatch, source: str, name: str, **changes):
    """A copy of record `source` named `name`, with a settings group `name` of its own (the
    source's settings type): registered for this test only."""
    base = METHODS[source]

    def own(key: str) -> str:
        return f"{name}.{key.split('.', 1)[1]}" if key.startswith(f"{source}.") else key

    levers = tuple(dataclasses.replace(lv, setting=own(lv.setting), zero_means=tuple(map(own, lv.zero_means)))
                   for lv in base.oom_levers)
    record = dataclasses.replace(
        base, name=name, label=f"{base.label} copy", shape=tuple(map(own, base.shape)), oom_levers=levers,
        batch=own(base.batch), per_rank=own(base.per_rank), accumulate=own(base.accumulate),
        rollout_batch=own(base.rollout_batch))
    record = dataclasses.replace(record, **changes)
    group = type(getattr(S.Config(), source))
    config = dataclasses.make_dataclass(
        "Config", [(name, group, dataclasses.field(default_factory=group))], bases=(S.Config,))
    plain = S.Config
    for module in [m for n, m in sys.modules.items() if n == S.__name__ or n.startswith(S.__name__ + ".")]:
        if getattr(module, "Config", None) is plain:  # the settings modules that build a Config
            monkeypatch.setattr(module, "Config", config)
    monkeypatch.setitem(METHODS, name, record)
    return record


def preset_config(record, **over) -> S.Config:
    """A preset of the method on the embedded model and data, resolved; a record without
    presets of its own runs one of a record with the same loop, as itself."""
    presets = {p: S.resolve(preset=p) for p in list_presets()}
    embedded = [p for p, c in presets.items() if c.model.name.startswith("embedded:")
                and c.data.path.startswith("embedded:")]
    own = [p for p in embedded if presets[p].method == record.name]
    shared = [p for p in embedded if METHODS[presets[p].method].module == record.module]
    return S.resolve(preset=(own or shared)[0], overrides={"method": record.name, **over})


# --------------------------------------------------------------------------- the checks


def check_fields(record) -> None:
    """What the screens show and the record's settings exist in its config."""
    for f in ("label", "title", "description", "unit", "length", "data", "module", "memory", "batch"):
        assert getattr(record, f), f"{record.name}: {f} is empty"
    assert record.shape and record.oom_levers and record.basic and record.plots and record.headline, record.name
    cfg = preset_config(record)
    for key in record.settings():
        group, field = key.split(".")
        assert hasattr(getattr(cfg, group), field), f"{record.name}: no setting {key}"
    group = getattr(cfg, record.name)
    assert hasattr(group, "packing") == record.packing, "packing"
    assert (hasattr(group, "reward") and hasattr(group, "reward_file")) == record.rewards, "rewards"
    assert hasattr(group, "population") == record.population, "population"
    assert hasattr(group, "sample_every") == record.samples, "samples"
    assert hasattr(group, "warm_start") == bool(record.warm_start), "warm_start"
    if record.warm_start:
        assert METHODS[record.warm_start].gradients, "a warm start trains an adapter"
    assert isinstance(group.grading(), S.GradingSettings)  # how its runs are graded


def check_dispatch(record):
    """The worker finds the loop; what the loop does is what the record says."""
    module = worker.method_module(record.name)
    assert module.__name__ == record.module and callable(module.train)
    source = inspect.getsource(module)
    assert ("models import fsdp" in source) == (not record.fsdp), "fsdp: the loop shards iff the record says so"
    assert ("models.offload" in source) == record.offload, "offload"
    assert ("schedule_steps" in source) == (not record.more_steps), "more_steps: a loop that trains further"
    return module


def check_estimate(record, module) -> None:
    """Planned on 1 and 2 GPUs: a rank plans the rows its loop gives it (fewer than one
    process takes, for a loop that splits its step's rows across the ranks)."""
    for steps in (1, 2):  # micro-batches a step accumulates, where the method's group has them
        cfg = preset_config(record)
        group = getattr(cfg, record.name)
        if hasattr(group, "grad_accum"):
            group.grad_accum = steps
        if record.per_rank:
            _set(cfg, record.per_rank, 8)
        if record.warm_start:  # an adapter given: its own step is planned, not the warm-start run's
            group.warm_start = "adapter"
        plans = {g: planner.estimate(cfg, gpu_total=80 * GiB, device="cuda", detect_gpu=False, gpus=g)
                 for g in (1, 2)}
        for g, plan in plans.items():
            assert plan["gpus"] == g and plan["total"] == sum(plan[k] for k in plan["parts"]) > 0
            assert plan["fits"] is True, plan["verdict"]
            assert (plan["optimizer"] > 0) == record.gradients, "gradients"
            assert (plan["kv_cache"] > 0 or "rollout_kv_cache" in plan) == record.rollouts, "rollouts"
        assert plans[2]["total"] != plans[1]["total"]
        rank = planner.per_rank(cfg, 2)
        if getattr(module, "step_rows", None) is step_rows:  # the loop splits a step's rows across the ranks
            dist._STATE.update(rank=0, world=2)
            try:
                mine = step_rows(1000, _get(cfg, record.batch), getattr(group, "grad_accum", 1), 0, 0)
            finally:
                dist._STATE.update(rank=0, world=1)
            assert _get(rank, record.batch) == max(len(m) for m in mine), "per_rank / accumulate"
            if steps == 1:  # the per-rank batch shrinks
                assert _get(rank, record.batch) < _get(cfg, record.batch), "per_rank"
                assert plans[2]["activations"] < plans[1]["activations"]
        if record.rollout_batch:  # whole groups of prompts per rank
            assert _get(rank, record.rollout_batch) == len(dist.shard(_get(cfg, record.rollout_batch), 0, 2))


def check_refusal(record) -> None:
    """A step far beyond the machine is refused in one line that names what drives it."""
    cfg = preset_config(record)
    for key in record.shape:
        value = _get(cfg, key)
        if isinstance(value, int) and value > 0:
            _set(cfg, key, value * 64)
    with pytest.raises(ConfigError) as e:
        planner.refuse_far_beyond(cfg, "cpu", memory=GiB // 4)
    text = str(e.value)
    assert "\n" not in text and text.startswith("the planner predicts"), text
    assert any(f"{key}=" in text for key in record.shape), text


def check_advice(record) -> None:
    """The out-of-memory advice names one of the record's levers, checkpointing on or off."""
    levers = [lv.setting for lv in record.oom_levers]
    for checkpointing in (True, False):
        cfg = preset_config(record, model={"gradient_checkpointing": checkpointing})
        for lv in record.oom_levers:
            if lv.to is None and not lv.zero_means:
                _set(cfg, lv.setting, max(_get(cfg, lv.setting), 4 * lv.floor))
        text = oom.advice(cfg, 2, None)
        assert "\n" not in text and text.startswith("out of GPU memory in step 3: set "), text
        assert text.split("set ")[1].split("=")[0] in levers, text
        if record.gradients and not checkpointing:
            assert "model.gradient_checkpointing" in text, text


def check_data(record, tokenizer) -> None:
    """The preset's (embedded) data loads as the record's kind of rows."""
    cfg = preset_config(record)
    loaded = data_lib.load_for(record.name, cfg.data, tokenizer, cfg.run.seed)
    kind = {"demonstrations": data_lib.SFTData, "pairs": data_lib.PairData, "prompts": data_lib.RLData}
    assert isinstance(loaded, kind[record.data]) and len(loaded.train) > 0


def check_form(record, tmp_path) -> None:
    """The app's form has the method's group, its basic settings first, and reads a config back."""
    specs = form.field_specs()
    mine = [s for s in specs if s.group == record.name]
    assert {s.name for s in mine if s.basic} == set(record.basic)
    cfg = preset_config(record, run={"runs_dir": str(tmp_path)})
    back = form.config_from_values(record.name, form.values_from_config(cfg, specs), specs, str(tmp_path))
    assert back.to_dict() == cfg.to_dict()


SMALL = {"num_generations": 2, "max_new_tokens": 4, "population": 3, "prompts_per_generation": 2,
         "warm_start_steps": 1, "eval_every": 0, "eval_prompts": 0, "samples": 0, "sample_every": 0, "eval_k": 0,
         "evaluation": "sequential", "grad_accum": 1}


def check_run_and_export(record, tiny_model_dir, tmp_path) -> None:
    """A 1-step run on the tiny model: its events draw the app's plots and progress line, and
    its adapter exports with a model card naming the method."""
    cfg = preset_config(record, model={"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
                        lora={"r": 4, "alpha": 8},
                        data={"max_rows": 24, "max_seq_len": 64, "eval_fraction": 0.0},
                        run={"runs_dir": str(tmp_path), "checkpoint_every": 0, "seed": 0})
    _set(cfg, f"{record.name}.{record.length}", 1)
    _set(cfg, record.batch, 2)
    if record.rollout_batch:
        _set(cfg, record.rollout_batch, 1)
    group = getattr(cfg, record.name)
    for name, value in SMALL.items():
        if hasattr(group, name):
            setattr(group, name, value)
    if record.warm_start:
        _set(cfg, f"{record.warm_start}.batch_size", 2)
    S.validate(cfg)
    run, _, events = run_inline(worker.method_module(record.name).train, cfg, tmp_path / "run")
    assert events[-1]["type"] == "finished", events[-1]
    steps = [e for e in events if e["type"] == "step"]
    assert [e["step"] for e in steps] == [1] and record.total(cfg.to_dict()) == 1
    assert set(record.headline) <= set(steps[-1]), (record.headline, steps[-1])
    frames = live.plot_frames(events, record)
    assert len(frames) == len(record.plots) and len(frames[0]) > 0  # the first plot draws the step
    out = export(run.path, tmp_path / "export")
    assert (out / "adapter_config.json").is_file()
    assert f"**Method:** {record.label} ({record.title})" in (out / "README.md").read_text()


def conform(record, tiny_model_dir, tmp_path, run: bool = True) -> None:
    check_fields(record)
    module = check_dispatch(record)
    check_estimate(record, module)
    check_refusal(record)
    check_advice(record)
    check_data(record, load_tokenizer(str(tiny_model_dir)))
    check_form(record, tmp_path)
    if run:
        check_run_and_export(record, tiny_model_dir, tmp_path)


# --------------------------------------------------------------------------- the tests


@pytest.mark.parametrize("name", ORIGINAL)
def test_every_record_runs_through_every_part(name, tiny_model_dir, tmp_path):
    assert any(S.resolve(preset=p).method == name for p in list_presets()), f"{name}: no preset"
    conform(METHODS[name], tiny_model_dir, tmp_path)


def test_a_copy_of_sft_under_another_name_passes_with_no_other_file_touched(tiny_model_dir, tmp_path, monkeypatch):
    record = register(monkeypatch, "sft", "tuned")
    conform(record, tiny_model_dir, tmp_path)
    cfg = S.resolve(overrides=["method=tuned", "tuned.batch_size=16", "sft.batch_size=1"])
    assert planner.estimate(cfg, device="cpu", detect_gpu=False)["shape"].startswith("16 x")  # its own group


# A field left empty in a copy of the first shipped record where it is set: every one is
# caught by some part (the name is the record's key, so it is never empty).
PLANTED = [(source, f) for f in FIELDS if f != "name"
           for source in [next((n for n in ORIGINAL if getattr(METHODS[n], f)), None)] if source]


def test_every_field_is_planted_somewhere():
    assert {f for _, f in PLANTED} == set(FIELDS) - {"name"}


@pytest.mark.parametrize("source,field", PLANTED, ids=[f"{s}-{f}" for s, f in PLANTED])
def test_a_record_missing_a_field_fails(source, field, tiny_model_dir, tmp_path, monkeypatch):
    value = getattr(METHODS[source], field)
    empty = type(value)() if not isinstance(value, bool) else False
    record = register(monkeypatch, source, "planted")
    record = dataclasses.replace(record, **{field: empty})
    monkeypatch.setitem(METHODS, "planted", record)
    with pytest.raises(Exception):  # noqa: B017 - any part may be the one that fails
        conform(record, tiny_model_dir, tmp_path, run=False)


# --------------------------------------------------------------------------- the three DPO failures


def test_dpo_far_beyond_is_refused_in_one_line():
    cfg = S.resolve(preset="dpo-quickstart", overrides=["dpo.batch_size=60000"])
    with pytest.raises(ConfigError, match=r"^the planner predicts .* driven by dpo.batch_size=60000"):
        planner.refuse_far_beyond(cfg, "cpu", memory=GiB)


def test_dpo_out_of_memory_with_checkpointing_on_gets_the_advice_line():
    cfg = S.resolve(preset="dpo-quickstart", overrides=["model.gradient_checkpointing=true", "dpo.batch_size=8"])
    text = oom.advice(cfg, 4, 2)
    assert text.startswith("out of GPU memory in step 5: set ") and "dpo.batch_size" in text, text
    assert "\n" not in text and text.endswith("(edgetune estimate checks a setting before a run; checkpoints up to "
                                              "step 2 are kept)"), text


def test_dpo_on_two_gpus_splits_its_batch():
    cfg = S.resolve(preset="dpo-quickstart", overrides=["dpo.batch_size=8", "dpo.grad_accum=1"])
    one, two = (planner.estimate(cfg, gpu_total=80 * GiB, device="cuda", detect_gpu=False, gpus=g) for g in (1, 2))
    assert one["shape"].startswith("16 x") and two["shape"].startswith("8 x")
    assert planner.per_rank(cfg, 2).dpo.batch_size == math.ceil(8 / 2)


def test_no_method_imports_another_methods_folder():
    """ESSA's warm start reaches SFT through SFT's record, as the worker does."""
    import ast
    from pathlib import Path

    root = Path(importlib.import_module("edgetune.engine.methods").__file__).parent
    for name in ORIGINAL:
        for f in (root / name).glob("*.py"):
            for node in ast.walk(ast.parse(f.read_text())):
                if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("edgetune.engine.methods."):
                    assert node.module.split(".")[3] == name, (f, node.module)
