"""Every number a user can type is bounded where it is typed: a setting (YAML, --set, the
app's fields), a command-line flag that is not a setting (--gpus, --more-steps, ...) and the
app's HTTP API. Extremes (0, -1, 2**63, 1e20, NaN, huge strings) get one line naming the
number and its range, the same line everywhere; nothing else comes out."""

import json

import pytest
from hypothesis import HealthCheck, given
from hypothesis import settings as hsettings
from hypothesis import strategies as st

from edgetune.engine.core import settings as S
from edgetune.engine.core.errors import ConfigError

from edgetune.engine import cli

EXTREMES = [0, -1, 2**63, -(2**63), 1e20, -1e20, float("nan"), float("inf"), "9" * 5000, "1e400", "x" * 100_000,
            "", None, True, [1], {"a": 1}]
NUMERIC = sorted(k for k, f in S.declared().items() if f.metadata["range"] is not None)
FUZZ = hsettings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def _one_line(e, starts: str):
    msg = str(e)
    assert msg.startswith(starts) and "\n" not in msg and len(msg) < 300, msg
    return msg


def _typed(key):
    group, name = key.split(".")
    return S.field_types(type(getattr(S.Config(), group)))[name]


def test_every_numeric_setting_has_an_upper_bound():
    for key in NUMERIC:
        assert S.declared()[key].metadata["range"].high is not None, key


@pytest.mark.parametrize("key", NUMERIC)
def test_extremes_of_every_numeric_setting_are_refused_in_one_line_or_taken_within_range(key):
    group, name = key.split(".")
    rng = S.declared()[key].metadata["range"]
    for value in EXTREMES:
        for override in ({group: {name: value}}, [f"{key}={value}"]):  # the app's widgets / YAML, and --set
            try:
                cfg = S.resolve(overrides=override)
            except ConfigError as e:
                _one_line(e, key)
                continue
            got = getattr(getattr(cfg, group), name)
            assert isinstance(got, _typed(key)) and rng.allows(got), (key, value, got)
    with pytest.raises(ConfigError) as e:
        S.resolve(overrides={group: {name: _typed(key)(rng.high * 2 + 1)}})
    assert str(e.value).startswith(f"{key} must be ")


@FUZZ
@given(st.sampled_from(NUMERIC), st.one_of(st.integers(), st.floats(), st.text(max_size=30),
                                           st.integers(min_value=-(2**80), max_value=2**80).map(str)))
def test_any_value_of_any_numeric_setting_is_taken_within_range_or_refused_in_one_line(key, value):
    group, name = key.split(".")
    try:
        cfg = S.resolve(overrides={group: {name: value}})
    except ConfigError as e:
        _one_line(e, key)
        return
    assert S.declared()[key].metadata["range"].allows(getattr(getattr(cfg, group), name))


@FUZZ
@given(st.sampled_from(sorted(cli.flag_ranges())), st.one_of(st.integers(), st.floats(), st.text(max_size=30)))
def test_every_numeric_flag_is_read_within_its_range_or_refused_in_one_line(dest, value):
    flag, rng = cli.flag_ranges()[dest]
    try:
        got = S.typed_number(flag, value, rng)
    except ConfigError as e:
        _one_line(e, flag)
        return
    assert isinstance(got, int) and rng.allows(got)


# What each flag's command is; the flag is read before anything runs.
COMMANDS = {"gpus": ["train", "--preset", "sft-quickstart"], "nnodes": ["train", "--preset", "sft-quickstart"],
            "node_rank": ["train", "--preset", "sft-quickstart"], "more_steps": ["resume", "r"],
            "port": ["ui"], "max_seq_len": ["data", "rows.jsonl"],
            "chunk_overlap": ["data", "docs"], "to": ["queue", "move", "1"],
            "job": ["queue", "cancel"]}  # job: a positional argument, the value alone


