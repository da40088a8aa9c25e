"""Hostile input: random bytes, random JSON and random YAML fed to the data loader and
the settings (preset / config) loader. Whatever comes in, the only exception that may
come out is our own one-line error type, never a traceback's worth of something else."""

import json
import tempfile
from pathlib import Path

import yaml
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from edgetune.engine.core import config_files
from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import EdgetuneError

from edgetune.engine import data as data_lib

FUZZ = hsettings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=20)
row_like = st.dictionaries(st.sampled_from(["prompt", "answer", "completion", "text", "messages", "instruction",
                                            "output", "input", "x"]), json_values, max_size=4)


def _only_our_errors(fn, *args):
    try:
        fn(*args)
    except EdgetuneError as e:
        assert "\n" not in str(e), str(e)


def _load_everything(path: str):
    _only_our_errors(data_lib.preview, path)
    _only_our_errors(data_lib.load_rl, S.DataSettings(path=path), 0)


def _write(suffix: str, content: bytes) -> str:
    d = Path(tempfile.mkdtemp(prefix="edgetune-fuzz-"))
    p = d / f"data{suffix}"
    p.write_bytes(content)
    return str(p)


@FUZZ
@given(st.binary(max_size=300), st.sampled_from([".jsonl", ".json", ".csv"]))
def test_random_bytes_into_the_data_loader(content, suffix):
    _load_everything(_write(suffix, content))


@FUZZ
@given(st.lists(st.one_of(row_like, json_values), max_size=5), st.booleans())
def test_random_json_rows_into_the_data_loader(rows, as_lines):
    if as_lines:
        body = "".join(json.dumps(r) + "\n" for r in rows)
        _load_everything(_write(".jsonl", body.encode()))
    else:
        _load_everything(_write(".json", json.dumps(rows).encode()))


@FUZZ
@given(st.text(max_size=200))
def test_random_yaml_text_into_the_settings_loader(text):
    p = _write(".yaml", text.encode("utf-8", "surrogatepass"))
    _only_our_errors(config_files.load_yaml, p)
    _only_our_errors(lambda: S.resolve(config=p))


@FUZZ
@given(st.dictionaries(st.sampled_from(["method", "model", "lora", "data", "run", "sft", "fgrpo", "essa", "x"]),
                       st.one_of(json_values, st.dictionaries(st.text(max_size=12), json_values, max_size=3)),
                       max_size=4))
def test_random_yaml_mappings_into_the_settings_loader(mapping):
    p = _write(".yaml", yaml.safe_dump(mapping).encode())
    _only_our_errors(lambda: S.resolve(config=p))


def test_deeply_nested_json_is_one_line(tmp_path):
    for name, body in (("deep.json", "[" * 100_000 + "]" * 100_000),
                       ("deep.jsonl", '{"text": ' + "[" * 100_000 + "]" * 100_000 + "}\n")):
        (tmp_path / name).write_text(body)
        try:
            data_lib.preview(str(tmp_path / name))
            raise AssertionError("read a 100,000-deep document")
        except EdgetuneError as e:
            assert "nested too deeply" in str(e) and name in str(e)


def test_byte_order_marks_are_read(tmp_path):
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbfprompt,answer\nWhat is 1 plus 2?,3\nWhat is 2 plus 2?,4\n")
    (tmp_path / "bom.jsonl").write_bytes(b'\xef\xbb\xbf{"prompt": "a", "answer": "1"}\n{"prompt": "b", "answer": "2"}\n')
    rows, fmt = data_lib.preview(str(tmp_path / "bom.csv"))
    assert fmt == "rl" and rows[0] == {"prompt": "What is 1 plus 2?", "answer": "3"}
    rows, fmt = data_lib.preview(str(tmp_path / "bom.jsonl"))
    assert fmt == "rl" and [r["answer"] for r in rows] == ["1", "2"]


def test_yaml_syntax_error_is_one_line_with_file_and_line(tmp_path):
    p = tmp_path / "my.yaml"
    p.write_text("method: sft\nsft:\n  lr: 1e-3\n\tsteps: 3\n")
    try:
        S.resolve(config=str(p))
        raise AssertionError("a tab-indented YAML file loaded")
    except EdgetuneError as e:
        assert str(e).startswith(f"{p}, line 4, column 1: not valid YAML: ") and "\n" not in str(e)
