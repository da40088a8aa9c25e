"""SFT rows: conversations rendered with the tokenizer's chat template (engine/data/prompts.py),
tokenised, and labelled so that only the replies are targets.

Formats (detected from the columns, or forced with `data.format`):

    messages            {"messages": [{"role", "content"}, ...]}
    alpaca              {"instruction", "input"?, "output"}
    prompt_completion   {"prompt", "completion"}         (prompt may be a list of messages)
    text                {"text"}                          every token is a target
    rl                  {"prompt", "answer", ...extra}    SFT on the bare answer

SFT masking: only the content of assistant turns (and the end-of-turn token that closes
each) is a target; everything else has label -100. The boundaries come from rendering
prefixes of the conversation with the tokenizer's own chat template
(`add_generation_prompt=True` for the prompt side) and checking that each prefix's
tokens are a prefix of the whole conversation's tokens. This costs 2 extra renders and
tokenizations per assistant turn, but it works for any template without knowing its
markup, and a template that breaks the prefix property is reported instead of silently
training on the wrong tokens. Rows are rendered and their texts tokenized CHUNK_ROWS at
a time, in one batched call per chunk (per-row calls are several times slower), so memory
stays bounded on large files. Rendering grows with the square of a row's turns.

Memory: a JSONL file is read line by line and its rows tokenised CHUNK_ROWS at a time, so
what stays is the tokenised rows: Python lists of ints that share one int object per token
id (about 16 bytes per token, ids and labels), which is fine for the datasets a one-GPU
fine-tune uses (up to tens of millions of tokens); `collate`
pads per batch to the batch's longest row, not to max_seq_len, so short batches stay
cheap, and the padding rows it leaves are exactly the zero-gradient rows SEBP skips.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from edgetune.engine.core.errors import DataError
from edgetune.engine.core.settings import DataSettings

from edgetune.engine.data import prompts
from edgetune.engine.data.files import (
    CHUNK_ROWS,
    FORMATS,
    Progress,
    ValidationReport,
    eval_source,
    format_for,
    iter_rows,
    length_stats,
    messages_cell,
    split_rows,
    text_cell,
)

IGNORE = -100
DROP_LONG = "longer than max_seq_len"
DROP_NO_TARGET = "no target tokens left after truncation"


@dataclass
class SFTExample:
    input_ids: list[int]
    labels: list[int]  # IGNORE (-100) on everything that is not a target


@dataclass
class SFTData:
    train: list[SFTExample]
    eval: list[SFTExample]
    report: ValidationReport


# --------------------------------------------------------------------------- rows as conversations


def _conversation(row: dict, fmt: str, file: str, n: int, system_prompt: str) -> list[dict] | None:
    """A row as a conversation (None for `text` rows)."""
    if fmt == "text":
        return None
    if fmt == "messages":
        msgs = messages_cell(row.get("messages"), "messages", file, n)
    elif fmt == "alpaca":
        instruction = text_cell(row, "instruction", file, n)
        inp = text_cell(row, "input", file, n, required=False)
        user = f"{instruction}\n\n{inp}" if inp.strip() else instruction
        msgs = [{"role": "user", "content": user},
                {"role": "assistant", "content": text_cell(row, "output", file, n)}]
    elif fmt in ("prompt_completion", "rl"):
        # SFT on rl rows trains on the bare answer as the completion.
        target_col = "completion" if fmt == "prompt_completion" else "answer"
        prompt = row.get("prompt")
        if isinstance(prompt, list):
            msgs = messages_cell(prompt, "prompt", file, n)
        else:
            msgs = [{"role": "user", "content": text_cell(row, "prompt", file, n)}]
        completion = row.get(target_col)
        if isinstance(completion, list):
            msgs += messages_cell(completion, target_col, file, n)
        else:
            msgs.append({"role": "assistant", "content": text_cell(row, target_col, file, n)})
    else:
        raise DataError(f"unknown format '{fmt}' (known: {', '.join(FORMATS)})", file=file)
    msgs = prompts.with_system(msgs, system_prompt)
    assistant = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    if not assistant:
        raise DataError("no assistant turn: nothing to learn from", file=file, row=n)
    if assistant[0] == 0:
        raise DataError("the conversation starts with an assistant turn; it needs a user turn first",
                        file=file, row=n)
    if not any(msgs[i]["content"].strip() for i in assistant):
        raise DataError("the target (assistant reply / output / completion) is empty", file=file, row=n)
    return msgs[: assistant[-1] + 1]  # turns after the last reply teach nothing


# --------------------------------------------------------------------------- tokenizing


def _encode(tok, texts: list[str], special: bool = False) -> list[list[int]]:
    """Token ids of many texts (engine/data/prompts.encode: batched calls). `special=False`
    because templates write their own BOS/markup."""
    return prompts.encode(tok, texts, special)


def _render(tok, msgs, generation_prompt: bool, file: str, n: int) -> str:
    try:
        return prompts.apply_template(tok, msgs, generation_prompt)
    except Exception as e:  # jinja raises its own errors for conversations a template refuses
        raise DataError(f"the tokenizer's chat template cannot render this conversation: {e}",
                        file=file, row=n) from None


def _chat_texts(tok, msgs: list[dict], file: str, n: int) -> list[str]:
    """The whole conversation, then for each assistant turn: the text before its reply
    (with the generation prompt) and the text through its reply."""
    texts = [_render(tok, msgs, False, file, n)]
    for i, m in enumerate(msgs):
        if m["role"] == "assistant":
            # through the last turn is the whole conversation, rendered already
            through = texts[0] if i == len(msgs) - 1 else _render(tok, msgs[: i + 1], False, file, n)
            texts += [_render(tok, msgs[:i], True, file, n), through]
    return texts


def _chat_labels(tok, msgs: list[dict], ids: list[list[int]], file: str, n: int) -> tuple[list[int], list[int]]:
    """Tokens and labels from `_chat_texts`' token ids; see module docstring."""
    full = ids[0]
    labels = [IGNORE] * len(full)
    eos = tok.eos_token_id
    turns = [i for i, m in enumerate(msgs) if m["role"] == "assistant"]
    for k, i in enumerate(turns):
        before, through = ids[1 + 2 * k], ids[2 + 2 * k]
        if full[: len(before)] != before or full[: len(through)] != through:
            raise DataError(
                f"the tokenizer's chat template does not render turn {i + 1} as a prefix of the whole "
                "conversation, so the prompt cannot be masked exactly; use a tokenizer with a "
                "prefix-consistent template or data.format=text",
                file=file, row=n,
            )
        start, end = len(before), len(through)
        # Keep the end-of-turn token as a target (the model must learn to stop), but not
        # the template's separator after it (e.g. the "\n" after <|im_end|>).
        span = full[start:end]
        if eos is not None and eos in span:
            end = start + len(span) - span[::-1].index(eos)
        labels[start:end] = full[start:end]
    return full, labels


