#!/usr/bin/env python3
"""The memory planner (engine/planning/planner.py) against measured peaks on the GPU.

Measured here, on the Qwen2.5-0.5B architecture (NF4, built layer by layer by the
reference baseline's builder, engine.models.model.add_lora r=16 on all 7 projections,
checkpointing): SFT at two sizes (4 x 512 and 16 x 2,048 tokens, the engine's step),
an F-GRPO rollout (8 prompts x 8 completions, 128 + 256 tokens, engine/generation/rollouts'
plain KV-cache loop) and an F-GRPO-shaped update (16 rows, loss on the completions), and
an ESSA sequential evaluation (32 prompts, 128 + 64 tokens, inference only).
Collected from the other benches' JSON in the same output folder(s) when present:
the 7B SFT rows of sft_speed.json (padded 8 x 1,024; packed 1 x 4,340), the 72B rows of
big72b.json (1 x 2,048, engine as is and with bf16 frozen parameters; 1 x 32,768 with
activation offload), and ESSA's sequential / batched peaks of essa.json (7B, r=8 on
q, k, v, o, bf16 frozen parameters: that bench builds its own adapter).

Compared: the planner's `allocated_peak` (tensors only: what
torch.cuda.max_memory_allocated sees) with the measured peak; for the rollout, update and
ESSA rows the matching parts of the plan (see `predicted_parts`). Target: within 15%.

    python bench/planner_check.py --tiny        # CPU: runs every measurement, no peaks
    PYTHONPATH=$PWD/.gpu-site python bench/planner_check.py [--from DIR ...]
Writes $OUT/planner_check.json and prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import _common as C  # noqa: E402
import torch

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true")
ap.add_argument("--ref", default=str(C.ROOT / "bench" / "reference"))
ap.add_argument("--from", dest="sources", action="append", default=[],
                help="folder holding sft_speed.json / big72b.json / essa.json (default: --out)")
ap.add_argument("--collect-only", action="store_true", help="no measurements: plan the other benches' rows (CPU)")
ap.add_argument("--time-limit", type=float, default=200.0)
ap.add_argument("--out", default=os.environ.get("OUT", "."))
args = ap.parse_known_args()[0]

T0 = time.perf_counter()
B = C.load_baseline(args.ref)
DEV = B.DEV
OUT = Path(args.out)
OUT.mkdir(parents=True, exist_ok=True)
R: dict = {"rows": [], "errors": {}, "notes": [], "tiny": args.tiny}


def log(*a):
    print(f"[planner_check {time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def dump():
    C.write_json(OUT / "planner_check.json", R)


def left():
    return args.time_limit - (time.perf_counter() - T0)


class IdTokenizer:
    """Token-id prompts in, ids out; EOS -1 never comes, so every row runs to the end."""

    eos_token_id = -1
    pad_token_id = 0
    chat_template = None

    def batch_decode(self, rows, skip_special_tokens=True):
        return [" ".join(map(str, r)) for r in rows]


def part_sum(plan: dict, keys) -> int:
    return int(sum(plan[k] for k in keys))


def add(name, plan, measured, keys=None, note=""):
    row = C.compare(name, plan, measured)
    if keys is not None:
        pred = part_sum(plan, keys)
        row.update(predicted=pred, predicted_GiB=C.gib(pred), predicted_parts=list(keys))
        if measured:
            row["error"] = round(pred / measured - 1, 3)
    if note:
        row["note"] = note
    R["rows"].append(row)
    log(f"{name}: predicted {row['predicted_GiB']} GiB, measured {row['measured_GiB']} GiB, "
        f"error {row.get('error')}")
    dump()


def measure(name, fn):
    if left() < 15:
        R["notes"].append(f"{name} skipped: time")
        return
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        import traceback

        R["errors"][name] = f"{type(e).__name__}: {e}"[:1500]
        traceback.print_exc()
        dump()


def own_measurements():
    from edgetune.engine.core.settings import LoraSettings

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.generation.rollouts import generate

    from edgetune.engine.training.loop import make_optimizer

    arch = B.C05B
    folder = C.arch_folder(arch)
    C.reset_peak()
    base, secs = B.build_model(arch, quant=True)
    model = model_lib.add_lora(base, LoraSettings(r=16, alpha=32, dropout=0.0, target_modules=list(C.TARGETS)),
                               gradient_checkpointing=True)
    log(f"0.5B built in {secs:.1f}s")
    vocab = arch["vocab_size"]
    g = torch.Generator().manual_seed(0)
    scale = 16 if args.tiny else 1  # tiny: shorter sequences, same code

    def padded_batch(rows, seq):
        """Full rows but the last one 10% padded: several rows come padded in practice,
        and the planner plans for the mask that padding brings (k/v repeated for sdpa)."""
        ids = torch.randint(3, vocab, (rows, seq), generator=g)
        mask = torch.ones_like(ids)
        mask[-1, seq - seq // 10:] = 0
        return {"input_ids": ids.to(DEV), "attention_mask": mask.to(DEV),
                "labels": ids.masked_fill(mask == 0, -100).to(DEV)}

    # -- SFT at two sizes
    for rows, seq in ((4, 512 // scale), (16, 2048 // scale)):
        def sft(rows=rows, seq=seq):
            batch = padded_batch(rows, seq)
            model.train()
            opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, DEV)
            C.reset_peak()
            C.time_steps(lambda: C.engine_step(model, opt, batch), 1, 1, log)
            # engine_step runs the engine's step without Liger (the worker's sft.train adds it)
            plan = C.planner_prediction(folder, "sft", [f"sft.batch_size={rows}", f"data.max_seq_len={seq}",
                                                        "model.liger=off"])
            add(f"0.5B SFT {rows} x {seq}", plan, C.peak())
            del opt
            model.zero_grad(set_to_none=True)
        measure(f"sft_{rows}x{seq}", sft)

    # -- F-GRPO: rollout, then an update-shaped step
    pps, G, prompt, new, mb = 8, 8, 128 // scale, 256 // scale, 16
    sets = [f"fgrpo.prompts_per_step={pps}", f"fgrpo.num_generations={G}", f"fgrpo.max_new_tokens={new}",
            f"fgrpo.micro_batch_size={mb}", f"data.max_seq_len={prompt}"]
    prompts = torch.randint(3, vocab, (pps, prompt), generator=g).tolist()

    def rollout():
        C.reset_peak()
        with torch.no_grad():
            out = generate(model, IdTokenizer(), prompts, num_generations=G, max_new_tokens=new, seed=0, fast=False)
        assert out.completion_ids.shape == (pps * G, new)
        plan = C.planner_prediction(folder, "fgrpo", sets)
        add(f"0.5B F-GRPO rollout {pps}x{G} rows, {prompt}+{new}", plan, C.peak(),
            keys=("weights", "lora", "rollout_kv_cache", "rollout_prefill"), note="plain decode loop")

    def update():
        batch = padded_batch(mb, prompt + new)
        batch["labels"][:, :prompt] = -100  # loss on completion tokens only, as F-GRPO's log-probs
        model.train()
        opt = make_optimizer(model.parameters(), "auto", 1e-4, 0.0, DEV)
        C.reset_peak()
        C.time_steps(lambda: C.engine_step(model, opt, batch), 1, 1, log)
        plan = C.planner_prediction(folder, "fgrpo", sets)
        add(f"0.5B F-GRPO update {mb} x {prompt + new}", plan, C.peak(),
            keys=("weights", "lora", "lora_grads", "update_activations", "update_transient"))
        del opt
        model.zero_grad(set_to_none=True)

    measure("fgrpo_rollout", rollout)
    measure("fgrpo_update", update)

    # -- ESSA sequential: one candidate's evaluation is inference on P prompts
    P, new_e = 32, 64 // scale

    def essa():
        C.reset_peak()
        ps = torch.randint(3, vocab, (P, prompt), generator=g).tolist()
        with torch.no_grad():
            generate(model, IdTokenizer(), ps, max_new_tokens=new_e, greedy=True, fast=False)
        plan = C.planner_prediction(folder, "essa", [f"essa.prompts_per_generation={P}",
                                                     f"essa.max_new_tokens={new_e}", f"data.max_seq_len={prompt}",
                                                     "essa.warm_start=given", "essa.evaluation=sequential"])
        add(f"0.5B ESSA sequential {P} prompts, {prompt}+{new_e}", plan, C.peak(),
            note="planner counts the SVD space (2 adapters) that this measurement lacks")

    measure("essa_sequential", essa)


def collected():
    sources = [Path(p) for p in (args.sources or [args.out])]
    for src in sources:
        f = src / "planner_check.json"
        if args.collect_only and f.is_file() and src.resolve() != OUT.resolve():
            R["rows"] += [r for r in json.loads(f.read_text()).get("rows", []) if "source" not in r]
        # the SFT benches' measured rows, re-planned with the planner as it is now
        for fname, key, size in (("sft_speed.json", "ours", "7B"), ("big72b.json", "rows", "72B")):
            f = src / fname
            if not f.is_file():
                continue
            r = json.loads(f.read_text())
            arch = dict(r["config"]["arch"])
            if r.get("layers"):
                arch["num_hidden_layers"] = r["layers"]
            folder = C.arch_folder(arch)
            n = 0
            for name, m in r.get(key, {}).items():
                sets = C.sft_row_settings(fname.split(".")[0], name, r["config"])
                if sets is None or not m.get("peak_alloc"):
                    continue
                row = C.compare(f"{size} SFT {name}", C.planner_prediction(folder, "sft", sets), m["peak_alloc"])
                row["source"] = f"{src.name}/{fname}"
                R["rows"].append(row)
                n += 1
            log(f"{n} rows from {f}")
        f = src / "essa.json"
        if f.is_file():
            e = json.loads(f.read_text())
            st, arch = e.get("settings", {}), e.get("arch") or {}
            if not arch.get("hidden_size"):
                continue
            folder = C.arch_folder(arch)
            for mode in ("sequential", "batched"):
                m = e.get(mode)
                if not m:
                    continue
                k = m.get("k", 1)
                sets = [f"essa.prompts_per_generation={st['prompts']}", f"essa.max_new_tokens={st['new_tokens']}",
                        f"data.max_seq_len={st['prompt_len']}", "essa.warm_start=given", f"lora.r={st['rank']}",
                        "lora.target_modules=[q_proj,k_proj,v_proj,o_proj]", f"essa.evaluation={mode}",
                        f"essa.candidates_per_batch={k}", f"essa.population={st['population']}"]
                plan = C.planner_prediction(folder, "essa", sets)
                measured = int(m["peak_gib"] * C.GiB) if m.get("peak_gib") else None
                row = C.compare(f"7B ESSA {mode} (bench/essa.py)", plan, measured)
                row["source"] = "essa.json"
                R["rows"].append(row)


def table() -> str:
    out = ["| configuration | shape | predicted GiB | measured GiB | error | measured in |", "|---|---|---|---|---|---|"]
    for r in R["rows"]:
        err = f"{r['error']:+.1%}" if r.get("error") is not None else "-"
        out.append(f"| {r['name']} | {r.get('shape', '')} | {r['predicted_GiB']} | {r['measured_GiB']} | {err} | "
                   f"{r.get('source', 'planner_check.json')} |")
    errs = [abs(r["error"]) for r in R["rows"] if r.get("error") is not None]
    if errs:
        out.append(f"\n{sum(e <= 0.15 for e in errs)} of {len(errs)} within 15%; worst {max(errs):.1%}")
    if R["errors"]:
        out.append(f"errors: {R['errors']}")
    return "\n".join(out)


def main():
    if DEV == "cpu":
        torch.set_num_threads(min(2, torch.get_num_threads()))
    if not args.collect_only:
        measure("own", own_measurements)
    measure("collected", collected)
    R["table"] = table()
    R["wall_s"] = round(time.perf_counter() - T0, 1)
    dump()
    print("\n" + R["table"], flush=True)


if __name__ == "__main__":
    main()
