"""The app without a browser: the settings form, presets, the live views computed from
events and memory.json, the data / estimate / runs panels, the data check and the chat
worker; and that importing and building the page loads no torch."""

from __future__ import annotations

import html
import json
import pathlib
import subprocess
import sys
import textwrap

import pytest

from edgetune.engine.core import settings as S
from edgetune.engine.core.config_files import list_presets
from edgetune.engine.core.errors import ConfigError

from edgetune.app import form, live, panels
from edgetune.app.methods import BY_KEY, METHODS

# --------------------------------------------------------------------------- no torch in the UI process


def test_building_the_app_imports_no_torch(tmp_path):
    code = textwrap.dedent(f"""
        import sys
        from edgetune.app.main import launch
        from edgetune.app.ui import build_app
        demo = build_app({str(tmp_path / 'runs')!r})
        from edgetune.engine.run import api
        api.estimate(api.resolve(preset="sft-quickstart"))  # the Model tab calls it in-process
        heavy = [m for m in ("torch", "transformers", "peft", "bitsandbytes") if m in sys.modules]
        print("HEAVY", heavy)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "HEAVY []" in out.stdout


# --------------------------------------------------------------------------- form and presets


def test_every_setting_has_a_widget_with_help():
    specs = form.field_specs()
    keys = {s.key for s in specs}
    for group, cls in form.groups().items():
        for f in S.dataclasses.fields(cls):
            key = f"{group}.{f.name}"
            assert (key in keys) != (key in form.HIDDEN), key
    by_key = {s.key: s for s in specs}
    assert by_key["sft.lr"].kind == "float" and by_key["sft.steps"].kind == "int"
    assert by_key["model.gradient_checkpointing"].kind == "any"  # true, false or auto
    assert by_key["lora.target_modules"].kind == "any"
    assert "NormalFloat" in by_key["model.quant"].help
    assert by_key["sft.lr"].section == "optimisation" and by_key["sft.sebp"].section == "speed"
    assert by_key["fgrpo.sebp"].section == "speed"
    assert by_key["model.quant"].choices == ("nf4", "int8", "none") and by_key["sft.steps"].choices is None
    assert by_key["sft.steps"].basic and not by_key["sft.weight_decay"].basic


@pytest.mark.parametrize("spec", [s for s in form.field_specs() if s.choices], ids=lambda s: s.key)
def test_choices_are_what_the_engine_accepts(spec):
    group, name = spec.group, spec.name
    for value in spec.choices:
        assert getattr(getattr(S.resolve(overrides={group: {name: value}}), group), name) == value
    with pytest.raises(ConfigError):
        S.resolve(overrides={group: {name: "not-a-choice"}})


@pytest.mark.parametrize("name", sorted(list_presets()))
def test_a_preset_fills_every_field_and_round_trips(name, tmp_path):
    specs = form.field_specs()
    cfg = form.preset_config(name, str(tmp_path))
    values = form.values_from_config(cfg, specs)
    back = form.config_from_values(cfg.method, values, specs, str(tmp_path))
    assert back.to_dict() == cfg.to_dict()


def test_preset_values_are_widget_friendly(tmp_path):
    specs = form.field_specs()
    by_key = dict(zip([s.key for s in specs], form.values_from_config(form.preset_config("essa-quickstart", "r"),
                                                                          specs)))
    assert by_key["lora.target_modules"] == "[q_proj, k_proj, v_proj, o_proj]"
    from edgetune.engine.core.settings import resolve

    assert by_key["essa.population"] == resolve(preset="essa-quickstart").essa.population
    assert isinstance(by_key["essa.population"], int) and by_key["sft.sebp"] == "auto"
    assert by_key["model.name"] == "embedded:smollm2-135m"


def test_widget_values_become_a_validated_config(tmp_path):
    specs = form.field_specs()
    values = form.values_from_config(form.preset_config("sft-quickstart", "r"), specs)
    keys = [s.key for s in specs]
    values[keys.index("sft.steps")] = 7.0  # gr.Number hands back floats
    values[keys.index("lora.target_modules")] = "[q_proj, v_proj]"
    cfg = form.config_from_values("sft", values, specs, str(tmp_path / "runs"))
    assert cfg.sft.steps == 7 and cfg.lora.target_modules == ["q_proj", "v_proj"]
    assert cfg.run.runs_dir == str(tmp_path / "runs")
    values[keys.index("sft.lr")] = -1.0
    with pytest.raises(ConfigError, match="sft.lr must be positive"):
        form.config_from_values("sft", values, specs, str(tmp_path))


def test_saved_preset_lists_and_loads_back(tmp_path, monkeypatch):
    monkeypatch.setenv("EDGETUNE_PRESETS", str(tmp_path / "mine"))
    cfg = S.resolve(preset="fgrpo-quickstart", overrides=["fgrpo.steps=3", "lora.r=4"])
    path = form.save_preset("my-rl", cfg)
    assert path.parent == tmp_path / "mine"
    text = path.read_text()
    assert "steps: 3" in text and "runs_dir" not in text
    assert "my-rl" in form.all_presets()
    again = form.preset_config("my-rl", cfg.run.runs_dir)
    assert again.to_dict() == cfg.to_dict()
    with pytest.raises(ConfigError, match="preset name"):
        form.save_preset("../escape", cfg)


# --------------------------------------------------------------------------- live views


def _ev(i, type, **fields):
    return {"i": i, "time": 1_700_000_000 + i, "type": type, **fields}


SFT_EVENTS = [
    _ev(0, "started", method="sft", run="r", config={"sft": {"steps": 10}}, device="cpu", resumed_from=None),
    _ev(1, "data", report={"rows_kept": 9, "rows_total": 10, "format": "messages", "train_rows": 8, "eval_rows": 1}),
    _ev(2, "eval", step=0, eval_loss=2.5),
    _ev(3, "step", step=1, total=10, loss=2.4, elapsed=2.0, eta=18.0, gpu={}, host_rss=1),
    _ev(4, "step", step=2, total=10, loss=2.0, elapsed=4.0, eta=16.0, gpu={}, host_rss=1),
    _ev(5, "eval", step=2, eval_loss=1.9),
]


def test_sft_events_become_loss_plot_progress_and_logs():
    frame = live.plot_frame(SFT_EVENTS, BY_KEY["sft"].plots[0])
    assert frame.to_dict("records") == [
        {"step": 0, "value": 2.5, "series": "eval loss"}, {"step": 1, "value": 2.4, "series": "train loss"},
        {"step": 2, "value": 2.0, "series": "train loss"}, {"step": 2, "value": 1.9, "series": "eval loss"}]
    p = live.progress(SFT_EVENTS)
    assert (p["step"], p["total"], p["eta"], p["phase"], p["values"]) == (2, 10, 16.0, "training", {"loss": 2.0})
    html = live.progress_html(SFT_EVENTS, "running", now=SFT_EVENTS[0]["time"] + 6)
    assert 'data-step="2"' in html and "step 2 / 10 · 6s elapsed · ETA 16s" in html and "width:20.0%" in html
    logs = live.log_lines(SFT_EVENTS)
    assert "started sft on cpu" in logs and "data: 9/10 rows kept (messages)" in logs
    assert "step 2/10: loss 2" in logs and "eta" not in logs.split("step 2/10")[1]


def test_progress_before_the_first_step_and_at_the_end():
    assert live.progress([])["phase"] == "starting the worker"
    assert "no run yet" in live.progress_html([], "none")
    early = live.progress(SFT_EVENTS[:2])
    assert (early["step"], early["total"]) == (0, 10)
    done = SFT_EVENTS + [_ev(6, "stopped", step=2, adapter="a", metrics={"loss": 2.0}, elapsed=5)]
    assert live.progress(done)["phase"] == "adapter saved"
    failed = SFT_EVENTS + [_ev(6, "error", message="data.path: file not found", kind="input")]
    assert live.progress(failed)["phase"] == "data.path: file not found"
    assert "ETA –" in live.progress_html(done, "stopped")
    assert "stopped at step 2: loss 2" in live.log_lines(done)


def test_elapsed_ticks_from_the_start_through_set_up_and_evaluations():
    """Elapsed is this attempt's wall time, live on every tick: during set-up (no step yet)
    and during an evaluation it moves on; at the end it is the time to the final event."""
    t0 = SFT_EVENTS[0]["time"]
    setting_up = SFT_EVENTS[:2] + [_ev(2, "phase", phase="initial_eval", done=1, total=4, unit="batches")]
    assert "1m 35s elapsed" in live.progress_html(setting_up, "running", now=t0 + 95)
    assert "2m 05s elapsed" in live.progress_html(setting_up, "running", now=t0 + 125)
    evaluating = SFT_EVENTS + [_ev(6, "phase", phase="final_eval", done=0, total=4, unit="batches")]
    assert live.progress(evaluating, now=t0 + 300)["elapsed"] == 300
    resumed = SFT_EVENTS + [_ev(6, "stopped", step=2, adapter="a", metrics={}, elapsed=5),
                            _ev(20, "started", method="sft", config={"sft": {"steps": 10}})]
    assert live.progress(resumed, now=t0 + 30)["elapsed"] == 10  # this attempt's clock
    done = SFT_EVENTS + [_ev(9, "finished", step=10, adapter="a", metrics={}, elapsed=8)]
    assert "9s elapsed · ETA –" in live.progress_html(done, "finished", now=t0 + 1000)


def test_fgrpo_events_become_reward_success_and_kl_plots_and_samples():
    events = [_ev(0, "started", method="fgrpo", config={}),
              _ev(1, "step", step=1, total=4, reward_mean=0.25, success_rate=0.5, kl=0.01),
              _ev(2, "eval", step=1, **{"pass@1": 0.4}),
              _ev(3, "sample", step=1, prompt="What is 2 plus 3?", completion="5", reward=1.0, answer="5")]
    reward, success, kl = live.plot_frames(events, BY_KEY["fgrpo"])
    assert set(reward["series"]) == {"reward"} and set(success["series"]) == {"success rate", "eval pass@1"}
    assert kl.to_dict("records") == [{"step": 1, "value": 0.01, "series": "KL"}]
    md = live.samples_markdown(events)
    assert "step 1" in md and "reward 1" in md and "What is 2 plus 3?" in md


def test_essa_events_become_fitness_per_generation_and_warm_start_loss():
    events = [_ev(0, "started", method="essa", config={"essa": {"generations": 8}}),
              _ev(1, "warm_start", event="step", step=1, total=12, loss=3.0),
              _ev(2, "candidate", generation=1, index=0, fitness=0.5),
              _ev(3, "step", step=1, total=8, best=0.6, mean=0.4)]
    fitness, warm = live.plot_frames(events, BY_KEY["essa"])
    assert fitness.to_dict("records") == [{"step": 1, "value": 0.6, "series": "best"},
                                          {"step": 1, "value": 0.4, "series": "mean"}]
    assert warm["value"].tolist() == [3.0]
    assert "generation 1 / 8" in live.progress_html(events, "running")
    assert "worker.log" in live.progress_html(events, "crashed")
    fig = live.plot_figure(fitness, BY_KEY["essa"].plots[0])
    assert fig.axes[0].get_xlabel() == "generation" and len(fig.axes[0].lines) == 2
    assert "candidate" not in live.log_lines(events)
    assert "warm-start step 1/12: loss 3" in live.log_lines(events)


def test_memory_panel_shows_gpu_bars_or_says_cpu():
    gib = 2**30
    mem = {"time": 1000.0, "gpu": {"allocated": 3 * gib, "reserved": 4 * gib, "peak": 5 * gib, "total": 24 * gib},
           "host_rss": 2 * gib}
    html = live.memory_html(mem, 32 * gib, alive=True, now=1001.0)
    for text in ("GPU allocated", "3.00 / 24.0 GiB", "GPU reserved", "GPU peak", "5.00 / 24.0 GiB",
                 "Host RAM (worker)", "2.00 / 32.0 GiB", "updated "):
        assert text in html
    cpu = live.memory_html({"time": 1000.0, "gpu": {"total": 0}, "host_rss": gib}, 32 * gib, alive=False)
    assert "No CUDA GPU" in cpu and "worker not running" in cpu
    assert "No memory readings yet" in live.memory_html(None, 32 * gib, alive=False)


def test_the_app_offers_every_record_with_its_settings_group():
    for m in METHODS:
        assert hasattr(S.Config(), m.name) and m.plots
    assert [m.name for m in METHODS] == list(S.METHODS)


# --------------------------------------------------------------------------- panels


def test_bad_data_report_lists_rows_by_number():
    md = panels.data_report_markdown({"ok": False, "error": "f.jsonl, row 2: missing 'completion'",
                                      "bad_rows": [{"row": 2, "problem": "missing 'completion'"},
                                                   {"row": 5, "problem": "'text' is empty"}]})
    assert "f.jsonl, row 2" in md and "| 2 | missing 'completion' |" in md and "| 5 |" in md


def test_good_data_report_and_histogram():
    result = {"ok": True, "preview": [{"text": "a"}],
              "report": {"rows_kept": 9, "rows_total": 10, "format": "text", "train_rows": 8, "eval_rows": 1,
                         "dropped": {"longer than max_seq_len": 1}, "truncated": 0, "eval_file": "",
                         "token_lengths": {"min": 3, "mean": 4.5, "p50": 4, "p95": 6, "max": 7},
                         "histogram": {"edges": [3, 5, 7], "counts": [6, 3]}, "length_unit": "tokens"}}
    md = panels.data_report_markdown(result)
    assert "9 of 10 rows kept" in md and "dropped 1: longer than max_seq_len" in md and "p95 6" in md
    bars = panels.histogram_figure(result).axes[0].patches[0].get_data()
    assert bars.values.tolist() == [6, 3] and bars.edges.tolist() == [3, 5, 7]
    assert panels.preview_frame(result).columns.tolist() == ["row", "text"]


def test_estimate_panel_shows_the_planner_verdict_and_parts():
    from edgetune.engine.planning import planner

    assert "Estimate unavailable" in panels.estimate_markdown({"ok": False, "error": "no planner"})
    cfg = S.resolve(preset="sft-qlora-7b", overrides={"model": {"name": "embedded:smollm2-135m"}})
    gib = 2**30
    fits = panels.estimate_markdown({"ok": True, "estimate": planner.estimate(cfg, gpu_total=80 * gib,
                                                                               gpu_free=79 * gib)})
    assert fits.startswith("### ✓ fits") and "79.00 GiB free of 80.00 GiB" in fits
    assert "| weights |" in fits and "| optimizer |" in fits and "| **total** |" in fits
    tight = panels.estimate_markdown({"ok": True, "estimate": planner.estimate(cfg, gpu_total=2 * gib,
                                                                                gpu_free=1 * gib)})
    assert tight.startswith("### ✗ does not fit") and "try:" in tight


def test_runs_table_rows():
    df = panels.runs_frame([{"name": "sft-1", "status": "finished", "method": "sft", "step": 40, "total": 40,
                             "metrics": {"loss": 0.123456, "eval_loss": 0.2}, "created": 1_700_000_000}])
    row = df.iloc[0].to_dict()
    assert row["run"] == "sft-1" and row["step"] == "40/40" and "loss 0.1235" in row["metrics"]
    rl = panels.runs_frame([{"name": "rl", "status": "finished", "method": "fgrpo", "step": 32, "total": 32,
                             "metrics": {"success_rate_start": 0.1, "pass@1_end": 0.94, "eval_loss": 0.2}}])
    assert rl.iloc[0]["metrics"] == "success rate before 0.1, pass@1 after 0.94, eval loss 0.2"
    said = "the adapter is better than the base by 12 points (95% CI 5 to 19, p = 0.003)"
    helped = panels.runs_frame([{"name": "rl", "status": "finished", "method": "fgrpo", "helped": said}])
    assert helped.iloc[0]["held-out, against the base"] == said and rl.iloc[0]["held-out, against the base"] == ""


# --------------------------------------------------------------------------- engine helpers the app calls


def test_data_check_names_every_bad_row(tmp_path, embedded_dir):
    from edgetune.engine.run.checks import check_data

    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "c"}\n{"prompt": "d", "completion": ""}\n')
    cfg = S.resolve(preset="sft-quickstart", overrides={"data": {"path": str(bad)}})
    result = check_data(cfg)
    assert not result["ok"] and "row 2" in result["error"]
    assert [b["row"] for b in result["bad_rows"]] == [2, 3]
    assert result["format"] == "prompt_completion" and len(result["preview"]) == 3
    good = check_data(S.resolve(preset="sft-quickstart"))
    assert good["ok"] and good["report"]["rows_kept"] == 350 and sum(good["report"]["histogram"]["counts"]) == 350


def test_isolated_data_check_of_malformed_json(tmp_path):
    from edgetune.engine.run import api

    bad = tmp_path / "broken.jsonl"
    bad.write_text('{"text": "ok"}\n{"text": \n{"text": "ok"}\n{oops}\n')
    result = api.check_data(S.resolve(overrides={"data": {"path": str(bad)}}))
    assert not result["ok"] and "row 2" in result["error"]
    assert [b["row"] for b in result["bad_rows"]] == [2, 4]


@pytest.fixture(scope="module")
def chat_worker(tmp_path_factory):
    """One chat worker process for the chat tests (a start costs the imports of torch,
    transformers and PEFT: several CPU-seconds); each test sends its own model settings."""
    from edgetune.engine.generation.chat import ChatSession

    log = tmp_path_factory.mktemp("chat") / "chat.log"
    chat = ChatSession(log_path=log)
    yield chat, log
    chat.close()


def test_chat_worker_answers_with_and_without_the_adapter(tmp_path, tiny_model_dir, chat_worker):
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import lora_config

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    peft_model = get_peft_model(model, lora_config(S.LoraSettings(r=4, alpha=64)))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)
    peft_model.save_pretrained(tmp_path / "adapter")

    ms = S.dataclasses.asdict(S.ModelSettings(name=str(tiny_model_dir), quant="none", attn_implementation="eager"))
    chat, log = chat_worker
    msgs = [{"role": "user", "content": "What is 2 plus 3?"}]
    plain = chat.ask(ms, msgs, "", max_new_tokens=8, timeout=300)
    both = chat.ask(ms, msgs, str(tmp_path / "adapter"), max_new_tokens=8, timeout=300)
    again = chat.ask(ms, msgs, "", max_new_tokens=8, timeout=300)
    missing = chat.ask(ms, msgs, str(tmp_path / "nowhere"), max_new_tokens=8, timeout=300)
    assert plain["ok"] and both["ok"], (plain, both, log.read_text()[-2000:])
    # The base reply with the adapter switched off is the plain base reply; the adapter changes it.
    assert both["base"] == plain["base"] == again["base"]
    assert both["tuned"] != both["base"]
    assert not missing["ok"] and "no adapter" in missing["error"]
    json.dumps(both)


def test_chat_worker_streams_each_side_and_samples(tiny_model_dir, chat_worker):
    """Streamed: each side's text grows token by token (the adapter's side first) and ends as
    the final answer; greedy by default, sampled at a temperature with a seed that repeats."""
    ms = S.dataclasses.asdict(S.ModelSettings(name=str(tiny_model_dir), quant="none", attn_implementation="eager"))
    chat, log = chat_worker
    req = {"model": ms, "adapter": "", "messages": [{"role": "user", "content": "What is 2 plus 3?"}],
           "max_new_tokens": 6}
    said = list(chat.stream(req, timeout=300))
    final, parts = said[-1], [m for m in said if "partial" in m]
    assert final["ok"] and "partial" not in final, (final, log.read_text()[-2000:])
    assert {m["partial"] for m in parts} == {"base"} and len(parts) >= 2
    assert parts[-1]["text"] == final["base"] == chat.ask(ms, req["messages"], max_new_tokens=6, timeout=300)["base"]
    assert all(parts[i]["text"] in parts[-1]["text"] for i in range(len(parts)))
    hot = dict(req, temperature=1.5, top_p=0.9, seed=7)
    one, two = (chat.ask(ms, req["messages"], max_new_tokens=6, timeout=300, temperature=1.5, top_p=0.9,
                         seed=s) for s in (7, 7))
    assert one["ok"] and one["base"] == two["base"]  # the same seed, the same sample
    assert list(chat.stream(hot, timeout=300))[-1]["base"] == one["base"]
    bad = chat.ask(ms, req["messages"], max_new_tokens=6, timeout=300, temperature=-1)
    assert not bad["ok"] and "temperature" in bad["error"]


def test_chat_history_from_gradio_becomes_plain_turns():
    """What the Chatbot hands back on the second message (content as a list of parts)
    becomes string turns; the second and third turns used to fail on exactly this."""
    import gradio as gr

    box = gr.Chatbot()
    history = [{"role": "user", "content": "What is 2 plus 3?"}, {"role": "assistant", "content": "5"},
               {"role": "user", "content": "And 4 plus 4?"}, {"role": "assistant", "content": "8"}]
    round_trip = box.preprocess(box.postprocess(history))
    assert not isinstance(round_trip[0]["content"], str)  # the shape that broke the second turn
    assert panels.chat_messages(round_trip) == history
    assert panels.chat_messages([]) == [] and panels.chat_messages(None) == []


def test_chat_worker_holds_a_conversation_per_side(tiny_model_dir, chat_worker):
    """Three turns; each side continues its own conversation, and list-of-parts content
    (as Gradio 6 sends it) is accepted by the worker too."""
    ms = S.dataclasses.asdict(S.ModelSettings(name=str(tiny_model_dir), quant="none", attn_implementation="eager"))
    chat, log = chat_worker
    hist: list[dict] = []
    for text in ("What is 2 plus 3?", "And 4 plus 4?", "Thanks. 1 plus 1?"):
        user = {"role": "user", "content": [{"type": "text", "text": text}]}
        reply = chat.ask(ms, hist + [user], "", max_new_tokens=4, timeout=300)
        assert reply["ok"], (reply, log.read_text()[-2000:])
        hist += [user, {"role": "assistant", "content": reply["base"]}]
    bad = chat.ask(ms, [{"role": "user", "content": 3}], "", max_new_tokens=4, timeout=300)
    assert len(hist) == 6 and all(isinstance(m["content"], (str, list)) for m in hist)
    assert not bad["ok"] and "chat message 1" in bad["error"]


def test_each_phase_has_its_own_status_line_and_progress():
    """The page's line follows the worker's `phase` events; a long phase fills the bar
    with its own progress (it used to say "loading the model and data" throughout)."""
    start = [_ev(0, "started", method="sft", run="r", config={"sft": {"steps": 10}}, device="cpu")]
    seen = {}
    script = [("data_check", {}), ("loading", {}), ("initial_eval", dict(done=0, total=30, unit="prompts")),
              ("initial_eval", dict(done=12, total=30, unit="prompts")), ("training", {})]
    events = list(start)
    for name, extra in script:
        events.append(_ev(len(events), "phase", phase=name, **extra))
        seen[(name, extra.get("done"))] = (live.progress(events)["phase"], live.progress_html(events, "running"))
    assert seen[("data_check", None)][0] == "checking the data"
    assert seen[("loading", None)][0] == "loading the model"
    line, html = seen[("initial_eval", 12)]
    assert line == "initial eval 12/30 prompts" and "width:40.0%" in html and 'data-bar="phase"' in html
    assert seen[("training", None)][0] == "training · first step"
    events.append(_ev(len(events), "step", step=3, total=10, loss=2.0, elapsed=3.0, eta=7.0))
    assert live.progress(events)["phase"] == "training" and "width:30.0%" in live.progress_html(events, "running")
    events.append(_ev(len(events), "phase", phase="final_eval", done=1, total=4, unit="batches"))
    assert live.progress(events)["phase"] == "final eval 1/4 batches"
    # The log shows each phase once, at its latest progress.
    logs = live.log_lines(events)
    assert logs.count("initial eval") == 1 and "phase: initial eval 12/30 prompts" in logs
    assert "final eval 1/4" in logs.splitlines()[0]  # the newest line first, always in view


def test_essa_warm_start_shows_its_own_phases():
    events = [_ev(0, "started", method="essa", run="r", config={"essa": {"generations": 8}}, device="cpu"),
              _ev(1, "phase", phase="warm_start"),
              _ev(2, "warm_start", event="phase", phase="initial_eval", done=2, total=4, unit="batches")]
    assert live.progress(events)["phase"] == "warm start (SFT) · initial eval 2/4 batches"
    events += [_ev(3, "warm_start", event="phase", phase="training"),
               _ev(4, "warm_start", event="step", step=3, total=6, loss=1.0)]
    assert live.progress(events)["phase"] == "warm start (SFT) · step 3/6"
    events += [_ev(5, "phase", phase="initial_eval", done=16, total=30, unit="prompts")]
    assert live.progress(events)["phase"] == "initial eval 16/30 prompts"


# --------------------------------------------------------------------------- the page's handlers


@pytest.fixture(scope="module")
def page(tmp_path_factory):
    from edgetune.app.ui import build_app

    demo = build_app(tmp_path_factory.mktemp("page") / "runs")
    yield demo.edgetune_page
    demo.edgetune_chat.close()


def test_the_form_fills_and_reads_back_by_component(page):
    """A preset fills every setting's widget and the method's column, keyed by component;
    the same dict read back is the preset's config (no list order to keep in step)."""
    cfg = form.preset_config("essa-quickstart", str(page.runs_dir))
    filled = page.fill_from(cfg, "preset essa-quickstart")
    assert set(filled) == set(page.form_outputs) and len(page.fields) == len(page.specs)
    assert filled[page.fields["essa.population"]] == cfg.essa.population
    assert filled[page.method_radio] == BY_KEY["essa"].label
    assert [c for c, v in filled.items() if c in page.method_cols.values() and v.visible] == \
        [page.method_cols["essa"]]
    values = {c: v for c, v in filled.items() if c in page.form_inputs}
    assert page.config(values).to_dict() == cfg.to_dict()
    loaded = page.method_tab.apply_preset("fgrpo-quickstart")
    assert loaded[page.fields["fgrpo.steps"]] == S.resolve(preset="fgrpo-quickstart").fgrpo.steps
    assert "Loaded preset **fgrpo-quickstart**" in loaded[page.method_tab.info]
    assert "Decided for this run" in loaded[page.model_tab.estimate]
    values[page.fields["sft.lr"]] = -1.0
    bad = page.model_tab.do_estimate(values)
    assert list(bad) == [page.model_tab.estimate] and "sft.lr must be positive" in bad[page.model_tab.estimate]


