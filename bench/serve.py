#!/usr/bin/env python3
"""Serving several adapters at once: requests per second and tokens per second of
`edgetune serve`'s decode loop (engine/generation/batcher.py) for 1, 4 and 16 concurrent
streams, each stream a request for one of 4 LoRA adapters (r 8 on q, k, v, o; random
non-zero factors), greedy, --tokens new tokens each; against the same requests served one
after another (each waits for the one before it: one adapter at a time, as a server without
per-row adapters would).

    python bench/serve.py --out bench/results/<date>-cpu/serve     # the embedded SmolLM2-135M, NF4
    python bench/serve.py --tiny                                    # a tiny random Llama, for the test

The loop is timed in-process (no HTTP: the sockets' share is nothing beside a decode step);
the end-of-sequence token does not end a request early (--tokens each, always).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import threading
import time
from pathlib import Path

import _common as C  # noqa: E402, F401  (edgetune importable from this checkout)
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true", help="a tiny random Llama, few tokens: checks the script")
ap.add_argument("--streams", default="1,4,16", help="concurrent streams, comma list")
ap.add_argument("--adapters", type=int, default=4)
ap.add_argument("--tokens", type=int, default=0, help="new tokens a request (default 16; tiny 6)")
ap.add_argument("--quant", default="nf4")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

PROMPTS = ["Write a short poem about the sea.", "What is the capital of France?", "Explain what a prime number is.",
           "Give me three tips for learning to cook.", "Why is the sky blue?", "Tell me a joke about computers.",
           "How do plants make food?", "Name four planets of the solar system."]


def tiny_model(root: Path) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    tok = load_tokenizer(str(embedded_model_dir()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(root / "tiny")
    tok.save_pretrained(root / "tiny")
    return str(root / "tiny")


def make_adapters(path: str, root: Path, k: int) -> list[Path]:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    out = []
    for i in range(k):
        torch.manual_seed(i)
        model = get_peft_model(AutoModelForCausalLM.from_pretrained(path),
                               LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"],
                                          init_lora_weights=False))
        model.save_pretrained(root / f"adapter{i}")
        out.append(root / f"adapter{i}")
    return out


def serve(batcher, asks: list[tuple[str, list[int]]], tokens: int, together: bool) -> tuple[float, int]:
    """(seconds, completion tokens) of the requests `asks`, all at once or one after another."""
    from edgetune.engine.generation.batcher import Job

    eos = batcher.eos
    batcher.eos = -1  # every request decodes `tokens` tokens
    done, used = [], []

    def job(adapter, prompt):
        ended = threading.Event()

        def emit(ev):
            if ev["type"] == "done":
                used.append(ev["usage"]["completion_tokens"])
            if ev["type"] in ("done", "error"):
                ended.set()
        done.append(ended)
        return Job(adapter, [prompt], emit, max_tokens=tokens)

    t0 = time.perf_counter()
    try:
        if together:
            jobs = [job(a, p) for a, p in asks]
            batcher.call(lambda: [batcher.submit(j) for j in jobs])  # all waiting when the loop admits
            for e in done:
                e.wait()
        else:
            for a, p in asks:
                batcher.submit(job(a, p))
                done[-1].wait()
    finally:
        batcher.eos = eos
    return time.perf_counter() - t0, sum(used)


def machine() -> dict:
    model = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                  if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else ""
    return {"cpu": model, "cores": os.cpu_count(), "torch_threads": torch.get_num_threads(),
            "load_average_1_5_15": [round(x, 2) for x in os.getloadavg()],
            "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None}


def main() -> None:
    from edgetune.engine.core.settings import EMBEDDED_MODEL, ModelSettings

    from edgetune.engine.data.prompts import prompt_ids

    from edgetune.engine.models.model import load_base

    from edgetune.engine.generation.batcher import Batcher

    tokens = args.tokens or (6 if args.tiny else 16)
    root = Path(tempfile.mkdtemp(prefix="bench-serve-"))
    name = tiny_model(root) if args.tiny else EMBEDDED_MODEL
    model, tok, path = load_base(ModelSettings(name=name, quant="none" if args.tiny else args.quant))
    streams = [int(s) for s in args.streams.split(",")]
    batcher = Batcher(model.eval(), tok, max_rows=max(streams))
    names = []
    for i, folder in enumerate(make_adapters(path, root, args.adapters)):
        batcher.add_adapter(f"adapter{i}", folder)
        names.append(f"adapter{i}")
    prompts = prompt_ids(tok, PROMPTS)
    serve(batcher, [(names[0], prompts[0])], 2, True)  # warm-up
    before = machine()
    rows = []
    for c in streams:
        asks = [(names[i % len(names)], prompts[i % len(prompts)]) for i in range(c)]
        row = {"streams": c}
        for how, together in (("batched", True), ("one_after_another", False)):
            seconds, used = serve(batcher, asks, tokens, together)
            row[how] = {"seconds": round(seconds, 2), "tokens": used, "requests_per_s": round(c / seconds, 3),
                        "tokens_per_s": round(used / seconds, 1)}
        row["speedup"] = round(row["one_after_another"]["seconds"] / row["batched"]["seconds"], 2)
        rows.append(row)
        print(json.dumps(row), flush=True)
    batcher.close()
    result = {"model": "tiny random Llama" if args.tiny else f"{EMBEDDED_MODEL} ({args.quant})",
              "adapters": args.adapters, "tokens_per_request": tokens, "rows": rows,
              "machine_before": before, "machine_after": machine()}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve.json").write_text(json.dumps(result, indent=2) + "\n")
    lines = [f"{result['model']}, {args.adapters} adapters (a stream each, in turn), {tokens} new tokens a request, "
             "greedy", "",
             "| streams | batched: req/s | batched: tokens/s | one after another: req/s | one after another: tokens/s "
             "| speed-up |", "|---|---|---|---|---|---|"]
    for r in rows:
        b, s = r["batched"], r["one_after_another"]
        lines.append(f"| {r['streams']} | {b['requests_per_s']} | {b['tokens_per_s']} | {s['requests_per_s']} | "
                     f"{s['tokens_per_s']} | {r['speedup']}x |")
    (out / "serve.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
