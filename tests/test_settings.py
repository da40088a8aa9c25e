"""Settings: presets, overrides, and one-line errors for bad values."""

import pytest

from edgetune.engine.core import settings
from edgetune.engine.core.config_files import list_presets
from edgetune.engine.core.errors import ConfigError

DECLARED = settings.declared()
CHOICES = {k: f.metadata["choices"] for k, f in DECLARED.items() if f.metadata["choices"]}
RANGES = {k: f.metadata["range"] for k, f in DECLARED.items() if f.metadata["range"]}


def test_every_preset_resolves_and_says_how_to_run_it():
    presets = list_presets()
    assert "sft-quickstart" in presets and "sft-qlora-7b" in presets
    for name, path in presets.items():
        cfg = settings.resolve(preset=name)
        header = path.read_text().splitlines()[:8]
        assert header[0].startswith("#"), name
        assert any(f"--preset {name}" in line for line in header), f"{name}: header lacks its command"
        assert cfg.method in settings.METHODS


def test_overrides_are_typed_and_nested():
    cfg = settings.resolve(preset="sft-quickstart", overrides=["lora.r=32", "sft.lr=5e-4",
                                                                "lora.target_modules=[q_proj, v_proj]",
                                                                "model.gradient_checkpointing=true"])
    assert cfg.lora.r == 32 and isinstance(cfg.lora.r, int)
    assert cfg.sft.lr == 5e-4
    assert cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.model.gradient_checkpointing is True
    # a bare on/off is a YAML boolean; a word-valued setting still gets the word
    for word in ("on", "off", "auto"):
        assert settings.resolve(overrides=[f"model.liger={word}"]).model.liger == word


def test_round_trip_through_yaml(tmp_path):
    cfg = settings.resolve(preset="sft-quickstart", overrides=["sft.steps=7"])
    p = tmp_path / "c.yaml"
    p.write_text(cfg.to_yaml())
    again = settings.resolve(config=p)
    assert again == cfg


@pytest.mark.parametrize("override, needle", [
    ("lora.rank=8", "unknown setting 'lora.rank' (did you mean 'r'?)"),
    ("sft.learning_rate=1e-4", "unknown setting 'sft.learning_rate'"),
    ("sft.lr=-1e-4", "sft.lr must be positive and at most 1, got -0.0001"),
    ("sft.lr=0", "sft.lr must be positive"),
    ("sft.steps=0", "sft.steps must be in [1, 10000000], got 0"),
    ("sft.steps=2.5", "sft.steps: expected an integer"),
    ("model.quant=nf8", "model.quant: 'nf8' is not one of nf4, int8, none"),
    ("method=kto", "unknown method 'kto'"),
    ("modle.name=x", "unknown setting 'modle' (did you mean 'model'?)"),
])
def test_bad_settings_say_which_and_why(override, needle):
    with pytest.raises(ConfigError) as e:
        settings.resolve(preset="sft-quickstart", overrides=[override])
    assert needle in str(e.value)
    assert "\n" not in str(e.value)


def test_unknown_preset_and_missing_file():
    with pytest.raises(ConfigError, match="unknown preset 'sft-quickstrat' \\(did you mean 'sft-quickstart'"):
        settings.resolve(preset="sft-quickstrat")
    with pytest.raises(ConfigError, match="config file not found: nope.yaml"):
        settings.resolve(config="nope.yaml")


# --------------------------------------------------------------------------- the declarations


def _bad_number(rng: settings.Range) -> float:
    """A value just outside the range."""
    if rng.low is not None:
        return rng.low if rng.low_open else rng.low - 1
    return rng.high + 1


@pytest.mark.parametrize("key", sorted(CHOICES))
def test_each_enumerated_setting_rejects_a_bad_word_in_one_line(key):
    group, name = key.split(".")
    with pytest.raises(ConfigError) as e:
        settings.resolve(overrides={group: {name: "not-a-choice"}})
    msg = str(e.value)
    assert msg.startswith(f"{key}: 'not-a-choice' is not one of ") and "\n" not in msg
    assert all(word in msg for word in CHOICES[key])


@pytest.mark.parametrize("key", sorted(RANGES))
def test_each_numeric_setting_rejects_a_value_outside_its_range(key):
    group, name = key.split(".")
    rng = RANGES[key]
    bad = _bad_number(rng)
    typ = settings.field_types(type(getattr(settings.Config(), group)))[name]
    with pytest.raises(ConfigError) as e:
        settings.resolve(overrides={group: {name: typ(bad)}})
    msg = str(e.value)
    assert msg.startswith(f"{key} must be ") and "\n" not in msg, msg
    # the bound itself, or the next value inside, is accepted
    good = rng.low if rng.low is not None and not rng.low_open else (rng.low or 0) + (1 if typ is int else 0.5)
    assert getattr(getattr(settings.resolve(overrides={group: {name: typ(good)}}), group), name) == typ(good)