def test_the_live_view_draws_a_run_folder_by_component(page):
    """draw() of a run folder written by hand: what it returns is among the timer's outputs;
    plots and logs only when the events changed; a message goes when its run moves on."""
    run = page.runs_dir / "sft-by-hand"
    run.mkdir()
    (run / "config.yaml").write_text(S.resolve(preset="sft-quickstart").to_yaml())
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in SFT_EVENTS))
    train = page.train_tab
    first = train.draw(str(run), {}, {})
    assert set(first) <= set(train.live_outputs)
    assert 'data-step="2"' in first[train.progress] and "sft-by-hand" in first[page.banner]
    # no worker lives and no final event: the run crashed, and the bar says what its log said last
    (run / "worker.log").write_text("loading the model\nRuntimeError: the tokenizer file is damaged\n")
    assert ("the worker ended without a final event; the last line of "
            f"{run / 'worker.log'}: RuntimeError: the tokenizer file is damaged; Resume continues") \
        in html.unescape(train.draw(str(run), {}, {})[train.progress])
    assert "step 2/10: loss 2" in first[train.logs] and first[train.plots[0]].visible
    assert first[page.runs_tab.table]["run"].tolist() == ["sft-by-hand"]
    assert "no saved adapter yet" in first[page.chat_tab.info]
    assert "ended without an adapter" in first[page.export_tab.info]  # crashed: the advice is Resume
    again = train.draw(str(run), first[page.seen], page.said(str(run)))
    assert train.logs not in again and train.plots[0] not in again and train.msg not in again
    moved = train.draw(str(run), first[page.seen], {"path": "elsewhere", "status": "running"})
    assert moved[train.msg] == "" and moved[page.msg_at] == {}
    opened = page.runs_tab.do_open("sft-by-hand")
    assert opened[page.attached] == str(run) and "Opened" in opened[train.msg]
    (run / "tensorboard").mkdir()  # what the worker writes by default (run.report_to)
    assert f"tensorboard --logdir {run / 'tensorboard'}" in page.runs_tab.do_open("sft-by-hand")[train.msg]
    assert page.export_tab.do_folder({page.attached: str(run), page.export_tab.out_dir: "",
                                      page.export_tab.merged: False})[page.export_tab.msg].startswith("✗")
    with open(run / "events.jsonl", "a") as f:  # an evaluation's samples (an SFT run's too)
        f.write(json.dumps({"i": len(SFT_EVENTS), "time": 0, "type": "samples", "step": 2, "samples": [
            {"prompt": "user\nWhat is 2 + 3?\nassistant", "completion": "2 + 3 = 6", "reference": "2 + 3 = 5"}]})
                + "\n")
    drawn = train.draw(str(run), first[page.seen], {})
    assert "**Held-out samples at step 2**" in drawn[train.samples]
    assert "| user What is 2 + 3? assistant | 2 + 3 = 6 | 2 + 3 = 5 |" in drawn[train.samples]
    more = page.runs_tab.do_more("sft-by-hand", 0)  # the button's refusal, one line; nothing starts
    assert more[train.msg] == "✗ --more-steps must be in [1, 10000000], got 0 (nearest allowed: 1)"
    assert not (run / "worker.pid").exists()


