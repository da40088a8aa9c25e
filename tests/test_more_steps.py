"""Live samples at each evaluation (`samples` events, the Train tab, the CLI) and
`edgetune resume --more-steps`: a finished run trains further from its final checkpoint."""

import os
import signal

import pytest
from inline_run import run_inline, sft_config

from edgetune.engine.core.errors import ConfigError, RunError
from edgetune.engine.core.events import EventWriter, read_events
from edgetune.engine.core.runfolder import RunDir, record_inputs
from edgetune.engine.core.settings import load_run_config

from edgetune.engine.run import api

from edgetune.app import live
from edgetune.engine import cli
from edgetune.engine.cli.watch import more_steps_text, samples_text


def _sft(cfg, path, **kw):
    from edgetune.engine.methods.sft import sft

    return run_inline(sft.train, cfg, path, **kw)[2]


def test_sft_evaluations_show_greedy_samples_in_the_app_and_the_cli(tiny_model_dir, tmp_path):
    cfg = sft_config(tiny_model_dir, tmp_path, sft={"steps": 4, "eval_every": 2, "samples": 2})
    events = _sft(cfg, tmp_path / "s")
    evals = [e["step"] for e in events if e["type"] == "eval"]
    samples = [e for e in events if e["type"] == "samples"]
    assert evals == [0, 2, 4] and [e["step"] for e in samples] == evals
    for ev in samples:
        assert len(ev["samples"]) == 2
        for x in ev["samples"]:
            # the prompt is the held-out row's question, the reference its answer (the embedded
            # rows ask for a sum): both come from the data, the completion from the model
            assert x["prompt"] and x["reference"] and isinstance(x["completion"], str)
            assert x["reference"] not in ("", x["prompt"])
    last = samples[-1]["samples"]
    md = live.eval_samples_markdown(events)
    assert md.startswith("**Held-out samples at step 4**") and md.count("\n| ") == 3  # header + 2 rows
    assert all(live._cell(x["reference"], 300) in md for x in last)
    assert "samples at step 4: 2 held-out completions" in live.log_lines(events)
    text = samples_text(samples[-1])
    assert text.splitlines()[0].startswith("samples at step 4") and len(text.splitlines()) == 3
    assert repr(last[0]["reference"]) in text

    off = _sft(sft_config(tiny_model_dir, tmp_path, sft={"steps": 2, "eval_every": 2, "samples": 0}),
               tmp_path / "off")
    assert [e["type"] for e in off].count("eval") == 2 and not [e for e in off if e["type"] == "samples"]


def _lrs(events):
    return {e["step"]: e["lr"] for e in events if e["type"] == "step"}


def _losses(events):
    return {e["step"]: e["loss"] for e in events if e["type"] == "step"}