def _plain_texts(msgs: list[dict], sep: str) -> list[str]:
    """No chat template: each turn's text; `sep` follows each non-assistant turn: "" for
    prompt/completion rows (the user's own text decides the join, as base-model data
    does), "\n" for rows that come as turns."""
    return [m["content"] if m["role"] == "assistant" else m["content"] + sep for m in msgs]


def _plain_labels(tok, msgs: list[dict], ids: list[list[int]], lead: list[int]) -> tuple[list[int], list[int]]:
    """lead + prompt + completion + eos; only the completion (and its eos) is a target."""
    tokens, labels = list(lead), [IGNORE] * len(lead)
    eos = [tok.eos_token_id] if tok.eos_token_id is not None else []
    for m, t in zip(msgs, ids):
        if m["role"] == "assistant":
            tokens += t + eos
            labels += t + eos
        else:
            tokens += t
            labels += [IGNORE] * len(t)
    return tokens, labels


def _text_labels(tok, ids: list[int]) -> tuple[list[int], list[int]]:
    # `ids` carry the tokenizer's own BOS, if it adds one. End with eos so the model
    # learns to stop (unless the tokenizer already added it).
    if tok.eos_token_id is not None and (not ids or ids[-1] != tok.eos_token_id):
        ids = ids + [tok.eos_token_id]
    return ids, list(ids)


def tokenize_rows(rows, fmt, tok, ds: DataSettings, file: str, stats: dict,
                  progress: Progress | None = None, keep=None) -> list[SFTExample]:
    """Check every row and label its tokens, CHUNK_ROWS rows at a time (each chunk's texts
    are tokenised in one call); `rows` may be an iterator, read as it goes. `keep`: what
    is kept of each example (a check keeps its length: memory bounded by the rows' count,
    not their tokens)."""
    chat = prompts.has_template(tok)
    sep = "" if fmt in ("prompt_completion", "rl") else "\n"
    # Whatever the tokenizer itself puts first (a BOS for Llama-like ones, nothing for many).
    lead = [t for t in tok("")["input_ids"] if t != tok.eos_token_id]
    # One int object per token id across all rows: a list of ids then costs 8 bytes a token
    # (the reference) instead of 36 (a fresh int each), most of a tokenised dataset's memory.
    ids_seen: dict[int, int] = {}
    out: list[SFTExample] = []
    chunk: list[tuple[int, dict]] = []
    for n, row in enumerate(rows, start=1):
        chunk.append((n, row))
        if len(chunk) == CHUNK_ROWS:
            done = _tokenize_chunk(chunk, fmt, tok, ds, file, stats, chat, sep, lead, ids_seen)
            out += done if keep is None else map(keep, done)
            chunk = []
            if progress is not None:
                progress.rows(stats["total"])
    done = _tokenize_chunk(chunk, fmt, tok, ds, file, stats, chat, sep, lead, ids_seen)
    out += done if keep is None else map(keep, done)
    if progress is not None:
        progress.rows(stats["total"], final=True)
    return out