def test_merged_export_through_the_api_leaves_the_caller_torch_free(tmp_path, tiny_model_dir):
    """The app's merged export: api.export(..., isolated=True) merges in its own process;
    the merged weights are the base's plus the adapter's B·A, and errors come back as
    the same one-line errors."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.export import write_adapter
    from edgetune.engine.models.model import load_tokenizer, lora_config

    cfg = S.from_dict({"method": "sft", "model": {"name": str(tiny_model_dir), "quant": "none"},
                       "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj"]}, "run": {"runs_dir": str(tmp_path)}})
    model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(cfg.lora))
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.5)
    adapter = write_adapter(tmp_path / "adapter", model, load_tokenizer(str(tiny_model_dir)), cfg,
                            str(tiny_model_dir), {})
    code = textwrap.dedent(f"""
        import sys
        from edgetune.engine.run import api
        from edgetune.engine.core.errors import RunError
        print("OUT", api.export({str(adapter)!r}, {str(tmp_path / 'out')!r}, merged=True, isolated=True))
        try:
            api.export({str(adapter)!r}, {str(tmp_path / 'out')!r}, merged=True, isolated=True)
        except RunError as e:
            print("REFUSED", e)
        print("HEAVY", [m for m in ("torch", "transformers", "peft") if m in sys.modules])
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert f"OUT {tmp_path / 'out'}" in out.stdout and "HEAVY []" in out.stdout
    assert "REFUSED" in out.stdout and "not empty" in out.stdout
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "out" / "merged")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    delta = (layer.lora_B["default"].weight @ layer.lora_A["default"].weight) * layer.scaling["default"]
    want = base.model.layers[0].self_attn.q_proj.weight + delta
    got = merged.model.layers[0].self_attn.q_proj.weight
    assert torch.allclose(got.float(), want.float(), atol=2e-2, rtol=1e-2)
    assert not torch.allclose(got.float(), base.model.layers[0].self_attn.q_proj.weight, atol=0.1)