def test_finished_run_trains_more_steps_from_its_final_checkpoint(tiny_model_dir, tmp_path):
    """3 steps, then --more-steps 2: steps 4 and 5 have the losses of an uninterrupted
    5-step run whose schedule decays over 3 steps (optimizer, RNG and data order
    restored), at the schedule's final learning rate; config.yaml holds 5 steps."""
    from edgetune.engine.run import worker

    cfg = sft_config(tiny_model_dir, tmp_path, sft={"steps": 3}, run={"checkpoint_every": 50})
    path = tmp_path / "r"
    first = _sft(cfg, path)
    assert first[-1]["type"] == "finished" and (path / "checkpoints" / "step-3").is_dir()  # the final checkpoint
    (path / "config.yaml").write_text(cfg.to_yaml())
    record_inputs(RunDir(path), cfg)  # as the worker leaves a run
    run = api.Run(path)

    with pytest.raises(RunError, match=r"^run 'r' already finished; edgetune resume .* --more-steps N"):
        api.resume(path)
    with pytest.raises(ConfigError, match=r"^--more-steps must be in \[1, 10000000\], got 0 \(nearest allowed: 1\)$"):
        api.resume(path, more=0)
    with pytest.raises(ConfigError, match=r"^--more-steps 9999999: sft.steps would be 10000002; sft.steps must be "
                                          r"in \[1, 10000000\]$"):
        api.resume(path, more=9999999)
    assert load_run_config(path / "config.yaml").sft.steps == 3  # nothing was changed
    api.more_steps(run, load_run_config(path / "config.yaml"), 2)
    assert load_run_config(path / "config.yaml").sft.steps == 5
    more = read_events(path / "events.jsonl")[-1]
    assert {k: more[k] for k in ("type", "setting", "from", "to", "schedule")} == \
        {"type": "more_steps", "setting": "sft.steps", "from": 3, "to": 5, "schedule": 3}
    assert more_steps_text(more).startswith("more steps: sft.steps 3 → 5")
    assert "more steps: sft.steps 3 → 5 (learning rate flat past step 3)" in live.log_lines([more])

    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), resume=True, owns_pid=False) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    events = read_events(path / "events.jsonl")
    after = events[more["i"] + 1:]
    assert after[0]["type"] == "started" and after[0]["resumed_from"] == 3
    assert after[-1]["type"] == "finished" and after[-1]["step"] == 5 and run.status() == "finished"

    ref = _sft(sft_config(tiny_model_dir, tmp_path, sft={"steps": 5}, run={"checkpoint_every": 50}),
               tmp_path / "ref", schedule_steps=3)
    assert _losses(after) == {k: v for k, v in _losses(ref).items() if k > 3}  # bit for bit
    assert _losses(first) == {k: v for k, v in _losses(ref).items() if k <= 3}
    # The step event's lr is the next step's: the decay ends at step 3 at 0.1 x the peak
    # (engine/training/loop.make_scheduler) and the added steps stay there.
    assert _lrs(first)[3] == pytest.approx(0.1 * cfg.sft.lr)
    assert list(_lrs(after).values()) == pytest.approx([0.1 * cfg.sft.lr] * 2)


