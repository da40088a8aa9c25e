"""One record per method (engine/core/methods.py): the worker, the planner, the OOM advice,
the CLI and the app all find a method's loop, unit and levers through it."""

from edgetune.engine.core import settings as S
from edgetune.engine.core.methods import METHODS

from edgetune.engine.planning import oom

from edgetune.engine.run import worker

from edgetune.app.methods import BY_KEY


def test_every_record_has_its_loop_its_settings_and_its_app_entry():
    assert S.METHODS == tuple(METHODS) == ("sft", "fgrpo", "essa", "dpo")
    for name, m in METHODS.items():
        module = worker.method_module(name)
        assert module.__name__ == f"edgetune.engine.methods.{name}.{name}" and callable(module.train)
        cfg = S.resolve(overrides=[f"method={name}"])
        assert m.total(cfg.to_dict()) == getattr(getattr(cfg, name), m.length) > 0
        for key in m.settings():
            group, field = key.split(".")
            assert hasattr(getattr(cfg, group), field), key
        assert BY_KEY[name] is m
    assert [m.unit for m in METHODS.values()] == ["step", "step", "generation", "step"]


def test_oom_advice_lowers_each_methods_levers_in_its_order():
    def levers(*sets):
        return oom._levers(S.resolve(overrides=list(sets)))

    assert levers("method=sft", "model.gradient_checkpointing=false", "sft.batch_size=4",
                  "data.max_seq_len=1024") == [("model.gradient_checkpointing", True), ("sft.batch_size", 2),
                                               ("data.max_seq_len", 512)]
    assert levers("method=sft", "model.gradient_checkpointing=true", "sft.batch_size=1", "data.max_seq_len=256") == []
    assert levers("method=fgrpo", "fgrpo.micro_batch_size=0", "fgrpo.prompts_per_step=4", "fgrpo.num_generations=8",
                  "model.gradient_checkpointing=true", "fgrpo.max_new_tokens=256") == [
        ("fgrpo.micro_batch_size", 16), ("fgrpo.max_new_tokens", 128)]
    assert levers("method=essa", "essa.evaluation=batched", "essa.max_new_tokens=32") == [
        ("essa.evaluation", "sequential")]


def test_every_record_names_a_memory_model_and_settings_that_exist():
    """The planner's memory models are keyed by what a record's `memory` names (several
    methods may share one), never by a method; every setting a record names exists."""
    from edgetune.engine.planning import planner

    assert {m.memory for m in METHODS.values()} == set(planner.PLANS)
    for name, m in METHODS.items():
        cfg = S.resolve(overrides=[f"method={name}"])
        for path in filter(None, (m.batch, m.rollout_batch)):
            group, field = path.split(".")
            assert isinstance(getattr(getattr(cfg, group), field), int), path
        group = getattr(cfg, name)
        assert hasattr(group, "packing") == m.packing
        assert (hasattr(group, "reward") and hasattr(group, "reward_file")) == m.rewards
        assert hasattr(group, "population") == m.population