def test_the_chat_of_a_run_sends_its_system_prompt(page, tmp_path, monkeypatch, tiny_model_dir):
    """Chatting with a run's adapter, the request carries the run's data.system_prompt (its
    config.yaml), and the chat worker puts it first on both sides, as SFT data and rollouts
    render it; the worker runs in this process here (its own process is tested above)."""
    import torch
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM

    from edgetune.engine.models.model import lora_config

    from edgetune.engine.generation.chat import _Chat

    system = "You answer with one number."
    cfg = S.from_dict({"method": "sft", "model": {"name": str(tiny_model_dir), "quant": "none",
                                                  "attn_implementation": "eager"},
                       "data": {"system_prompt": system}, "run": {"runs_dir": str(page.runs_dir)}})
    run = page.runs_dir / "sft-with-system"
    run.mkdir()
    (run / "config.yaml").write_text(cfg.to_yaml())
    (run / "events.jsonl").write_text("")
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir), lora_config(cfg.lora))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 1.0)
    peft_model.save_pretrained(run / "adapter")

    worker, sent = _Chat(), []

    def stream(req, timeout=600, partial=True):
        sent.append(json.loads(json.dumps(req)))  # what goes down the pipe
        said = []
        final = worker.answer(req, said.append)
        yield from said
        yield final

    monkeypatch.setattr(page.chat, "stream", stream)
    tab = page.chat_tab
    values = {tab.prompt: "What is 2 plus 3?", page.attached: str(run), tab.base: [], tab.tuned: [],
              tab.max_new: 8}  # the slider's least
    refused = list(tab.do_chat({**values, tab.max_new: 10**6}))  # the API takes any number
    assert refused[-1][tab.info] == "✗ max new tokens must be in [8, 512], got 1000000 (nearest allowed: 512)"
    steps = list(tab.do_chat(values))
    # the question shows at once on both sides, before any reply; then the replies grow
    assert steps[0][tab.prompt] == "" and steps[0][tab.base][-2] == {"role": "user", "content": "What is 2 plus 3?"}
    assert steps[0][tab.base][-1]["content"] == "…" and len(steps) > 3
    assert "Answering" in steps[0][tab.info] and "Answering" not in steps[-1][tab.info]
    out = steps[-1]
    assert "error" not in out[tab.info], out[tab.info]
    assert len(sent) == 1 and sent[0]["system_prompt"] == system and sent[0]["temperature"] == 0
    assert sent[0]["adapter"] == str(run / "adapter") and sent[0]["model"]["name"] == str(tiny_model_dir)
    assert out[tab.tuned][-1]["role"] == "assistant" and out[tab.base][-1]["role"] == "assistant"
    # what the model read: the run's system turn first, in place of the template's default
    read = worker.tok.decode(worker.prompt_ids(sent[0]["messages"], sent[0]["system_prompt"]))
    assert read.index(system) < read.index("What is 2 plus 3?") and "SmolLM" not in read
    default = worker.tok.decode(worker.prompt_ids(sent[0]["messages"]))
    assert system not in default  # the system prompt reaches the model only through the request