def test_more_steps_refusals_are_one_line(tiny_model_dir, tmp_path, capsys):
    cfg = sft_config(tiny_model_dir, tmp_path, sft={"steps": 2}, run={"checkpoint_every": 50})
    path = tmp_path / "old"
    _sft(cfg, path)
    (path / "config.yaml").write_text(cfg.to_yaml())
    import shutil

    shutil.rmtree(path / "checkpoints" / "step-2")  # as a run of an older edgetune left it
    capsys.readouterr()  # what the training printed
    assert cli.main(["resume", str(path), "--more-steps", "2"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith(
        "error: run 'old' finished without a checkpoint of its step 2 (an older edgetune kept none at the end), "
        "so its optimizer state is gone: start a new run with lora.init_from=")
    assert load_run_config(path / "config.yaml").sft.steps == 2  # nothing was changed

    w = EventWriter(path / "events.jsonl")  # the run trains again: its worker is this process
    w.emit("started", method="sft")
    w.close()
    (path / "worker.pid").write_text(str(os.getpid()))
    assert cli.main(["resume", str(path), "--more-steps", "2"]) == 2
    assert capsys.readouterr().err == "error: run 'old' is still running\n"

    essa = tmp_path / "elsewhere" / "e"  # another runs folder: no run trains there
    essa.mkdir(parents=True)
    (essa / "config.yaml").write_text(cfg.to_yaml().replace("method: sft", "method: essa"))
    assert cli.main(["resume", str(essa), "--more-steps", "2"]) == 2
    assert capsys.readouterr().err.startswith("error: run 'e' is an ESSA run: its search is not continued")


def test_a_samples_prompt_is_its_last_turn_without_the_template(embedded_dir):
    from edgetune.engine.data.prompts import prompt_ids

    from edgetune.engine.models.model import load_tokenizer

    from edgetune.engine.generation.samples import last_turn

    tok = load_tokenizer(str(embedded_dir))
    one = prompt_ids(tok, [[{"role": "user", "content": "What is 3 + 4?"}]])[0]
    assert "You are a helpful AI assistant" in tok.decode(one)  # the template's system prompt
    assert last_turn(tok, one) == "What is 3 + 4?"
    chat = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"},
            {"role": "user", "content": "Line one\nline two"}]
    assert last_turn(tok, prompt_ids(tok, [chat])[0]) == "Line one\nline two"
    plain = tok("Question: 2 + 2?", add_special_tokens=False)["input_ids"]  # no template: the whole text
    assert last_turn(tok, plain) == "Question: 2 + 2?"


def _finished_run(path, method, steps):
    """A finished run's folder as a worker leaves it: its config, the `started` event with
    that config, the final checkpoint (empty: nothing loads it here) and `finished`."""
    from edgetune.engine.core.settings import resolve

    cfg = resolve(overrides=[f"method={method}", f"{method}.steps={steps}", f"run.runs_dir={path.parent}"])
    path.mkdir(parents=True)
    (path / "config.yaml").write_text(cfg.to_yaml())
    (path / "checkpoints" / f"step-{steps}").mkdir(parents=True)
    w = EventWriter(path / "events.jsonl")
    w.emit("started", method=method, config=cfg.to_dict())
    w.emit("finished", step=steps, metrics={})
    w.close()
    return cfg


@pytest.mark.parametrize("method", [name for name, m in api.METHODS.items() if not m.more_steps])
def test_more_steps_trains_further_for_every_method_that_can(tmp_path, monkeypatch, method):
    """The worker's check of settings edited since the run started (resume_changes) takes the
    step count --more-steps raised, for every method whose record lets it train further."""
    from edgetune.engine.core.events import started_config
    from edgetune.engine.core.settings import resume_changes

    path = tmp_path / "runs" / "r"
    _finished_run(path, method, 6)
    started = []
    monkeypatch.setattr(api, "_spawn", lambda run, **kw: started.append(kw) or None)
    api.resume(path, more=2)
    assert started and getattr(load_run_config(path / "config.yaml"), method).steps == 8
    cfg = load_run_config(path / "config.yaml")  # what the worker reads, and checks as it does
    assert resume_changes(cfg, started_config(read_events(path / "events.jsonl")), path / "config.yaml") == \
        [(f"{method}.steps", 6, 8)]


def test_a_refused_more_steps_changes_neither_the_config_nor_the_status(tmp_path, monkeypatch):
    path = tmp_path / "runs" / "r"
    _finished_run(path, "dpo", 6)
    before = (path / "config.yaml").read_text()
    monkeypatch.setitem(api.METHODS, "dpo", __import__("dataclasses").replace(api.METHODS["dpo"], length="generations"))
    with pytest.raises(ConfigError, match="dpo.steps is 8 but the run trained with 6"):
        api.resume(path, more=2)  # (a record whose step count the worker would not take)
    assert (path / "config.yaml").read_text() == before and api.Run(path).status() == "finished"
    assert read_events(path / "events.jsonl")[-1]["type"] == "finished"


def test_a_stop_after_a_resume_keeps_the_figures_of_the_earlier_attempts(tiny_model_dir, tmp_path, capsys):
    """Stop at step 2 (after its evaluation), resume, stop at step 3 (no evaluation in
    that attempt): the Runs table and `edgetune runs` still show the loss before training
    and the latest held-out loss, beside the latest step's loss."""
    from edgetune.engine.methods.sft import sft

    from edgetune.app.panels import runs_frame

    cfg = sft_config(tiny_model_dir, tmp_path, sft={"steps": 6, "eval_every": 2})
    path = tmp_path / "r"
    path.mkdir()
    (path / "config.yaml").write_text(cfg.to_yaml())
    first = run_inline(sft.train, cfg, path, stop_after=2)[2]
    assert first[-1]["type"] == "stopped" and first[-1]["step"] == 2
    before = first[-1]["metrics"]
    assert set(before) == {"eval_loss_start", "eval_loss", "loss"}
    run, _, events = run_inline(sft.train, cfg, path, stop_after=3, resume=True)
    second = events[len(first):]
    assert [e["type"] for e in second if e["type"] in ("eval", "stopped")] == ["stopped"]  # nothing evaluated
    assert second[-1]["step"] == 3 and second[-1]["metrics"]["loss"] != before["loss"]

    summary = api.summaries(tmp_path)[0]
    assert summary["status"] == "stopped" and summary["step"] == 3
    assert summary["metrics"] == {**before, "loss": second[-1]["metrics"]["loss"]}
    table = runs_frame([summary]).iloc[0]["metrics"]
    assert f"eval loss before {before['eval_loss_start']:.4g}" in table and \
        f"eval loss {before['eval_loss']:.4g}" in table
    assert cli.main(["runs", "--runs-dir", str(tmp_path)]) == 0
    line = capsys.readouterr().out.splitlines()[0]
    assert f"eval loss before {before['eval_loss_start']:.4g}" in line and f"eval loss {before['eval_loss']:.4g}" in line
