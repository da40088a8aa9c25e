"""`edgetune eval --task lm:...`: EleutherAI's lm-evaluation-harness run on the engine's own
loaded model (the 4-bit base, and the base with a trained adapter), offline, on a small
multiple-choice task and a small generative task whose YAML files point at local JSONL files
the test writes. Each item's harness score equals the engine's own grading of the same item:
the choice the engine's log-likelihoods prefer, and the engine's greedy completion graded by
its `exact` reward."""

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("lm_eval")

sys.path.insert(0, str(Path(__file__).parent / "helpers"))

from inline_run import run_inline, sft_config  # noqa: E402

MC = [{"question": "2 + 2 =", "choices": ["3", "4", "5"], "label": 1},
      {"question": "3 + 5 =", "choices": ["8", "7", "9"], "label": 0},
      {"question": "1 + 1 =", "choices": ["1", "3", "2"], "label": 2},
      {"question": "6 - 2 =", "choices": ["4", "2", "8"], "label": 0},
      {"question": "9 - 4 =", "choices": ["6", "3", "5"], "label": 2}]
QUESTIONS = ["What is 2 + 3?", "What is 7 - 4?", "What is 5 + 1?", "What is 8 - 8?"]
NEW_TOKENS = 4


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _yaml_files(folder: Path, gen_rows: list[dict]) -> None:
    _jsonl(folder / "mc.jsonl", MC)
    _jsonl(folder / "gen.jsonl", gen_rows)
    (folder / "tiny_mc.yaml").write_text(f"""task: tiny_mc
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'mc.jsonl'}
test_split: test
output_type: multiple_choice
doc_to_text: "{{{{question}}}}"
doc_to_choice: "{{{{choices}}}}"
doc_to_target: label
metric_list:
  - metric: acc
""")
    (folder / "tiny_gen.yaml").write_text(f"""task: tiny_gen
dataset_path: json
dataset_kwargs:
  data_files:
    test: {folder / 'gen.jsonl'}
test_split: test
output_type: generate_until
doc_to_text: "{{{{prompt}}}}"
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
generation_kwargs:
  until: []
  max_gen_toks: {NEW_TOKENS}
  do_sample: false
metric_list:
  - metric: exact_match
    regexes_to_ignore: ["^\\\\s+", "\\\\s+$"]
""")


def _engine_choice(model, tok, context: str, choices: list[str]) -> int:
    """The choice the engine's own log-likelihoods prefer: the sum of log p of its tokens
    right after the rendered prompt (a chat template's turn ends the prompt: the harness
    puts no delimiter before the choice, and counts the prompt's trailing whitespace with
    the choice), the engine's labelled rows."""
    import torch

    from edgetune.engine.training.lm_loss import labelled_logprobs

    scores = []
    stem = context.rstrip()
    for choice in choices:
        ctx = tok(stem, add_special_tokens=False)["input_ids"]
        whole = tok(context + choice, add_special_tokens=False)["input_ids"]
        ids = torch.tensor([whole])
        labels = torch.tensor([[-100] * len(ctx) + whole[len(ctx):]])
        with torch.no_grad():
            sums, _ = labelled_logprobs(model, {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                                                "labels": labels})
        scores.append(sums.item())
    return max(range(len(choices)), key=scores.__getitem__)


def test_harness_tasks_from_local_files_score_as_the_engines_own_grader(tiny_model_dir, tmp_path, monkeypatch):
    from edgetune.engine.core.settings import resolve

    from edgetune.engine.training import grading

    from edgetune.engine.methods.sft import sft

    from edgetune.engine.run import evaluation

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    run, _, _ = run_inline(sft.train, sft_config(tiny_model_dir, tmp_path, sft={"lr": 1e-2, "steps": 2}),
                           tmp_path / "sft")
    cfg = resolve(preset="fgrpo-quickstart", overrides=[
        f"model.name={tiny_model_dir}", "model.quant=nf4", f"fgrpo.max_new_tokens={NEW_TOKENS}", "fgrpo.eval_k=0",
        "fgrpo.reward=exact"])
    systems = evaluation.system_names([str(run.path)], base=True)
    # The engine's own grading of the generative items: a task file of the same prompts. The
    # first two answers are the base's own greedy completions, so some items are right.
    plain = _jsonl(tmp_path / "plain.jsonl", [{"prompt": q, "answer": "x"} for q in QUESTIONS])
    (own,) = evaluation.compare(cfg, systems[:1], [str(plain)])["tasks"]
    gen_rows = [{"prompt": q, "answer": a.strip() if i < 2 else "x"}
                for i, (q, a) in enumerate(zip(QUESTIONS, own["systems"][0]["answers"]))]
    assert all(r["answer"] for r in gen_rows[:2])
    folder = tmp_path / "tasks"
    folder.mkdir()
    _yaml_files(folder, gen_rows)
    task_file = _jsonl(tmp_path / "gen-engine.jsonl", gen_rows)

    out = evaluation.compare(cfg, systems, [f"lm:{folder}", str(task_file)])
    by_task = {t["task"]: t for t in out["tasks"]}
    assert set(by_task) == {"lm:tiny_mc", "lm:tiny_gen", str(task_file)}
    mc, gen, engine_gen = by_task["lm:tiny_mc"], by_task["lm:tiny_gen"], by_task[str(task_file)]
    assert mc["kind"] == gen["kind"] == "harness" and mc["prompts"] == 5 and gen["prompts"] == 4

    # generative: the harness's exact_match of each item is the engine's `exact` success
    for h, e in zip(gen["systems"], engine_gen["systems"]):
        assert h["per_prompt"]["exact_match"] == e["per_prompt"]["success_rate"]
        assert [a.strip() for a in h["answers"]] == [a.strip() for a in e["answers"]]
        assert h["scores"]["exact_match"] == pytest.approx(e["scores"]["success_rate"])  # Wilson on both
    assert gen["systems"][0]["per_prompt"]["exact_match"][:2] == [1, 1]

    # multiple choice: the harness's acc of each item is the engine's own log-likelihood choice
    for system, (name, path) in zip(mc["systems"], systems):
        model, tok, _ = grading.eval_model(cfg, path)
        contexts = [it["prompt"] for it in mc["items"]]
        mine = [int(_engine_choice(model, tok, c, x["choices"]) == x["label"]) for c, x in zip(contexts, MC)]
        assert system["per_prompt"]["acc"] == mine, name
        assert system["scores"]["acc"]["estimate"] == sum(mine) / 5
    assert [it["reference"] for it in mc["items"]] == ["4", "8", "2", "4", "5"]
    assert "2 + 2 =" in mc["items"][0]["prompt"] and "<|im_start|>assistant" in mc["items"][0]["prompt"]
    assert [(c["a"], c["b"], c["metric"]) for c in mc["comparisons"]] == [("the base", str(run.path), "acc")]