def test_the_train_tab_shows_what_start_would_decide(page):
    """Before Start, the Train tab says what the run would decide for its `auto` settings,
    from the form as it stands (engine/planning/effective.decide, through the planner)."""
    from edgetune.engine.planning.effective import decide

    cfg = form.preset_config("sft-quickstart", str(page.runs_dir))
    values = {c: v for c, v in page.fill_from(cfg).items() if c in page.form_inputs}
    train = page.train_tab
    text = train.show_decided(values)[train.decided]
    eff = decide(cfg, "cpu")
    assert text.startswith("**Start would use:**") and "device cpu" in text
    assert f"dtype {eff.dtype}" in text and f"optimizer {eff.optimizer}" in text and "packing off" in text
    assert "gradient checkpointing off" in text  # the quick start checkpoints no layer
    assert "candidates per batch" not in text  # ESSA's alone
    essa = form.preset_config("essa-quickstart", str(page.runs_dir))
    essa_text = train.show_decided({c: v for c, v in page.fill_from(essa).items() if c in page.form_inputs})
    assert "candidates per batch" in essa_text[train.decided] and "optimizer" not in essa_text[train.decided]
    values[page.fields["sft.packing"]] = True
    assert "packing on" in train.show_decided(values)[train.decided]
    values[page.fields["sft.lr"]] = -1.0
    assert "sft.lr must be positive" in train.show_decided(values)[train.decided]


# --------------------------------------------------------------------------- the page follows the run


@pytest.fixture
def own_page(tmp_path):
    """A page on a runs folder of its own (these tests leave a run 'training')."""
    from edgetune.app.ui import build_app

    demo = build_app(tmp_path / "runs")
    yield demo.edgetune_page
    demo.edgetune_chat.close()


