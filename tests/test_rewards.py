import pytest

from edgetune.engine.core.errors import ConfigError

from edgetune.engine.training.rewards import build_reward, extract_for_grader, numbers


def rows(*answers, **extra):
    return [{"prompt": "q", "answer": a, **extra} for a in answers]


def test_last_number():
    fn = build_reward("last_number")
    texts = ["3 plus 4 is 7.", "It is 7, no wait 8", "seven", "The sum 10-3 = 7", "-4", "1,000 apples", "7.0"]
    r, err = fn(texts, rows("7", "7", "7", "7", "-4", "1000", "7"))
    assert r == [1.0, 0.0, 0.0, 1.0, 1.0, 1.0, 1.0]
    assert err == [None] * 7
    assert numbers("10-3 and \u22122.5") == [10, 3, -2.5]


def test_last_number_non_numeric_gold_is_an_error_not_a_crash():
    r, err = build_reward("last_number")(["7"], rows("seven"))
    assert r == [0.0] and "not a number" in err[0]


def test_exact_and_normalized():
    texts = [" Paris ", "paris.", "The  City of\nParis", "Paris is it"]
    golds = rows("Paris", "Paris", "the city of paris.", "Paris")
    assert build_reward("exact")(texts, golds)[0] == [1.0, 0.0, 0.0, 0.0]
    assert build_reward("normalized")(texts, golds)[0] == [1.0, 1.0, 1.0, 0.0]


def test_math_verify():
    texts = ["so the result is $\\frac{1}{2}$", "\\boxed{0.5}", "it is 3", "x = 12"]
    r, err = build_reward("math")(texts, rows("0.5", "1/2", "4", "12"))
    assert r == [1.0, 1.0, 0.0, 1.0]


def test_answer_format_needs_eos():
    fn = build_reward("answer_format")
    texts = ["3+4 = 7\nAnswer: 7", "Answer: 7", "the answer is 7", "Answer:"]
    r, _ = fn(texts, rows("7", "7", "7", "7"), truncated=[False, True, False, False])
    assert r == [1.0, 0.0, 0.0, 0.0]


def test_weighted_sum_and_success():
    fn = build_reward({"last_number": 1.0, "answer_format": 0.5})
    texts = ["Answer: 7", "Answer: 8", "7", "Answer: 7"]
    s = fn.score(texts, rows("7", "7", "7", "7"), truncated=[False, False, False, True])
    assert s.rewards == [1.5, 0.5, 1.0, 1.0]
    assert s.success == [True, False, False, False]
    assert fn.best == 1.5
    # A numeric threshold counts the weighted sum instead.
    assert fn.score(texts, rows("7", "7", "7", "7"), threshold=1.0).success == [True, False, True, True]


def test_length_penalty_is_shaping():
    fn = build_reward({"last_number": 1.0, "length_penalty:100": 0.1})
    s = fn.score(["x" * 50 + " 7", "x" * 500 + " 8"], rows("7", "7"))
    assert s.rewards[0] == pytest.approx(1.0 - 0.1 * 52 / 100)
    assert s.rewards[1] == pytest.approx(-0.1)
    assert s.success == [True, False]  # the penalty does not make a right answer a failure


def test_reasoning_gym_full_credit_only():
    fn = build_reward("rg:chain_sum")
    golds = rows("-4", "-4", "-4", "-4", metadata={})
    texts = ["<answer>-4</answer>", "4 - 1 - 7 = -4", "Answer: -4.", "the answer -4 appears in -40"]
    r, err = fn(texts, golds)
    assert r == [1.0, 1.0, 1.0, 0.0]
    # reasoning-gym's own grader would give partial credit to a text containing the gold:
    import reasoning_gym

    raw = reasoning_gym.get_score_answer_fn("chain_sum")("so -4 then", {"answer": "-4", "metadata": {}})
    assert 0 < raw < 1
    assert extract_for_grader("so -4 then", "-4") == "-4"


def test_unknown_names_suggest():
    with pytest.raises(ConfigError, match="last_number"):
        build_reward("last_numbr")
    with pytest.raises(ConfigError, match="chain_sum"):
        build_reward("rg:chain_sun")


def test_user_file(tmp_path):
    f = tmp_path / "my_reward.py"
    f.write_text(
        "def reward(completion, answer, row):\n"
        "    if 'boom' in completion:\n"
        "        raise RuntimeError('exploded on purpose')\n"
        "    if 'nan' in completion:\n"
        "        return float('nan')\n"
        "    return 0.25 * len(completion) + (row['bonus'] if answer == '7' else 0)\n"
    )
    fn = build_reward("file", str(f))
    r, err = fn(["ab", "boom", "nan", "abcd"], rows("7", "7", "7", "8", bonus=1.0))
    assert r == [1.5, 0.0, 0.0, 1.0]
    assert err[0] is None and err[3] is None
    assert "RuntimeError: exploded on purpose" in err[1]
    assert "nan" in err[2]
    # Mixed with a built-in, by weight.
    fn2 = build_reward({"file": 2.0, "last_number": 1.0}, str(f))
    assert fn2(["7"], rows("7", bonus=0.0))[0] == [2 * 0.25 + 1.0]


def test_user_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="nope.py"):
        build_reward("file", str(tmp_path / "nope.py"))
    bad = tmp_path / "bad.py"
    bad.write_text("def score(c, a, r):\n    return 1.0\n")
    with pytest.raises(ConfigError, match=r"bad.py.*reward"):
        build_reward("file", str(bad))
    broken = tmp_path / "broken.py"
    broken.write_text("def reward(c, a, r)\n    return 1.0\n")
    with pytest.raises(ConfigError, match="broken.py"):
        build_reward("file", str(broken))
    with pytest.raises(ConfigError, match="reward_file"):
        build_reward("file")
    with pytest.raises(ConfigError, match="does not use it"):
        build_reward("last_number", str(bad))


def test_length_penalty_scale_must_be_positive():
    with pytest.raises(ConfigError, match="positive"):
        build_reward("length_penalty:0")
    assert build_reward("length_penalty")(["x" * 256], rows("1"))[0] == [-0.5]


def test_a_reward_failures_reason_is_shortened_at_a_word_never_mid_word():
    from edgetune.engine.training.reward_worker import one_line

    long = "ValueError: could not convert the completion to a number " + "because of its words " * 30
    short = one_line(long + "\nsecond line", 120)
    assert len(short) <= 120 and short.endswith(" …") and long.startswith(short[:-2])
    assert long[len(short) - 2] == " " or long[len(short) - 3] in ",;:"  # cut where a word ends
    assert one_line("KeyError: 'answer'\nTraceback ...") == "KeyError: 'answer'"
