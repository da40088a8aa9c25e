"""`edgetune eval` on several tasks: a user's task file (JSONL, CSV, Parquet; prompt + answer or
chat rows) graded by the engine's rewards next to the held-out split, on the same loaded
systems; bad task files refused in one line naming the file and the row."""

import json
import re

import pytest

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings, resolve

from edgetune.engine.data import task_rows


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_task_rows_read_prompt_answer_chat_and_prompt_completion_rows(tmp_path):
    ds = DataSettings()
    rl = task_rows(_jsonl(tmp_path / "a.jsonl", [{"prompt": "2+2?", "answer": 4}, {"prompt": "3+3?", "answer": "6"}]),
                   ds)
    assert [(r["prompt"], r["answer"]) for r in rl] == [("2+2?", "4"), ("3+3?", "6")]
    chat = task_rows(_jsonl(tmp_path / "c.jsonl", [{"messages": [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+5?"},
        {"role": "assistant", "content": "7"}]}]), ds)
    assert chat[0]["prompt"] == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2+5?"}]
    assert chat[0]["answer"] == "7"
    pc = task_rows(_jsonl(tmp_path / "p.jsonl", [{"prompt": "1+1?", "completion": "2"}]), ds)
    assert (pc[0]["prompt"], pc[0]["answer"]) == ("1+1?", "2")
    (tmp_path / "t.csv").write_text("prompt,answer\n9-3?,6\n")
    assert [(r["prompt"], r["answer"]) for r in task_rows(str(tmp_path / "t.csv"), ds)] == [("9-3?", "6")]
    import pandas as pd

    pd.DataFrame({"prompt": ["5*5?"], "answer": ["25"]}).to_parquet(tmp_path / "t.parquet")
    assert [(r["prompt"], r["answer"]) for r in task_rows(str(tmp_path / "t.parquet"), ds)] == [("5*5?", "25")]