def _hand_run(page, name: str, preset: str, events: list[dict], alive: bool) -> "pathlib.Path":
    import os

    run = page.runs_dir / name
    run.mkdir()
    (run / "config.yaml").write_text(S.resolve(preset=preset, overrides=[f"run.runs_dir={page.runs_dir}"]).to_yaml())
    (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    if alive:  # a live process stands in for the worker
        (run / "worker.pid").write_text(str(os.getpid()))
    return run


def _append(run, *events):
    with open(run / "events.jsonl", "a") as f:
        f.write("".join(json.dumps(e) + "\n" for e in events))


def _interactive(out: dict, *buttons) -> list:
    return [out[b].interactive for b in buttons]


def test_a_reload_lands_on_the_training_run_with_its_settings_and_buttons(own_page):
    from edgetune.app.ui import fresh_page

    page, train = own_page, own_page.train_tab
    empty = fresh_page(page)
    assert page.tabs not in empty  # no run: the page opens where it always does
    assert _interactive(empty, train.start_btn, train.stop_btn, train.resume_btn) == [True, False, False]
    run = _hand_run(page, "rl", "fgrpo-quickstart", [
        _ev(0, "started", method="fgrpo", config={"fgrpo": {"steps": 32}}, device="cpu"),
        _ev(1, "phase", phase="training")], alive=True)
    out = fresh_page(page)
    assert out[page.attached] == str(run) and out[page.tabs].selected == "train"
    assert out[page.method_radio] == BY_KEY["fgrpo"].label
    assert out[page.fields["fgrpo.steps"]] == S.resolve(preset="fgrpo-quickstart").fgrpo.steps
    assert _interactive(out, train.start_btn, train.stop_btn, train.resume_btn) == [False, True, False]
    # the run stops: Stop goes grey, Resume and Start come back; a finished run has no Resume
    _append(run, _ev(2, "stopped", step=3, adapter=None, metrics={}))
    (run / "worker.pid").unlink()
    after = train.draw(str(run), out[page.seen], {})
    assert _interactive(after, train.start_btn, train.stop_btn, train.resume_btn) == [True, False, True]
    assert page.tabs not in fresh_page(page)  # nothing trains: no tab is forced
    _append(run, _ev(3, "started", method="fgrpo", config={}), _ev(4, "finished", step=32, adapter="a", metrics={}))
    done = train.draw(str(run), after[page.seen], {})
    assert _interactive(done, train.start_btn, train.stop_btn, train.resume_btn) == [True, False, False]
    # an idle page: the timer slows down, and a tick on an unchanged ended run sends nothing
    from edgetune.app.ui import IDLE_TICK_SECONDS, TICK_SECONDS

    assert out[page.timer].value == TICK_SECONDS and done[page.timer].value == IDLE_TICK_SECONDS
    assert train.draw(str(run), done[page.seen], {}) == {}
    nothing = train.draw("", {}, {})
    assert train.draw("", nothing[page.seen], {}) == {}


def test_a_resume_confirmation_stays_until_the_run_ends_again(own_page):
    page, train = own_page, own_page.train_tab
    run = _hand_run(page, "cut", "sft-quickstart", SFT_EVENTS + [
        _ev(6, "stopped", step=2, adapter="a", metrics={})], alive=False)
    said = page.said(str(run))  # what do_resume records, before its worker starts
    assert said == {"path": str(run), "n": 7}
    seen = {}
    for _ in range(3):  # ticks while the resumed worker has not written its `started` yet
        out = train.draw(str(run), seen, said)
        assert train.msg not in out
        seen = out.get(page.seen, seen)  # an unchanged run: nothing sent, the state included
    _append(run, _ev(7, "started", method="sft", config={"sft": {"steps": 10}}, resumed_from=2))
    (run / "worker.pid").write_text(str(__import__("os").getpid()))
    out = train.draw(str(run), seen, said)
    assert train.msg not in out and out[train.stop_btn].interactive
    _append(run, _ev(8, "finished", step=10, adapter="a", metrics={}))
    (run / "worker.pid").unlink()
    assert train.draw(str(run), out[page.seen], said)[train.msg] == ""


def test_opening_a_run_fills_the_form_with_its_settings(own_page):
    page = own_page
    _hand_run(page, "essa-run", "essa-quickstart", [_ev(0, "started", method="essa", config={})], alive=False)
    opened = page.runs_tab.do_open("essa-run")
    cfg = S.resolve(preset="essa-quickstart")
    assert opened[page.method_radio] == BY_KEY["essa"].label and opened[page.tabs].selected == "train"
    assert opened[page.fields["essa.population"]] == cfg.essa.population
    assert opened[page.fields["run.name"]] == ""  # a Start from them gets a name of its own
    values = {c: v for c, v in opened.items() if c in page.form_inputs}
    again = page.config(values)
    again.run.name = cfg.run.name = ""
    again.run.runs_dir = cfg.run.runs_dir
    assert again.to_dict() == cfg.to_dict()


def test_the_export_tab_says_exporting_and_advice_fits_the_state(own_page):
    page, tab = own_page, own_page.export_tab
    busy = tab.busy({tab.merged: False, tab.gguf: True})
    assert busy[tab.msg] == "Exporting GGUF files…" and not busy[tab.folder_btn].interactive
    assert tab.busy({})[tab.msg] == "Exporting the adapter…"
    assert all(b.interactive for b in tab.idle().values())
    failed = _hand_run(page, "failed", "sft-quickstart", SFT_EVENTS + [
        _ev(6, "error", message="boom", kind="bug")], alive=False)
    advice = tab.describe(str(failed))
    assert "ended without an adapter" in advice and "Resume" in advice and "let it finish" not in advice
    training = _hand_run(page, "training", "sft-quickstart", SFT_EVENTS, alive=True)
    assert "stop it or let it finish" in tab.describe(str(training))


def test_clearing_an_upload_clears_data_path_and_its_report(own_page):
    page, tab = own_page, own_page.data_tab
    page.uploads.mkdir(parents=True, exist_ok=True)
    src = page.runs_dir.parent / "mine.jsonl"
    src.write_text('{"prompt": "1+1?", "completion": "2"}\n')
    taken = tab.take_upload(str(src))
    path = taken[page.fields["data.path"]]
    assert path == str(page.uploads / "mine.jsonl")
    out = tab.drop_upload(path)
    assert out[page.fields["data.path"]] == "" and "removed" in out[tab.report]
    assert out[tab.preview].visible is False and out[tab.hist].visible is False
    typed = tab.drop_upload("embedded:arith-sft")  # a path the user typed is not the upload's to clear
    assert all(not isinstance(v, str) for v in typed.values())


def test_every_setting_shows_its_whole_help(own_page):
    long = [s for s in own_page.specs if len(s.help) > 180]
    assert long  # the help that used to be cut mid-word
    for s in long:
        assert own_page.fields[s.key].info == s.help
        assert "et-setting" in own_page.fields[s.key].elem_classes  # folded by the page's CSS until pointed at
    from edgetune.app.ui import CSS

    assert ".et-setting .info-text" in CSS and ".et-setting:hover .info-text" in CSS


def test_runs_are_renamed_deleted_to_the_trash_and_restored(own_page):
    from edgetune.engine.run import api

    page, tab = own_page, own_page.runs_tab
    run = _hand_run(page, "first", "sft-quickstart", SFT_EVENTS + [_ev(6, "stopped", step=2, adapter="a", metrics={})],
                    alive=False)
    (run / "adapter").mkdir()
    (run / "adapter" / "weights").write_text("w")
    renamed = tab.do_rename("first", "arith-v1", str(run))
    moved = page.runs_dir / "arith-v1"
    assert renamed[page.attached] == str(moved) and not run.exists()
    assert api.Run(moved).config()["run"]["name"] == "arith-v1" and (moved / "adapter" / "weights").read_text() == "w"
    assert renamed[tab.table]["run"].tolist() == ["arith-v1"] and "Renamed" in renamed[tab.msg]
    assert "give a plain folder name" in tab.do_rename("arith-v1", "../x", str(moved))[tab.msg]
    training = _hand_run(page, "busy", "sft-quickstart", SFT_EVENTS, alive=True)
    assert "stop it before you delete it" in tab.do_delete("busy", str(moved))[tab.msg]
    assert "stop it before you rename it" in tab.do_rename("busy", "other", str(moved))[tab.msg]
    assert training.is_dir()

    gone = tab.do_delete("arith-v1", str(moved))
    assert not moved.exists() and (page.runs_dir / api.TRASH / "arith-v1" / "adapter" / "weights").is_file()
    assert gone[page.attached] == str(training)  # the page lets go of it: the run training now
    assert gone[tab.trashed].choices[0][0] == "arith-v1"
    assert "arith-v1" not in gone[tab.table]["run"].tolist()
    back = tab.do_restore("arith-v1")
    assert (moved / "adapter" / "weights").read_text() == "w" and "Restored **arith-v1**" in back[tab.msg]
    assert api.trashed_runs(page.runs_dir) == []


def test_the_runs_tab_plots_chosen_runs_curves_together(own_page):
    page, tab = own_page, own_page.runs_tab
    _hand_run(page, "a", "sft-quickstart", SFT_EVENTS, alive=False)
    _hand_run(page, "b", "sft-quickstart", [dict(e, loss=e["loss"] / 2) if e["type"] == "step" else e
                                            for e in SFT_EVENTS], alive=False)
    _hand_run(page, "rl", "fgrpo-quickstart", [_ev(0, "started", method="fgrpo", config={}),
                                               _ev(1, "step", step=1, total=4, reward_mean=0.5)], alive=False)
    assert set(tab.refresh("")[tab.compare].choices) == {("a", "a"), ("b", "b"), ("rl", "rl")}
    from edgetune.engine.run import api

    out = tab.do_compare(["a", "b", "rl"], "train loss")
    assert out[tab.compare_plot].visible and out[tab.compare_plot].value is not None
    # the figure the button draws: a line per run, named; a run without the curve says so
    fig = live.compare_figure([(n, list(api.open_run(page.runs_dir / n).events())) for n in ("a", "b", "rl")],
                              "train loss")
    lines = {line.get_label(): list(line.get_ydata()) for line in fig.axes[0].lines}
    assert lines["a"] == [2.4, 2.0] and lines["b"] == [1.2, 1.0] and "rl: no train loss" in lines
    reward = live.compare_figure([("rl", [_ev(1, "step", step=1, reward_mean=0.5)])], "reward")
    assert [list(line.get_ydata()) for line in reward.axes[0].lines] == [[0.5]]
    assert "Pick the runs" in tab.do_compare([], "train loss")[tab.msg]


@pytest.mark.parametrize("preset, changes", [
    ("sft-quickstart", {}),
    ("sft-quickstart", {"sft": {"steps": 16, "packing": True}, "lora": {"target_modules": ["q_proj", "v_proj"]},
                        "data": {"system_prompt": "Answer with: true"}, "model": {"quant": "none"}}),
    ("fgrpo-quickstart", {"fgrpo": {"beta": 0.05, "reward": "math"}, "run": {"name": "my run"}}),
    ("essa-quickstart", {"essa": {"population": 8}}),
])
def test_the_cli_command_the_train_tab_shows_starts_the_same_run(tmp_path, preset, changes):
    """The command line shown beside Start, read back by the CLI's own parser: the same
    settings, whatever their type (lists, booleans, a string that looks like a boolean)."""
    import shlex

    from edgetune.engine import cli
    from edgetune.engine.cli.common import config_from

    cfg = S.resolve(preset=preset, overrides={**changes, "run": {**changes.get("run", {}),
                                                                  "runs_dir": str(tmp_path / "my runs")}})
    command = form.cli_command(cfg)
    words = shlex.split(command)
    assert words[:4] == ["edgetune", "train", "--preset", preset]
    assert words.count("--set") == sum(len(v) for k, v in changes.items() if k != "run")
    back = config_from(cli.build_parser().parse_args(words[1:]))
    assert back.to_dict() == cfg.to_dict()


def test_the_model_picker_lists_the_embedded_and_cached_models(tmp_path, monkeypatch):
    from edgetune.engine.run import api

    from edgetune.app.ui import build_app

    cache = tmp_path / "hub"
    (cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc").mkdir(parents=True)
    (cache / "models--Qwen--Qwen2.5-0.5B-Instruct" / "snapshots" / "abc" / "config.json").write_text("{}")
    (cache / "models--half--downloaded" / "snapshots" / "x").mkdir(parents=True)  # no config.json: not offered
    (cache / "datasets--some--data").mkdir()
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    assert api.known_models() == [S.EMBEDDED_MODEL, "Qwen/Qwen2.5-0.5B-Instruct"]
    demo = build_app(tmp_path / "runs")
    try:
        page = demo.edgetune_page
        box = page.fields["model.name"]
        assert [c[0] for c in box.choices] == [S.EMBEDDED_MODEL, "Qwen/Qwen2.5-0.5B-Instruct"]
        assert box.allow_custom_value  # a folder or a hub id typed in still goes
        cfg = form.preset_config("sft-quickstart", str(page.runs_dir))
        values = {c: v for c, v in page.fill_from(cfg).items() if c in page.form_inputs}
        values[box] = str(tmp_path / "my-model")
        assert page.config(values).model.name == str(tmp_path / "my-model")
    finally:
        demo.edgetune_chat.close()


def test_a_page_update_while_a_run_trains_redraws_the_plots_only_now_and_then(tmp_path, monkeypatch):
    """200 runs in the folder and one training: each event redraws the progress and the
    logs, the runs table comes from the runs folder's index (no run's files parsed again),
    and the plots, a PNG each, at most every PLOT_EVERY_S while the run trains. (What an
    update costs in time is a bench figure, not a test's.)"""
    import os

    from edgetune.engine.run import api

    from edgetune.app import tab_train
    from edgetune.app.ui import build_app

    runs = tmp_path / "runs"
    cfg = S.resolve(preset="sft-quickstart")
    steps = [{"i": s, "time": 1.0 + s, "type": "step", "step": s, "total": 1000, "loss": 1 / s} for s in range(1, 300)]
    for k in range(201):
        run = runs / f"run-{k:03d}"
        run.mkdir(parents=True)
        (run / "config.yaml").write_text(cfg.to_yaml())
        events = [{"i": 0, "time": 1.0, "type": "started", "method": "sft", "config": cfg.to_dict()}, *steps]
        (run / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))
    live_run = runs / "run-200"
    (live_run / "worker.pid").write_text(str(os.getpid()))  # a worker that lives: the run trains
    # a long interval, so a slow machine's draws never reach it by themselves; the test moves the clock
    monkeypatch.setattr(tab_train, "PLOT_EVERY_S", 3600.0)
    demo = build_app(runs)
    try:
        train = demo.edgetune_page.train_tab
        seen = demo.edgetune_page.seen
        last = train.draw(str(live_run), {}, {})
        assert train.plots[0] in last and "running" in last[train.progress]
        api.summaries(runs)  # the index is built
        parsed = []
        facts = api.Run._facts
        monkeypatch.setattr(api.Run, "_facts", lambda self: parsed.append(self.name) or facts(self))
        for k in range(5):
            with open(live_run / "events.jsonl", "a") as f:
                f.write(json.dumps({"i": 300 + k, "time": 400.0 + k, "type": "step", "step": 300 + k, "total": 1000,
                                    "loss": 0.001}) + "\n")
            out = train.draw(str(live_run), last[seen], {})
            assert f'data-step="{300 + k}"' in out[train.progress] and f"step {300 + k}/1000" in out[train.logs]
            assert train.plots[0] not in out  # drawn less than PLOT_EVERY_S ago
            last = out
        assert set(parsed) <= {"run-200"}  # only the run that moved is read again
        last[seen]["plotted"] -= tab_train.PLOT_EVERY_S
        with open(live_run / "events.jsonl", "a") as f:
            f.write(json.dumps({"i": 305, "time": 410.0, "type": "step", "step": 305, "total": 1000, "loss": 0.001})
                    + "\n")
        assert train.plots[0] in train.draw(str(live_run), last[seen], {})
    finally:
        demo.edgetune_chat.close()


def test_the_queue_section_adds_moves_cancels_and_follows_the_queued_run(own_page):
    """Add to queue keeps the form's run in the queue file; the section lists it, moves and
    cancels jobs by component, sends nothing while the queue is unchanged, and the page
    follows the queue from a queued run that ended to the one that trains now."""
    from edgetune.engine.run import queue

    page, section = own_page, own_page.train_tab.queue
    cfg = form.preset_config("sft-quickstart", str(page.runs_dir))
    values = {c: v for c, v in page.fill_from(cfg).items() if c in page.form_inputs}
    values[page.attached] = ""
    for name in ("first", "second", "third"):
        values[page.fields["run.name"]] = name
        out = section.add(values)
        assert out[section.msg].startswith("✓ Queued run **" + name) and out[page.train_tab.msg] == out[section.msg]
    assert [j["folder"] for j in queue.jobs(page.runs_dir)] == ["first", "second", "third"]
    shown = section.refresh("", "")
    assert list(shown[section.table]["run"]) == ["first", "second", "third"]
    assert section.refresh(shown[section.seen], "") == {}  # unchanged: nothing goes to the browser
    moved = section.act("job 3 · third", "up")
    assert list(moved[section.table]["run"]) == ["first", "third", "second"] and "number 2" in moved[section.msg]
    gone = section.act("job 1 · first", "cancel")
    assert list(gone[section.table]["run"]) == ["third", "second"]
    assert "job 1 · **first** cancelled" in gone[section.ended]
    assert section.act(None, "cancel")[section.msg].startswith("✗ ")
    values[page.fields["sft.lr"]] = -1.0
    assert "sft.lr must be positive" in section.add(values)[section.msg]
    # the first job has started (its folder carries its token): the page showing an ended
    # queued run follows it; one showing a run of its own choosing stays
    job = queue.jobs(page.runs_dir)[0]
    with queue.editing(page.runs_dir) as data:
        data["jobs"][0]["state"] = "started"
    done = _hand_run(page, "earlier", "sft-quickstart", [_ev(0, "started", method="sft"),
                                                         _ev(1, "finished", step=1, adapter=None, metrics={})],
                     alive=False)
    running = _hand_run(page, job["folder"], "sft-quickstart", [_ev(0, "started", method="sft")], alive=True)
    assert page.attached not in section.refresh("", str(done))
    (done / "queue-job").write_text("an earlier job's token")
    assert section.refresh("", str(done))[page.attached] == str(running)


def test_every_timer_tick_answers_what_gradio_accepts(tmp_path):
    """Each timer handler, ticked twice on a page with nothing new (the second tick sees the
    state the first wrote back), gives an answer that Gradio's own output check takes: an
    unchanged page must not answer with too few outputs (a traceback per tick in the app's
    terminal that the page never shows)."""
    import asyncio

    from gradio import skip

    from edgetune.app.ui import build_app

    demo = build_app(tmp_path / "runs")
    try:
        ticks = [fn for fn in demo.fns.values() if any(event == "tick" for _, event in fn.targets)]
        assert len(ticks) >= 2  # the Train tab's live view and its queue section, the Evaluate tab
        for fn in ticks:
            values = {c._id: c.value for c in fn.inputs}
            answers = []
            for _ in range(2):
                out = fn.fn(*[values[c._id] for c in fn.inputs])
                asyncio.run(demo.postprocess_data(fn, out, None))  # raises on a malformed answer
                answers.append(out)
                if isinstance(out, dict):
                    values.update({c._id: v for c, v in out.items() if hasattr(c, "_id") and c._id in values})
            assert answers[0] != skip(), fn.name  # the first tick draws the page
    finally:
        demo.edgetune_chat.close()


def test_an_ended_pages_event_stream_is_no_traceback_in_the_terminal():
    """uvicorn's record of Gradio's 404 for a reloaded page's stream is dropped; another
    error, a 404 elsewhere included, is still logged."""
    import logging

    from fastapi import HTTPException

    from edgetune.app.main import EndedStreams

    def record(where):
        try:
            try:
                where()
            except HTTPException as e:
                raise RuntimeError("Caught handled exception, but response already started.") from e
        except RuntimeError as e:
            return logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "Exception in ASGI application",
                                     None, (type(e), e, e.__traceback__))

    def sse_stream():
        raise HTTPException(status_code=404)

    def download():
        raise HTTPException(status_code=404)

    keep = EndedStreams().filter
    assert not keep(record(sse_stream))
    assert keep(record(download))
    assert keep(logging.LogRecord("uvicorn.error", logging.ERROR, __file__, 1, "other", None, None))


