"""Settings: presets, overrides, and one-line errors for bad values."""

import pytest

from edgetune.engine import settings
from edgetune.engine.errors import ConfigError


def test_every_preset_resolves_and_says_how_to_run_it():
    presets = settings.list_presets()
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
    ("sft.lr=-1e-4", "sft.lr must be positive"),
    ("sft.lr=0", "sft.lr must be positive"),
    ("sft.steps=0", "sft.steps must be positive"),
    ("sft.steps=2.5", "sft.steps: expected an integer"),
    ("model.quant=nf8", "model.quant: 'nf8' is not one of nf4, int8, none"),
    ("method=dpo", "unknown method 'dpo'"),
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