def test_a_harness_task_whose_data_is_missing_offline_is_one_line(tmp_path, monkeypatch, capsys):
    from edgetune.engine.core.errors import ConfigError

    from edgetune.engine.run import harness

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty-cache"))
    (tmp_path / "t.yaml").write_text("task: nowhere\ndataset_path: json\ndataset_kwargs:\n  data_files:\n"
                                     f"    test: {tmp_path / 'gone.jsonl'}\ntest_split: test\n"
                                     "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    with pytest.raises(ConfigError) as e:
        harness.load_tasks(f"lm:{tmp_path / 't.yaml'}")
    line = str(e.value)
    assert "\n" not in line and line.startswith(f"lm:{tmp_path / 't.yaml'}: its data could not be loaded")
    assert "download the dataset json" in line
    from edgetune.engine import cli  # the command says the same line, before loading a model

    assert cli.main(["eval", "--preset", "fgrpo-quickstart", "--base", "--task", f"lm:{tmp_path / 't.yaml'}"]) == 2
    assert capsys.readouterr().err.strip() == f"error: {line}"
    with pytest.raises(ConfigError, match=r"lm:no_such_task_anywhere: no harness task no_such_task_anywhere"):
        harness.load_tasks("lm:no_such_task_anywhere")


def test_a_harness_task_yaml_that_runs_python_through_include_is_refused_without_allow_code(tmp_path, capsys):
    from edgetune.engine.core.errors import ConfigError

    from edgetune.engine.run import harness

    marker = tmp_path / "RAN"
    (tmp_path / "shared").mkdir()
    (tmp_path / "shared" / "utils.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n"
                                                  "def docs(dataset):\n    return dataset\n")
    (tmp_path / "shared" / "common.yaml").write_text("process_docs: !function utils.docs\n")
    (tmp_path / "mine").mkdir()
    task = tmp_path / "mine" / "t.yaml"
    task.write_text(f"include: ../shared/common.yaml\ntask: planted\ndataset_path: json\ndataset_kwargs:\n"
                    f"  data_files:\n    test: {tmp_path / 'rows.jsonl'}\ntest_split: test\n"
                    "output_type: generate_until\ndoc_to_text: '{{q}}'\ndoc_to_target: '{{a}}'\n")
    _jsonl(tmp_path / "rows.jsonl", [{"q": "1+1=", "a": "2"}])
    from edgetune.engine import cli

    assert cli.main(["eval", "--preset", "fgrpo-quickstart", "--base", "--task", f"lm:{task}"]) == 2
    line = capsys.readouterr().err.strip()
    assert line == (f"error: {tmp_path / 'shared' / 'common.yaml'}: `!function utils.docs` runs the Python file "
                    f"{tmp_path / 'shared' / 'utils.py'} when the harness loads task lm:{task}; if you trust it, add "
                    f"--allow-code {task}")
    assert not marker.exists()
    with pytest.raises(ConfigError, match="runs the Python file"):
        harness.confirm_code([f"lm:{tmp_path / 'mine'}"])  # the folder, too
    harness.confirm_code([f"lm:{task}"], [str(task)])  # named: it may run
    harness.confirm_code([f"lm:{task}"], [str(tmp_path / "shared" / "utils.py")])
    assert harness.code_it_runs("lm:arc_easy") == []  # a shipped task