# --------------------------------------------------------------------------- a page cheap to watch, that follows the runs folder


def test_a_tick_sends_only_what_changed(own_page):
    """A training run that wrote nothing new: a tick sends its progress line alone (its
    clock moves), not the memory panel, logs, plots or runs table; an ended run sends
    nothing; a new event sends the logs and the table again."""
    import os

    page, train = own_page, own_page.train_tab
    run = _hand_run(page, "busy", "sft-quickstart", SFT_EVENTS, alive=True)
    (run / "memory.json").write_text(json.dumps({"time": 1_700_000_000, "gpu": {}, "host_rss": 2**30}))
    first = train.draw(str(run), {}, {})
    assert {train.progress, train.memory, train.logs, page.runs_tab.table, train.plots[0]} <= set(first)
    again = train.draw(str(run), first[page.seen], {})
    assert set(again) - {train.progress, page.seen} == set(), set(again)
    _append(run, _ev(6, "step", step=3, total=10, loss=1.5))
    moved = train.draw(str(run), (again.get(page.seen) or first[page.seen]), {})
    assert "step 3/10" in moved[train.logs] and train.memory not in moved and page.runs_tab.table in moved
    os.remove(run / "worker.pid")
    _append(run, _ev(7, "stopped", step=3, adapter=None, metrics={}))
    ended = train.draw(str(run), moved[page.seen], {})
    assert train.draw(str(run), ended[page.seen], {}) == {}


