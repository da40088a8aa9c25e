"""The one way a prompt becomes what the model reads before its reply.

SFT data (the text before each assistant turn, whose tokens are masked out of the loss),
RL rows (prompt lengths as the rollouts will see them), the rollouts and the chat panel
all render through here, so a model answers in training, in evaluation and in the app
the prompt it was trained on.

A prompt is a string (one user turn) or a list of chat messages ({"role", "content"}).
- With a chat template: `data.system_prompt` is put first when given and the messages
  have no system turn of their own; the template is applied with the generation prompt;
  the text is tokenised without special tokens (the template writes its own BOS/markup).
- Without one (a base model): a string is the text as written (as SFT joins a
  prompt/completion row: the user's own text decides the join), messages are their
  contents each followed by a newline (as SFT joins a messages row); the tokenizer adds
  its own special tokens (a BOS for Llama-like ones). There is no place for a system
  prompt: it is not used.

Imports no torch.
"""

from __future__ import annotations


def has_template(tok) -> bool:
    return bool(getattr(tok, "chat_template", None))


def with_system(messages: list[dict], system_prompt: str = "") -> list[dict]:
    """`messages` with a system turn first: `system_prompt`, unless they have their own."""
    if system_prompt and not (messages and messages[0].get("role") == "system"):
        return [{"role": "system", "content": system_prompt}] + list(messages)
    return list(messages)


def conversation(prompt, system_prompt: str = "") -> list[dict]:
    """A prompt as chat messages, with the system prompt where it goes."""
    msgs = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else list(prompt)
    return with_system(msgs, system_prompt)


def apply_template(tok, messages: list[dict], generation_prompt: bool) -> str:
    """The tokenizer's chat template over `messages`, as text (the one call of it)."""
    return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)


def prompt_text(tok, prompt, system_prompt: str = "") -> str:
    """The text the model reads before its reply to `prompt` (see the module docstring)."""
    if has_template(tok):
        return apply_template(tok, conversation(prompt, system_prompt), True)
    if isinstance(prompt, str):
        return prompt
    return "".join(f"{m['content']}\n" for m in prompt)


def encode(tok, texts: list[str], special: bool, chunk: int = 4096) -> list[list[int]]:
    """Token ids of many texts, a few thousand per tokenizer call (a fast tokenizer's
    per-call overhead is most of its cost on short texts). A fast tokenizer with no
    truncation or padding of its own is asked for the ids alone (`encode_batch_fast`: no
    offsets or attention masks built and thrown away), which is most of a data check's
    time; the ids are those `tok(texts)` gives."""
    backend = getattr(tok, "backend_tokenizer", None)
    fast = getattr(backend, "encode_batch_fast", None)
    if fast is not None and (backend.truncation is not None or backend.padding is not None):
        fast = None  # tok(...) switches these off for the call; the backend would apply them
    out: list[list[int]] = []
    for i in range(0, len(texts), chunk):
        part = texts[i : i + chunk]
        if fast is not None:
            out += [e.ids for e in fast(part, add_special_tokens=special)]
        else:
            out += [list(ids) for ids in tok(part, add_special_tokens=special)["input_ids"]]
    return out


def prompt_ids(tok, prompts: list, system_prompt: str = "") -> list[list[int]]:
    """Token ids of each prompt, ready for the model's reply."""
    texts = [prompt_text(tok, p, system_prompt) for p in prompts]
    return encode(tok, texts, special=not has_template(tok))