@pytest.mark.parametrize("dest", sorted(COMMANDS))
def test_each_numeric_flag_refuses_extremes_in_one_line(dest, tmp_path, monkeypatch, capsys):
    assert set(COMMANDS) == set(cli.flag_ranges())
    monkeypatch.chdir(tmp_path)
    flag, rng = cli.flag_ranges()[dest]
    for value in ("-1", str(2**63), "1e20", "nan", "inf", "9" * 5000, "x" * 100_000, "2.5"):
        given = [value] if dest == "job" else [flag, value]  # job: positional, right after its command
        args = [*COMMANDS[dest], *given] if dest in ("job", "max_seq_len", "chunk_overlap") else [*COMMANDS[dest], flag, value]
        if dest not in ("max_seq_len", "chunk_overlap"):
            args += ["--runs-dir", str(tmp_path / "runs")]
        assert cli.main(args) == 2, (flag, value)
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and err.startswith(f"error: {flag}") and len(err) < 300, err
    assert not list(tmp_path.iterdir())  # nothing was made


def test_more_steps_past_any_run_is_refused_and_the_run_is_unchanged(tmp_path, capsys):
    run = tmp_path / "runs" / "r"
    run.mkdir(parents=True)
    config = S.resolve(preset="sft-quickstart").to_yaml()
    (run / "config.yaml").write_text(config)
    assert cli.main(["resume", "r", "--runs-dir", str(tmp_path / "runs"), "--more-steps",
                     "99999999999999999999999"]) == 2
    assert capsys.readouterr().err == ("error: --more-steps must be in [1, 10000000], got 9.999e+22 "
                                       "(nearest allowed: 10000000)\n")
    assert (run / "config.yaml").read_text() == config and not (run / "events.jsonl").exists()


def test_the_apps_http_api_answers_out_of_range_numbers_with_the_command_lines_line(tmp_path, monkeypatch,
                                                                                    capfd):
    """The More steps field and a settings field, called through the HTTP API as a script
    would: the answer is the CLI's line, and the server logs no traceback."""
    import socket

    import httpx

    from edgetune.app.main import launch

    monkeypatch.setenv("GRADIO_TEMP_DIR", str(tmp_path / "gradio"))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    demo = launch("127.0.0.1", port, str(tmp_path / "runs"), block=False)
    base = f"http://127.0.0.1:{port}"

    def call(endpoint: str, data: list) -> list:
        body = json.dumps({"data": data})  # NaN as JavaScript's JSON.parse never sends, a script may
        r = httpx.post(f"{base}/gradio_api/call/{endpoint}", content=body, timeout=30,
                       headers={"Content-Type": "application/json"})
        assert r.status_code == 200, r.text
        text = httpx.get(f"{base}/gradio_api/call/{endpoint}/{r.json()['event_id']}", timeout=60).text
        assert "event: complete" in text, text[-2000:]
        return json.loads(text.split("data:", 1)[1].strip().splitlines()[0])

    try:
        for value in (-1, 0, 2**63, 1e20, float("nan"), "9" * 5000):
            cli_line = None
            try:
                S.typed_number("--more-steps", value, S.MORE_STEPS)
            except ConfigError as e:
                cli_line = str(e)
            answer = call("do_more", [None, value])
            assert f"✗ {cli_line}" in answer, (value, answer)
        # a settings field (an integer widget) sent NaN: the settings' one line
        page = demo.edgetune_page
        spec = page.spec_of["sft.steps"]
        values = [page.start_values[k] for k in page.fields]
        values[list(page.fields).index(spec.key)] = float("nan")
        with pytest.raises(ConfigError, match="^sft.steps: expected an integer, got nan$"):
            from edgetune.app import form

            form.config_from_values("sft", values, [page.spec_of[k] for k in page.fields], str(tmp_path / "runs"))
    finally:
        demo.close()
        demo.edgetune_chat.close()
    assert "Traceback" not in capfd.readouterr().err