def test_the_page_follows_a_run_started_anywhere(own_page):
    """The page shows a stopped run; a run starts elsewhere (the command line, the queue):
    the next tick shows it, with Stop enabled; once the user opens another run while it
    trains, the page stays on the user's choice."""
    from edgetune.app.ui import tick

    page, train = own_page, own_page.train_tab
    old = _hand_run(page, "old", "sft-quickstart", SFT_EVENTS + [_ev(6, "stopped", step=2, adapter=None, metrics={})],
                    alive=False)
    first = tick(page, str(old), {}, {}, "")
    assert "old" in first[page.banner] and first[train.resume_btn].interactive
    seen = first[page.seen]
    assert tick(page, str(old), seen, {}, first[train.queue.seen]) == {}  # nothing new: nothing sent
    new = _hand_run(page, "from-the-cli", "sft-quickstart", SFT_EVENTS, alive=True)
    out = tick(page, str(old), seen, {}, first[train.queue.seen])
    assert out[page.attached] == str(new) and "from-the-cli" in out[page.banner]
    assert _interactive(out, train.start_btn, train.stop_btn, train.resume_btn) == [False, True, False]
    # the user opens the old run again while the new one trains: the page stays there
    queued = first[train.queue.seen]
    shown = tick(page, str(new), out[page.seen], {}, queued)
    back = tick(page, str(old), shown.get(page.seen, out[page.seen]), {}, queued)
    assert page.attached not in back and "old" in back[page.banner]


def test_a_reload_restores_the_users_own_form_not_the_runs(own_page):
    """The user picks a preset (the form kept in the browser) while another run trains: a
    reload shows the user's choice and says so; without a kept form, the run's settings
    and a line naming the run."""
    from edgetune.app.ui import fresh_page

    page = own_page
    _hand_run(page, "dpo-run", "dpo-quickstart", [_ev(0, "started", method="dpo", config={})], alive=True)
    picked = page.method_tab.apply_preset("sft-quickstart")
    memory = picked[page.form_memory]
    assert memory["method"] == BY_KEY["sft"].label and "preset sft-quickstart" in picked[page.form_note]
    values = {c: v for c, v in picked.items() if c in page.form_inputs}
    values[page.fields["sft.steps"]] = 7
    values[page.form_memory] = memory
    edited = page.remember(values)
    assert "changed by you" in edited[page.form_note]
    out = fresh_page(page, edited[page.form_memory])
    assert out[page.method_radio] == BY_KEY["sft"].label and out[page.fields["sft.steps"]] == 7
    assert "kept across the reload" in out[page.form_note]
    plain = fresh_page(page, {})
    assert plain[page.method_radio] == BY_KEY["dpo"].label and "run dpo-run" in plain[page.form_note]


def test_start_and_the_queue_refuse_what_the_data_check_refused(own_page):
    """The Data tab's check refused the file: Start and Add to queue answer with the same
    line before any run folder (or queue job) is made; a fixed file is taken again."""
    from edgetune.engine.run import queue

    page = own_page
    bad = page.runs_dir.parent / "bad.jsonl"
    bad.write_text('{"prompt": "1+1?", "completion": "2"}\n{"prompt": "2+2?", "completion": \n')
    cfg = form.preset_config("sft-quickstart", str(page.runs_dir))
    cfg.data.path = str(bad)
    values = {c: v for c, v in page.fill_from(cfg).items() if c in page.form_inputs}
    values[page.attached] = ""
    checked = page.data_tab.do_check(values)
    assert "cannot be used" in checked[page.data_tab.report]
    line = checked[page.data_tab.report].split("**")[1]
    started = page.train_tab.do_start(values)
    assert started[page.train_tab.msg].startswith("✗ ") and line in started[page.train_tab.msg]
    assert line in page.train_tab.queue.add(values)[page.train_tab.msg]
    assert [p for p in page.runs_dir.iterdir() if (p / "config.yaml").exists()] == []
    assert queue.jobs(page.runs_dir) == []
    bad.write_text('{"prompt": "1+1?", "completion": "2"}\n')  # fixed: no longer the refused file
    assert not page.refused(page.config(values))


def test_the_evaluate_tab_sends_nothing_while_nothing_changes(own_page):
    from edgetune.app import tab_eval

    tab = own_page.eval_tab
    first = tab.draw("", "")
    assert "No evaluation yet" in first[tab.status] and first[tab.timer].value == tab_eval.IDLE_TICK_SECONDS
    assert first[tab.diffs].visible is False  # no answers to list: no empty table
    assert tab.draw("", first[tab.drawn]) == {}
    loss_only = {"tasks": [{"task": "held-out", "metrics": ["loss"], "systems": [
        {"name": "base", "scores": {"loss": {"estimate": 1.0, "low": 0.9, "high": 1.1}}},
        {"name": "run", "scores": {"loss": {"estimate": 0.8, "low": 0.7, "high": 0.9}}}]}]}
    assert len(tab_eval.differences_frame(loss_only)) == 0


def test_runs_sort_by_creation_and_equal_curves_stay_visible(own_page):
    """A renamed run keeps its place in the Runs table (its creation time, not its folder's
    new time); two equal curves in Compare are drawn in two styles, the second named as
    the same curve as the first."""
    page, tab = own_page, own_page.runs_tab
    _hand_run(page, "older", "sft-quickstart", SFT_EVENTS, alive=False)
    _hand_run(page, "newer", "sft-quickstart", [dict(e, time=e["time"] + 100) for e in SFT_EVENTS], alive=False)
    tab.do_rename("older", "older-renamed", "")
    assert tab.frame()["run"].tolist() == ["newer", "older-renamed"]
    from edgetune.engine.run import api

    runs = [(n, list(api.open_run(page.runs_dir / n).events())) for n in ("newer", "older-renamed")]
    runs[1] = ("twin", runs[0][1])
    fig = live.compare_figure(runs, "train loss")
    a, b = fig.axes[0].lines[:2]
    assert list(a.get_ydata()) == list(b.get_ydata())
    assert (a.get_linestyle(), a.get_marker()) != (b.get_linestyle(), b.get_marker())
    assert b.get_label() == "twin (the same curve as newer)"
