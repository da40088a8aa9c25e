"""ESSA's continuous fitness (essa.fitness: gold_logprob / gold_margin and their reward+ forms)
on a tiny random Llama with the embedded model's tokenizer, in fp32 on the CPU: the gold
answer's log-probability is what a plain forward gives, the gold margin is positive exactly
where greedy decoding writes the gold tokens, batched equals sequential, candidates that
tie on the reward are told apart, and a run's held-out evaluation stays the reward."""

import math

import numpy as np
import pytest
import torch
from inline_run import essa_start, run_inline

from edgetune.engine.core.settings import resolve

from edgetune.engine.training.rewards import build_reward

from edgetune.engine.methods.essa import essa, fitness
from edgetune.engine.methods.essa.population import Evaluator
from edgetune.engine.methods.essa.space import SVDSpace

ROWS = [{"prompt": f"What is {a} plus 2?", "answer": str(a + 2)} for a in range(3)]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """(folder with: model -> the tiny Llama, warm -> an adapter with non-zero factors, rl.jsonl)."""
    return essa_start(tmp_path_factory.mktemp("essa-fitness"), tiny_model_dir)


def config(tiny, tmp_path, **essa_overrides):
    return resolve(overrides={
        "method": "essa",
        "model": {"name": str(tiny / "model"), "quant": "none", "dtype": "fp32"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(tiny / "rl.jsonl"), "eval_fraction": 0.2},
        "run": {"runs_dir": str(tmp_path), "seed": 3, "checkpoint_every": 0},
        "essa": {"warm_start": str(tiny / "warm"), "population": 4, "generations": 3, "prompts_per_generation": 3,
                 "max_new_tokens": 4, "reward": "last_number", "eval_every": 0, "eval_prompts": 4,
                 "sigma0": 0.5, "fitness": "gold_logprob", **essa_overrides},
    })


def test_gold_logprob_is_the_plain_forward_of_prompt_and_answer(tiny, tmp_path):
    cfg = config(tiny, tmp_path)
    model, tok, _ = essa.load_model(cfg, tiny / "warm")
    batch = fitness.gold_batch(tok, ROWS, "Answer: {answer}", "", "cpu")
    got = fitness.gold_logprob(model, batch)
    from edgetune.engine.generation.rollouts import render_prompts

    for row, g in zip(ROWS, got):
        prompt = render_prompts(tok, [row["prompt"]])[0]
        gold = tok(f"Answer: {row['answer']}", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + gold])).logits[0].float()
        lp = torch.log_softmax(logits[len(prompt) - 1:-1], -1).gather(-1, torch.tensor(gold)[:, None])
        assert g == pytest.approx(float(lp.mean()), abs=1e-4)
    # Padding does not leak: one row alone scores what it scores in the batch.
    alone = fitness.gold_logprob(model, fitness.gold_batch(tok, ROWS[2:], "Answer: {answer}", "", "cpu"))
    assert alone[0] == pytest.approx(got[2], abs=1e-4)


def test_gold_margin_is_positive_exactly_where_greedy_writes_the_gold_tokens(tiny, tmp_path):
    from edgetune.engine.generation.rollouts import generate

    model, tok, _ = essa.load_model(config(tiny, tmp_path), tiny / "warm")
    roll = generate(model, tok, [r["prompt"] for r in ROWS], max_new_tokens=5, greedy=True, fast=False)
    greedy = (roll.prompt_ids, roll.prompt_mask, roll.completion_ids, roll.completion_mask)
    margins = fitness.gold_margin(model, greedy)
    assert all(m > 0 for m in margins)  # greedy's own tokens, teacher-forced: each one the argmax

    # The margin is the smallest over the tokens of the gold logit less the best other one,
    # as a plain forward of prompt + tokens gives it.
    for i in range(len(ROWS)):
        prompt = roll.prompt_ids[i][roll.prompt_mask[i].bool()].tolist()
        gold = roll.completion_ids[i][roll.completion_mask[i].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + gold])).logits[0, len(prompt) - 1:-1].float()
        top2 = logits.topk(2, -1).values
        assert margins[i] == pytest.approx(float((top2[:, 0] - top2[:, 1]).min()), abs=1e-4)

    # Change one token of each row to the runner-up: greedy no longer writes it, the margin
    # turns negative by the runner-up's gap, and the soft count falls.
    off = roll.completion_ids.clone()
    logits = model(input_ids=torch.cat([roll.prompt_ids, roll.completion_ids], 1),
                   attention_mask=torch.cat([roll.prompt_mask, roll.completion_mask], 1)).logits
    second = logits[:, roll.prompt_ids.shape[1] - 1].float().topk(2, -1).indices[:, 1]
    off[:, 0] = second
    wrong = fitness.gold_margin(model, (roll.prompt_ids, roll.prompt_mask, off, roll.completion_mask))
    assert all(m < 0 for m in wrong)
    assert fitness.combine("gold_margin", None, wrong) < 0.5 < fitness.combine("gold_margin", None, margins)
    assert fitness.combine("gold_margin", None, [-1e4, 1e4]) == 0.5  # no overflow far from the flip