def _tokenize_chunk(chunk, fmt, tok, ds, file, stats, chat, sep, lead, ids_seen) -> list[SFTExample]:
    """Check a chunk's rows and render their texts, tokenize all texts at once, then label."""
    prepared = []  # (row number, conversation or None for text rows, texts)
    for n, row in chunk:
        if fmt == "text":
            text = text_cell(row, "text", file, n)
            if not text.strip():
                raise DataError("'text' is empty", file=file, row=n)
            prepared.append((n, None, [text]))
        else:
            # without a chat template there is no place for a system prompt (engine/data/prompts.py)
            msgs = _conversation(row, fmt, file, n, ds.system_prompt if chat else "")
            prepared.append((n, msgs, _chat_texts(tok, msgs, file, n) if chat else _plain_texts(msgs, sep)))
    # A row's last "through" prefix is usually its whole text: encode each text once.
    unique = list(dict.fromkeys(t for _, _, texts in prepared for t in texts))
    encoded = {t: [ids_seen.setdefault(i, i) for i in ids]
               for t, ids in zip(unique, _encode(tok, unique, special=fmt == "text"))}
    del unique

    out = []
    for n, msgs, texts in prepared:
        stats["total"] += 1
        ids = [encoded[t] for t in texts]
        if msgs is None:
            ids, labels = _text_labels(tok, ids[0])
        elif chat:
            ids, labels = _chat_labels(tok, msgs, ids, file, n)
        else:
            ids, labels = _plain_labels(tok, msgs, ids, lead)
        if all(x == IGNORE for x in labels):
            raise DataError("no target tokens (the target is empty after tokenizing)", file=file, row=n)
        if len(ids) > ds.max_seq_len:
            if ds.overlong == "drop":
                stats["dropped"][DROP_LONG] = stats["dropped"].get(DROP_LONG, 0) + 1
                continue
            ids, labels = ids[: ds.max_seq_len], labels[: ds.max_seq_len]
            # Only positions 1.. are predicted (labels shift by one inside the model).
            if all(x == IGNORE for x in labels[1:]):
                stats["dropped"][DROP_NO_TARGET] = stats["dropped"].get(DROP_NO_TARGET, 0) + 1
                continue
            stats["truncated"] += 1
        out.append(SFTExample(ids, labels))
    return out


# --------------------------------------------------------------------------- loading


def load_sft(ds: DataSettings, tokenizer, seed: int, progress=None, lengths_only: bool = False) -> SFTData:
    """Read, check and tokenize SFT data; split train/eval; report what happened.
    `progress(rows, bytes_read, bytes_total)` hears how far a long file got (Progress).
    `lengths_only`: a check (`edgetune data`): train and eval hold each row's token count,
    not its tokens, so memory stays small whatever the file's size."""
    reading = Progress(progress)
    rows, fmt = rows_and_format(ds.path, ds, ds.max_rows, reading)
    stats = {"total": 0, "dropped": {}, "truncated": 0}
    keep = _length if lengths_only else None
    examples = tokenize_rows(rows, fmt, tokenizer, ds, ds.path, stats, reading, keep)
    eval_file = eval_source(ds)
    if eval_file:
        eval_rows, eval_fmt = rows_and_format(eval_file, ds)
        train, evals = examples, tokenize_rows(eval_rows, eval_fmt, tokenizer, ds, eval_file, stats, keep=keep)
    else:
        train, evals = split_rows(examples, ds.eval_fraction, seed)
    if not train:
        raise DataError(f"no rows left to train on after checking {stats['total']} "
                        f"({', '.join(f'{n} {r}' for r, n in stats['dropped'].items())})", file=ds.path)
    lengths, hist = length_stats([e if lengths_only else len(e.input_ids) for e in train + evals])
    report = ValidationReport(
        file=ds.path, format=fmt, rows_total=stats["total"], rows_kept=len(train) + len(evals),
        dropped=stats["dropped"], truncated=stats["truncated"], token_lengths=lengths, histogram=hist,
        train_rows=len(train), eval_rows=len(evals), eval_file=eval_file,
    )
    return SFTData(train, evals, report)


def _length(example: SFTExample) -> int:
    return len(example.input_ids)


def rows_and_format(path: str, ds: DataSettings, max_rows: int = 0, progress: Progress | None = None):
    """(an iterator over the file's rows, their format from the first row)."""
    rows = iter_rows(path, max_rows, progress)
    first = next(rows)
    return itertools.chain([first], rows), format_for([first], ds, path)


def collate(examples: list[SFTExample], pad_id: int) -> dict:
    """Right-pad to the batch's longest row; padding gets attention 0 and label -100."""
    import torch

    width = max(len(e.input_ids) for e in examples)
    ids = torch.full((len(examples), width), pad_id, dtype=torch.long)
    labels = torch.full((len(examples), width), IGNORE, dtype=torch.long)
    mask = torch.zeros((len(examples), width), dtype=torch.long)
    for i, e in enumerate(examples):
        n = len(e.input_ids)
        ids[i, :n] = torch.tensor(e.input_ids, dtype=torch.long)
        labels[i, :n] = torch.tensor(e.labels, dtype=torch.long)
        mask[i, :n] = 1
    return {"input_ids": ids, "attention_mask": mask, "labels": labels}
