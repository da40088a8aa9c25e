"""One prompt renderer (engine/data/prompts.py): SFT data, RL rows, the rollouts and the chat
panel give the model the same tokens for the same messages, with and without a chat
template, with and without data.system_prompt."""

import copy
import json

import pytest

from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data import prompts

from edgetune.engine.generation.chat import _Chat
from edgetune.engine.generation.rollouts import render_prompts

from edgetune.engine import data as D

CONVERSATIONS = [
    "What is 2 plus 3?",
    [{"role": "user", "content": "What is 2 plus 3?"}],
    [{"role": "system", "content": "Its own system turn."}, {"role": "user", "content": "Hi"},
     {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "What is 7 times 6?"}],
]


@pytest.fixture(scope="module", params=["template", "plain"])
def tok(request):
    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    t = load_tokenizer(str(embedded_model_dir()))
    if request.param == "plain":  # a base model's tokenizer: no chat template
        t = copy.deepcopy(t)
        t.chat_template = None
    return t


def _last_target_start(labels: list[int]) -> int:
    """Where the last run of target tokens (the final reply) starts."""
    i = len(labels)
    while i > 0 and labels[i - 1] == D.IGNORE:
        i -= 1
    while i > 0 and labels[i - 1] != D.IGNORE:
        i -= 1
    return i


@pytest.mark.parametrize("system", ["", "Answer with digits only."])
@pytest.mark.parametrize("which", range(len(CONVERSATIONS)))
def test_data_rollouts_and_chat_render_the_same_prompt(tok, tmp_path, system, which):
    prompt = CONVERSATIONS[which]
    messages = prompts.conversation(prompt)
    expected = prompts.prompt_ids(tok, [prompt], system)[0]
    assert len(expected) > 3

    # rollouts (F-GRPO, ESSA, evaluation)
    assert render_prompts(tok, [prompt], system)[0] == expected
    # the chat panel, given the messages of the conversation (the same prompt as a string:
    # the same text with a template; without one a string is the text as written, as in
    # prompt/completion rows, and turns end in a newline, as in messages rows)
    chat = _Chat()
    chat.tok = tok
    as_turns = prompts.prompt_ids(tok, [messages], system)[0]
    assert chat.prompt_ids(messages, system) == as_turns
    if prompts.has_template(tok):
        assert as_turns == expected
    # RL rows: the prompt length the data report counts and max_seq_len checks
    rl = tmp_path / "rl.jsonl"
    rl.write_text(json.dumps({"prompt": prompt, "answer": "5"}) + "\n")
    report = D.load_rl(DataSettings(path=str(rl), system_prompt=system, eval_fraction=0), 0, tok).report
    assert report.token_lengths["min"] == report.token_lengths["max"] == len(expected)
    # SFT: the tokens before the final reply, which the loss masks, are the same prompt
    # (without a template the turns are tokenised one by one: compare single-turn rows there)
    if prompts.has_template(tok) or isinstance(prompt, str) or len(prompt) == 1:
        sft = tmp_path / "sft.jsonl"
        row = {"prompt": prompt, "completion": "5"} if isinstance(prompt, str) else \
            {"messages": messages + [{"role": "assistant", "content": "5"}]}
        sft.write_text(json.dumps(row) + "\n")
        ex = D.load_sft(DataSettings(path=str(sft), system_prompt=system, eval_fraction=0), tok, 0).train[0]
        start = _last_target_start(ex.labels)
        assert ex.input_ids[:start] == expected
        assert tok.decode(ex.input_ids[start:]).startswith("5")


def test_the_system_prompt_goes_first_only_where_there_is_none(tok):
    own = CONVERSATIONS[2]
    assert prompts.prompt_ids(tok, [own], "Another.")[0] == prompts.prompt_ids(tok, [own])[0]
    text = prompts.prompt_text(tok, "Hi", "Be brief.")
    if prompts.has_template(tok):
        assert text.index("Be brief.") < text.index("Hi")
    else:  # nowhere to put it without a template: the text as written
        assert text == "Hi"


TEXTS = ["", "What is 2 plus 3?", "<|im_start|>user\nHi<|im_end|>\n", "café  naïve\t\u00a0ünïcödé 数学 🙂",
         " leading and trailing spaces ", "a" * 3000, "\n\n\n", "x<|im_end|>y<|im_start|>z"]


@pytest.mark.parametrize("special", [False, True])
def test_encode_gives_the_ids_of_the_tokenizer_call(tok, special):
    """The ids-only fast path (encode_batch_fast) is the tokenizer's own call, id for id."""
    assert prompts.encode(tok, TEXTS, special) == [list(x) for x in tok(TEXTS, add_special_tokens=special)["input_ids"]]
    assert prompts.encode(tok, TEXTS, special, chunk=3) == prompts.encode(tok, TEXTS, special)


def test_encode_ignores_a_truncation_the_tokenizer_file_sets(tok):
    """A tokenizer.json may switch truncation on for its backend; tok(...) switches it off for
    the call, and so must encode: nothing is cut at 4 tokens here."""
    t = copy.deepcopy(tok)
    t.backend_tokenizer.enable_truncation(max_length=4)
    ids = prompts.encode(t, TEXTS, False)
    assert ids == prompts.encode(tok, TEXTS, False) and max(len(x) for x in ids) > 4