@pytest.mark.parametrize("rows, needle", [
    ([{"prompt": "a", "answer": "1"}, {"prompt": "b", "answer": ""}], "row 2: 'answer' is empty"),
    ([{"prompt": "a", "answer": "1"}, {"prompt": "", "answer": "2"}], "row 2: 'prompt' is empty"),
    ([{"messages": [{"role": "user", "content": "hi"}]}],
     "row 1: the last message must be the assistant's answer"),
    ([{"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "x"}]}],
     "row 1: no user message before the answer"),
    ([{"text": "just text"}], "a task file needs rows of prompt + answer, prompt + completion or chat messages"),
])
def test_a_bad_task_file_is_named_with_its_row(tmp_path, rows, needle):
    path = _jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(DataError) as e:
        task_rows(path, DataSettings())
    assert needle in str(e.value) and str(e.value).count("\n") == 0 and "bad.jsonl" in str(e.value)


def test_a_task_file_is_graded_by_the_reward_next_to_the_held_out_split(tmp_path, tiny_model_dir, capsys,
                                                                        monkeypatch):
    """The base graded on the held-out split and a task file in one load. The random tiny
    model answers nothing right, so a second task file whose first two answers are its own
    greedy completions (graded `exact`) scores exactly those two: the grading is the reward's."""
    from edgetune.engine import cli

    rows = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(1, 5)]
    task = _jsonl(tmp_path / "sums.jsonl", rows)
    args = ["eval", "--preset", "fgrpo-quickstart", "--base", "--task", "held-out", "--task", task, "--json"]
    for s in (f"model.name={tiny_model_dir}", "model.quant=none", "fgrpo.eval_prompts=3", "fgrpo.max_new_tokens=4",
              "fgrpo.eval_k=0", "fgrpo.reward=exact"):
        args += ["--set", s]
    monkeypatch.chdir(tmp_path)
    assert cli.main(args) == 0
    held, mine = json.loads(capsys.readouterr().out)["tasks"]
    assert (held["task"], held["prompts"], mine["task"], mine["prompts"]) == ("held-out", 3, task, 4)
    assert mine["kind"] == "generative" and mine["reward_fn"] == "exact"
    assert [it["reference"] for it in mine["items"]] == ["2", "4", "6", "8"]
    assert "What is 3 + 3?" in mine["items"][2]["prompt"]  # the prompt as the model read it (chat template)
    (base,) = mine["systems"]
    assert base["per_prompt"]["success_rate"] == [0, 0, 0, 0] and len(base["answers"]) == 4
    own = [{**r, "answer": a} if i < 2 else r for i, (r, a) in enumerate(zip(rows, base["answers"]))]
    assert all(a.strip() for a in base["answers"][:2])
    task2 = _jsonl(tmp_path / "own.jsonl", own)
    assert cli.main([*args[:7], task2, *args[8:]]) == 0
    held2, mine2 = json.loads(capsys.readouterr().out)["tasks"]
    assert mine2["systems"][0]["per_prompt"]["success_rate"] == [1, 1, 0, 0]
    assert mine2["systems"][0]["scores"]["success_rate"]["estimate"] == 0.5
    assert held2["systems"][0]["per_prompt"] == held["systems"][0]["per_prompt"]  # fixed seed, same prompts
    assert cli.main([a for a in [*args[:7], task2, *args[8:]] if a != "--json"]) == 0  # the table: one a task
    table = capsys.readouterr().out
    assert "held-out: 3 prompts, graded by exact; each score with its 95% interval" in table
    assert f"{task2}: 4 prompts, graded by exact; each score with its 95% interval" in table
    assert re.search(r"^the base\s+50\.0% \[15\.0, 85\.0\]\s+0\.500 ", table, re.M), table


def test_eval_refuses_a_bad_task_file_before_loading(tmp_path, capsys):
    from edgetune.engine import cli

    bad = _jsonl(tmp_path / "bad.jsonl", [{"prompt": "a", "answer": "1"}, {"prompt": "b"}])
    assert cli.main(["eval", "--preset", "fgrpo-quickstart", "--base", "--task", bad]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"error: {bad}, row 2: missing 'answer' (columns: ['prompt'])", err


def test_a_task_file_is_graded_by_the_methods_own_grading_not_another_methods():
    """Each method's settings say how its runs are graded: an SFT or DPO config grades a task
    file with GradingSettings' defaults whatever its fgrpo group says; F-GRPO and ESSA with
    their own reward and lengths."""
    from edgetune.engine.core.settings import GradingSettings

    from edgetune.engine.training import grading

    for preset in ("sft-quickstart", "dpo-quickstart"):
        cfg = resolve(preset=preset, overrides=["fgrpo.reward=math", "fgrpo.max_new_tokens=7"])
        assert grading.grading_settings(cfg) == GradingSettings()
    fg = grading.grading_settings(resolve(preset="fgrpo-quickstart", overrides=["fgrpo.reward=math",
                                                                                "fgrpo.eval_k=2"]))
    assert (fg.reward, fg.eval_k) == ("math", 2)
    es = grading.grading_settings(resolve(preset="essa-quickstart", overrides=["essa.reward=exact",
                                                                               "fgrpo.reward=math"]))
    assert (es.reward, es.eval_k) == ("exact", GradingSettings().eval_k)


def test_sft_held_out_loss_per_demonstration_and_the_adapter_against_the_base(tiny_model_dir, tmp_path):
    """An SFT config's held-out split is scored by each demonstration's mean token loss (the
    loss SFT trains on, computed here one demonstration at a time as a check); a run trained
    on the same data has a lower held-out loss than the base, and the paired bootstrap says so."""
    import sys
    from pathlib import Path

    import torch

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from inline_run import run_inline, sft_config

    from edgetune.engine.training import grading
    from edgetune.engine.training.lm_loss import causal_lm_loss

    from edgetune.engine.methods.sft import sft

    from edgetune.engine.run import evaluation

    from edgetune.engine import data as data_lib

    cfg = sft_config(tiny_model_dir, tmp_path, model={"quant": "none"}, data={"eval_fraction": 0.2},
                     sft={"lr": 1e-2, "steps": 6})
    run, _, _ = run_inline(sft.train, cfg, tmp_path / "r")
    (out,) = evaluation.compare(cfg, evaluation.system_names([str(run.path)], base=True))["tasks"]
    assert (out["task"], out["kind"], out["metrics"], out["unit"]) == ("held-out", "loss", ["loss"], "demonstrations")
    base, adapter = out["systems"]
    model, tok, _ = grading.eval_model(cfg, "")
    examples = data_lib.load_sft(cfg.data, tok, cfg.run.seed).eval
    assert out["prompts"] == len(examples) == len(base["per_prompt"]["loss"]) > 5
    with torch.no_grad():
        one_by_one = [causal_lm_loss(model, data_lib.collate([ex], tok.pad_token_id))[0].item() for ex in examples]
    assert base["per_prompt"]["loss"] == pytest.approx(one_by_one, rel=1e-4)
    assert base["scores"]["loss"]["estimate"] == pytest.approx(sum(one_by_one) / len(one_by_one), rel=1e-4)
    assert adapter["scores"]["loss"]["high"] < base["scores"]["loss"]["low"]  # trained: clearly lower
    (c,) = out["comparisons"]
    assert (c["a"], c["b"], c["metric"], c["kind"]) == ("the base", str(run.path), "loss", "mean")
    assert c["difference"] < 0 and c["high"] < 0 and c["p_value"] < 0.05
    assert c["words"].startswith(f"{run.path} is better than the base by ")


def test_held_out_of_a_method_without_reward_or_demonstrations_is_refused_in_one_line():
    from edgetune.engine.core.errors import ConfigError

    from edgetune.engine.run import evaluation

    with pytest.raises(ConfigError, match=r"DPO runs have no held-out split `edgetune eval` can grade .*--task FILE"):
        evaluation.check_tasks(resolve(preset="dpo-quickstart"), ["held-out"])