@pytest.mark.parametrize("override, needle", [
    ("sft.optimizer=adamw8bit", "sft.optimizer: 'adamw8bit' is not one of auto, adamw, adamw_8bit, "
                                "paged_adamw_8bit (did you mean 'adamw_8bit'?)"),
    ("sft.sebp=maybe", "sft.sebp: 'maybe' is not one of auto, on, off"),
    ("fgrpo.reward=lastnumber", "fgrpo.reward: unknown reward 'lastnumber' (did you mean 'last_number'?)"),
    ("essa.reward={exact: 1, mth: 1}", "essa.reward: unknown reward 'mth' (did you mean 'math'?)"),
    ("model.device=cuda0", "model.device: 'cuda0' is not one of auto, cpu, cuda, cuda:0 (did you mean 'cuda:0'?)"),
    ("fgrpo.top_p=1.5", "fgrpo.top_p must be in (0, 1], got 1.5 (nearest allowed: 1)"),
    ("fgrpo.num_generations=1", "fgrpo.num_generations must be in [2, 1024], got 1 (nearest allowed: 2)"),
    ("lora.dropout=1", "lora.dropout must be in [0, 1), got 1.0"),
])
def test_bad_values_name_the_key_and_the_nearest_choice(override, needle):
    with pytest.raises(ConfigError) as e:
        settings.resolve(preset="sft-quickstart", overrides=[override])
    assert str(e.value) == needle


def test_every_setting_is_declared_with_help_and_checked():
    for group in ("model", "lora", "data", "run", "sft", "fgrpo", "essa"):
        cls = type(getattr(settings.Config(), group))
        for f in settings.dataclasses.fields(cls):
            key = f"{group}.{f.name}"
            assert f.metadata.get("help"), f"{key} has no help text"
            typ = settings.field_types(cls)[f.name]
            if typ in (int, float) and key != "essa.temperature":  # positive only when sampling
                assert key in RANGES, f"{key} has no range"
            if key in CHOICES:
                assert f.default in CHOICES[key], key
            if key in RANGES:
                assert RANGES[key].allows(f.default), key


def test_sebp_reads_old_spellings_as_words():
    for value, word in ((None, "auto"), (True, "on"), (False, "off"), ("on", "on")):
        cfg = settings.resolve(overrides={"sft": {"sebp": value}, "fgrpo": {"sebp": value}})
        assert cfg.sft.sebp == cfg.fgrpo.sebp == word


def test_reward_names_are_the_ones_rewards_implements():
    from edgetune.engine.training import rewards

    assert sorted(rewards.KNOWN) == sorted(settings.REWARD_NAMES)
    for name in ("math", "length_penalty:200", "rg:basic_arithmetic", "file"):
        settings.resolve(overrides={"fgrpo": {"reward": name}})


# --------------------------------------------------------------------------- numbers that break a run

FLOATS = sorted(k for k, f in DECLARED.items()
                if settings.field_types(type(getattr(settings.Config(), k.split(".")[0])))[f.name] is float)


@pytest.mark.parametrize("key", FLOATS)
def test_every_float_setting_refuses_inf_and_nan(key):
    assert len(FLOATS) > 15
    for text, shown in (("inf", "inf"), (".inf", "inf"), ("-inf", "-inf"), ("nan", "nan"), ("1e999", "inf")):
        with pytest.raises(ConfigError) as e:
            settings.resolve(overrides=[f"{key}={text}"])
        assert str(e.value) == f"{key} must be a finite number, got {shown}"
    group, name = key.split(".")
    with pytest.raises(ConfigError, match=f"^{key} must be a finite number, got nan$"):
        settings.resolve(overrides={group: {name: float("nan")}})  # the app's widgets hand floats over


@pytest.mark.parametrize("override, message", [
    ("sft.lr=1e308", "sft.lr must be positive and at most 1, got 1e+308 (nearest allowed: 1)"),
    ("fgrpo.lr=2", "fgrpo.lr must be positive and at most 1, got 2.0 (nearest allowed: 1)"),
    ("lora.alpha=1e300", "lora.alpha must be in (0, 4096], got 1.000e+300 (nearest allowed: 4096)"),
    ("lora.alpha=nan", "lora.alpha: expected an integer, got 'nan'"),
    ("lora.alpha=inf", "lora.alpha: expected an integer, got 'inf'"),
    ("lora.alpha=.inf", "lora.alpha: expected an integer, got inf"),
    ("run.seed=1180591620717411303424", "run.seed must be in [0, 4294967294], got 1.180e+21 "
                                        "(nearest allowed: 4294967294)"),
    ("fgrpo.success_threshold=.nan", "fgrpo.success_threshold must be a finite number, got nan"),
    ("fgrpo.reward={math: .inf}", "fgrpo.reward.math must be a finite number, got inf"),
    ("sft.weight_decay=1" + "0" * 400, "sft.weight_decay must be a finite number, got 1.000e+400"),
])
def test_numbers_that_would_break_a_run_are_refused_in_one_line(override, message):
    with pytest.raises(ConfigError) as e:
        settings.resolve(overrides=[override])
    assert str(e.value) == message


def test_the_largest_seed_is_one_every_consumer_takes():
    import numpy as np

    from edgetune.engine.training.loop import seed_everything

    from edgetune.engine.methods.essa.essa import make_es

    top = settings.resolve(overrides=["run.seed=4294967294"]).run.seed
    seed_everything(top)
    np.random.seed(top + 1)  # CMA-ES is handed seed + 1 (engine/methods/essa/essa.py)
    make_es(4, settings.ESSASettings(population=4), top)
    with pytest.raises(ConfigError, match="run.seed must be in"):
        settings.resolve(overrides=[f"run.seed={top + 1}"])
