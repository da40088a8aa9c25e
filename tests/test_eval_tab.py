"""The Evaluate tab's panels from an evaluation's result: the scores table with intervals, the
bar chart's bars and error bars, the comparisons in words, and the items where the systems'
answers differ, side by side."""

from edgetune.engine.run.eval_tasks import task_list

from edgetune.app import tab_eval

RESULT = {"tasks": [
    {"task": "held-out", "kind": "generative", "unit": "prompts", "metrics": ["success_rate", "reward"],
     "shares": ["success_rate"],
     "items": [{"prompt": "What is 1+1?", "reference": "2"}, {"prompt": "What is 2+2?", "reference": "4"},
               {"prompt": "What is 3+3?", "reference": "6"}],
     "systems": [
         {"name": "the base", "scores": {"success_rate": {"estimate": 1 / 3, "low": 0.06, "high": 0.79},
                                         "reward": {"estimate": 0.333, "low": 0.0, "high": 1.0}},
          "per_prompt": {"success_rate": [1, 0, 0], "reward": [1.0, 0.0, 0.0]}, "answers": ["2", "5", "7"]},
         {"name": "r", "scores": {"success_rate": {"estimate": 2 / 3, "low": 0.21, "high": 0.94},
                                  "reward": {"estimate": 0.667, "low": 0.0, "high": 1.0}},
          "per_prompt": {"success_rate": [1, 1, 0], "reward": [1.0, 1.0, 0.0]}, "answers": ["2", "4", "7"]}],
     "comparisons": [{"a": "the base", "b": "r", "metric": "success_rate",
                      "words": "the base vs r: no detectable difference on 3 prompts (p = 1)"}]},
    {"task": "held-out loss", "kind": "loss", "unit": "demonstrations", "metrics": ["loss"], "shares": [],
     "systems": [{"name": "the base", "scores": {"loss": {"estimate": 2.5, "low": 2.25, "high": 2.75}},
                  "per_prompt": {"loss": [2.5]}}],
     "comparisons": []}]}


def test_scores_table_words_and_differences():
    frame = tab_eval.scores_frame(RESULT)
    assert frame.to_dict("records")[:2] == [
        {"task": "held-out", "system": "the base", "metric": "success_rate", "score": "33.3%",
         "95% interval": "6.0% to 79.0%"},
        {"task": "held-out", "system": "the base", "metric": "reward", "score": "0.333", "95% interval": "0.000 to 1.000"}]
    assert frame.to_dict("records")[-1] == {"task": "held-out loss", "system": "the base", "metric": "loss",
                                            "score": "2.500", "95% interval": "2.250 to 2.750"}
    assert "- success_rate: the base vs r: no detectable difference" in tab_eval.comparisons_text(RESULT)
    diffs = tab_eval.differences_frame(RESULT)  # item 1 agrees, item 3 fails alike: only item 2 differs
    assert diffs.to_dict("records") == [{"task": "held-out", "item": 2, "prompt": "What is 2+2?", "reference": "4",
                                         "the base": "✗ 5", "r": "✓ 4"}]
    assert tab_eval.scores_frame(None).empty and tab_eval.differences_frame(None).empty


def test_bar_chart_has_a_bar_and_an_error_bar_per_system():
    fig = tab_eval.score_figure(RESULT)
    ax = fig.axes[0]
    assert [round(b.get_height(), 1) for b in ax.patches] == [33.3, 66.7]
    segments = ax.collections[0].get_segments()  # the error bars: from each low to each high
    assert [(round(s[0][1], 1), round(s[1][1], 1)) for s in segments] == [(6.0, 79.0), (21.0, 94.0)]
    assert ax.get_title() == "held-out: success_rate" and fig.axes[1].get_title() == "held-out loss: loss"


def test_task_list_from_the_tab_fields():
    assert task_list(True, ["a.jsonl", " ", "a.jsonl"], ["arc_easy", " lm:x.yaml", ""]) == [
        "held-out", "a.jsonl", "lm:arc_easy", "lm:x.yaml"]
    assert task_list(False, [], []) == []