@pytest.mark.parametrize("template", ["Answer: {answer}", "{answer}, so: Answer: {answer}."])
def test_gold_margin_scores_the_answer_tokens_only(tiny, tmp_path, template):
    model, tok, _ = essa.load_model(config(tiny, tmp_path), tiny / "warm")
    rows = ROWS + [{"prompt": "What is 40 plus 2?", "answer": "42"}]
    batch = fitness.gold_batch(tok, rows, template, "", "cpu")
    prompt_ids, prompt_mask, ids, mask, answer = batch
    for i, row in enumerate(rows):  # the scored tokens spell the (last) answer, nothing else
        assert tok.decode(ids[i][answer[i]].tolist()).strip() == row["answer"]
    got = fitness.gold_margin(model, batch)
    everything = fitness.gold_margin(model, batch[:4])
    for i in range(len(rows)):
        prompt = prompt_ids[i][prompt_mask[i].bool()].tolist()
        gold = ids[i][mask[i].bool()].tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + gold])).logits[0, len(prompt) - 1:-1].float()
        y = torch.tensor(gold)[:, None]
        m = logits.gather(-1, y).squeeze(-1) - logits.scatter(-1, y, -math.inf).amax(-1)
        assert got[i] == pytest.approx(float(m[answer[i][: len(gold)]].min()), abs=1e-4)
        assert everything[i] == pytest.approx(float(m.min()), abs=1e-4)


@pytest.mark.parametrize("kind", ["gold_logprob", "reward+gold_logprob", "gold_margin", "reward+gold_margin"])
def test_batched_equals_sequential_and_candidates_do_not_tie(tiny, tmp_path, kind):
    cfg = config(tiny, tmp_path, fitness=kind)
    model, tok, _ = essa.load_model(cfg, tiny / "warm")
    space = SVDSpace(model)
    reward = build_reward("last_number")
    xs = np.random.default_rng(0).normal(scale=0.05, size=(5, space.dim))
    seq = Evaluator(model, tok, space, reward, cfg.essa).population(xs, ROWS)
    cfg.essa.evaluation = "batched"
    for k in (5, 2):
        got = Evaluator(model, tok, space, reward, cfg.essa, candidates_per_batch=k).population(xs, ROWS)
        assert got == pytest.approx(seq, abs=1e-4)
    # A random tiny model never writes the right sum: every reward is 0, yet the small
    # perturbations get distinct fitnesses.
    cfg.essa.evaluation = "sequential"
    ev = Evaluator(model, tok, space, reward, cfg.essa)
    rewards = [ev.one(x, ROWS, kind="reward") for x in xs]
    assert set(rewards) == {0.0}
    assert len(set(seq)) == 5
    if kind.startswith("reward+"):  # the tie-breaker stays under one prompt's worth
        assert all(0 < f < 1 / len(ROWS) for f in seq)
    elif kind == "gold_margin":  # a soft count of rows: greedy writes no gold answer here
        assert all(0 < f < 0.5 for f in seq)
    else:
        assert all(f < 0 for f in seq)


