"""Generate the embedded datasets (run once; the JSONL files are committed):

    python engine/assets/make_embedded.py

One-digit addition, "What is A plus B?" with A, B in 0-9: 100 distinct questions, which
SmolLM2-135M-Instruct answers right greedily only part of the time, so
RL has signal and SFT has something to teach. The 100 (A, B) pairs are split once,
with a fixed seed, into 70 train pairs and 30 held-out pairs; every train file is built
only from the 70, so no evaluation question (in any phrasing) is ever trained on.

    arith_rl_train.jsonl   70 rows  {"prompt", "answer", "a", "b"}   embedded:arith-rl
    arith_rl_eval.jsonl    30 rows  same columns, the held-out pairs (its eval split)
    arith_sft.jsonl       350 rows  {"messages": [user, assistant]}   embedded:arith-sft
                                    5 phrasings x 70 train pairs, answers end "Answer: N"
    arith_pairs.jsonl     350 rows  {"prompt", "chosen", "rejected"}  embedded:arith-pairs
                                    the SFT answer chosen over the same answer with a wrong sum
    arith_pairs_eval.jsonl 30 rows  the held-out pairs, first phrasing (its eval split)
"""

from __future__ import annotations

import json
import random
from pathlib import Path

HERE = Path(__file__).resolve().parent
SEED = 1234
N_EVAL = 30

# The RL prompt is the first phrasing, exactly as measured in DATA-NOTES.md.
PHRASINGS = [
    "What is {a} plus {b}?",
    "What is {a} + {b}?",
    "Add {a} and {b}.",
    "Compute {a} + {b}.",
    "What do you get if you add {a} and {b}?",
]


def split_pairs(seed: int = SEED) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    pairs = [(a, b) for a in range(10) for b in range(10)]
    random.Random(seed).shuffle(pairs)
    return sorted(pairs[N_EVAL:]), sorted(pairs[:N_EVAL])


def rl_rows(pairs):
    return [{"prompt": PHRASINGS[0].format(a=a, b=b), "answer": str(a + b), "a": a, "b": b} for a, b in pairs]


def sft_rows(pairs, seed: int = SEED):
    rows = []
    for a, b in pairs:
        for phrasing in PHRASINGS:
            rows.append({
                "messages": [
                    {"role": "user", "content": phrasing.format(a=a, b=b)},
                    {"role": "assistant", "content": f"{a} + {b} = {a + b}. Answer: {a + b}"},
                ]
            })
    # Mixed order, so that a short run or a fractional eval split sees every phrasing.
    random.Random(seed).shuffle(rows)
    return rows


def pair_rows(pairs, phrasings, seed: int = SEED):
    """A correct answer chosen over a wrong one: the same words with a sum off by 1 or 2."""
    rng = random.Random(seed)
    rows = []
    for a, b in pairs:
        for phrasing in phrasings:
            wrong = a + b + rng.choice([d for d in (-2, -1, 1, 2) if a + b + d >= 0])
            rows.append({"prompt": phrasing.format(a=a, b=b),
                         "chosen": f"{a} + {b} = {a + b}. Answer: {a + b}",
                         "rejected": f"{a} + {b} = {wrong}. Answer: {wrong}"})
    rng.shuffle(rows)
    return rows


def write_jsonl(path: Path, rows) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> None:
    train, held_out = split_pairs()
    write_jsonl(HERE / "arith_rl_train.jsonl", rl_rows(train))
    write_jsonl(HERE / "arith_rl_eval.jsonl", rl_rows(held_out))
    write_jsonl(HERE / "arith_sft.jsonl", sft_rows(train))
    write_jsonl(HERE / "arith_pairs.jsonl", pair_rows(train, PHRASINGS))
    write_jsonl(HERE / "arith_pairs_eval.jsonl", pair_rows(held_out, PHRASINGS[:1]))
    print(f"{len(train)} train pairs, {len(held_out)} held-out pairs -> {HERE}")


if __name__ == "__main__":
    main()