def test_reward_comes_first_in_the_combined_fitness():
    # 2 of 3 right beats 1 of 3 right however likely the gold answers are.
    low = fitness.combine("reward+gold_logprob", [1, 1, 0], [-50.0] * 3)
    high = fitness.combine("reward+gold_logprob", [1, 0, 0], [0.0] * 3)
    assert low > high
    assert fitness.combine("reward+gold_logprob", [1, 0, 0], [-1.0] * 3) < high
    # the margin's soft count likewise: every row at a huge margin does not outrank one more right row
    assert fitness.combine("reward+gold_margin", [1, 1, 0], [-50.0] * 3) > \
        fitness.combine("reward+gold_margin", [1, 0, 0], [50.0] * 3)
    assert fitness.combine("reward+gold_margin", [1, 0, 0], [-1.0] * 3) < \
        fitness.combine("reward+gold_margin", [1, 0, 0], [1.0] * 3)
    assert fitness.combine("reward", [1, 0], None) == 0.5
    assert fitness.combine("gold_logprob", None, [-1.0, -3.0]) == -2.0
    assert math.isinf(fitness.combine("gold_logprob", None, []))


def test_a_run_ranks_by_gold_logprob_and_evaluates_the_reward(tiny, tmp_path):
    cfg = config(tiny, tmp_path)
    run, metrics, events = run_inline(essa.train, cfg, tmp_path / "run")
    assert events[-1]["type"] == "finished"
    fits = [e["fitness"] for e in events if e["type"] == "candidate"]
    assert len(fits) == 3 * 4 and all(f < 0 for f in fits) and len(set(fits)) == len(fits)
    evals = [e["reward"] for e in events if e["type"] == "eval"]
    assert evals and all(0.0 <= r <= 1.0 for r in evals)  # held-out: the reward, not the fitness
    assert metrics["best_fitness"] == max(fits)


@pytest.mark.parametrize("override, message", [
    ("essa.fitness=logprob", "essa.fitness"),
    ("essa.gold_template=Answer:", "essa.gold_template"),
])
def test_bad_fitness_settings_name_the_setting(override, message):
    from edgetune.engine.core.errors import ConfigError

    sets = [override] if "fitness" in override else [override, "essa.fitness=gold_logprob"]
    with pytest.raises(ConfigError, match=message):
        resolve(preset="essa-quickstart", overrides=sets)


class SlowTokenizer:
    """The embedded tokenizer as a slow (Python) one looks to us: no character offsets."""

    is_fast = False

    def __init__(self, tok):
        self._tok = tok

    def __getattr__(self, name):
        return getattr(self._tok, name)

    def __call__(self, *args, return_offsets_mapping=False, **kwargs):
        if return_offsets_mapping:
            raise NotImplementedError("return_offset_mapping is not available when using Python tokenizers")
        return self._tok(*args, **kwargs)


def test_gold_logprob_needs_no_offsets_and_gold_margin_refuses_a_slow_tokenizer(tiny, tmp_path, monkeypatch):
    from edgetune.engine.core.errors import ConfigError

    cfg = config(tiny, tmp_path)
    model, tok, _ = essa.load_model(cfg, tiny / "warm")
    fast = fitness.gold_batch(tok, ROWS, "Answer: {answer}", "", "cpu")
    slow = fitness.gold_batch(SlowTokenizer(tok), ROWS, "Answer: {answer}", "", "cpu", answer_tokens=False)
    for a, b in zip(fast[:4], slow[:4]):
        assert torch.equal(a, b)
    assert fitness.gold_logprob(model, slow) == pytest.approx(fitness.gold_logprob(model, fast))

    load_model, load_tok = essa.load_model, essa.model_lib.load_tokenizer
    monkeypatch.setattr(essa, "load_model", lambda *a: (lambda m, t, p: (m, SlowTokenizer(t), p))(*load_model(*a)))
    monkeypatch.setattr(essa.model_lib, "load_tokenizer", lambda path: SlowTokenizer(load_tok(path)))
    _, _, events = run_inline(essa.train, config(tiny, tmp_path / "lp"), tmp_path / "lp" / "run")
    assert events[-1]["type"] == "finished"  # gold_logprob runs on a slow tokenizer
    cfg = config(tiny, tmp_path / "m", fitness="gold_margin", warm_start="")  # refused before a warm start
    with pytest.raises(ConfigError, match="essa.fitness gold_margin needs a fast tokenizer"):
        run_inline(essa.train, cfg, tmp_path / "m" / "run")
    assert not (tmp_path / "m" / "run" / "warm_start").exists()
