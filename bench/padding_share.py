#!/usr/bin/env python3
"""How much of each method's training batches is padding, and which lever removes it.

A padded batch of rows x width token slots runs every slot through the forward and, without
SEBP, through every linear layer's backward. SEBP (kernels/sebp.py) skips the padding rows
(attention 0) in the linear layers' backward only: the forward and the attention stay
padded. Packing (engine/data/packing.py) lays the rows end to end, so no slot is padding,
forward or backward. This bench builds each method's real micro-batches with the engine's
own code, from the quick-start presets' data and settings, and counts their slots:

    SFT      engine.training.loop.step_rows + engine.data.sft.collate (`sft.packing: false`)
             and engine.data.packing.collate_packed (`sft.packing: true`, the default)
    DPO      step_rows + the pairs' chosen rows then rejected rows through collate, as
             engine.methods.dpo.dpo.forward_pairs builds its one forward
    F-GRPO   engine.methods.fgrpo.fgrpo.generate_trajectory (completions the model samples
             from the embedded RL prompts: left-padded prompts, completions padded after
             their EOS) then policy_update itself, which trims each micro-batch and hands
             SEBP its rows: the bench records those [rows, width] masks as SEBP gets them.
             These steps train the adapter, so later steps sample from the updated policy.

Before counting, one micro-batch of SFT and of DPO goes through the engine's own training
functions (sft.accumulate, dpo.forward_pairs) with the recorder in SEBP's place, and the
mask SEBP receives must equal the one counted (else the bench stops).

Per method: slots (rows x width, summed over micro-batches and F-GRPO's iterations), real
tokens (attention 1), padding (attention 0; left: before a row's first real token, right:
after its last), the padding share (whole and the least / most of one micro-batch) and the
targets (tokens with a loss: next-token labels not -100, F-GRPO's completion tokens). The
padding share is both what SEBP skips of the linear layers' backward rows and what packing
would remove from the forward and the backward. The counts do not depend on the machine or
its load.

    python bench/padding_share.py --tiny              # CPU check: a 2-layer random Llama, seconds
    python bench/padding_share.py --out DIR           # the embedded SmolLM2-135M, 3-6 minutes on 2 CPU cores
    python bench/padding_share.py --fgrpo-steps 2 --set fgrpo.max_new_tokens=128 --out DIR   # longer completions

Writes padding_share.json and padding_share.md to --out.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import shlex
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))
import _common  # noqa: E402,F401  (makes edgetune.* importable from this checkout)

IGNORE = -100
# A reward that depends on every character: rewards differ within a group even for the
# random model of --tiny, so its update has rows to train on.
TINY_REWARD = "def reward(completion, answer, row):\n    return (sum(map(ord, completion)) % 7) / 6\n"


# --------------------------------------------------------------------------- counting


def count(mask, labels=None) -> dict:
    """The token slots of one [rows, width] batch: `slots` (rows x width), `real`
    (attention 1), `padding` (attention 0), of it `left` (before each row's first real
    token) and `right` (after its last; a row with none counts as right), and `targets`
    (positions whose next-token label is not -100) when labels are given."""
    import torch

    m = torch.as_tensor(mask).bool()
    rows, width = m.shape
    real = int(m.sum())
    has = m.any(1)
    first = torch.where(has, m.int().argmax(1), torch.zeros_like(has, dtype=torch.long))
    last = torch.where(has, width - 1 - m.flip(1).int().argmax(1), torch.full_like(first, -1))
    out = {"batches": 1, "rows": rows, "slots": rows * width, "real": real, "padding": rows * width - real,
           "left": int(first.sum()), "right": int((width - 1 - last).sum())}
    if labels is not None:
        out["targets"] = int((torch.as_tensor(labels)[:, 1:] != IGNORE).sum())
    return out


def total(counts: list[dict]) -> dict:
    """The counts of several batches added up, with the padding share of all of them and the
    least and most of one batch."""
    keys = ("batches", "rows", "slots", "real", "padding", "left", "right", "targets")
    out = {k: sum(c[k] for c in counts) for k in keys if counts and all(k in c for c in counts)}
    shares = [c["padding"] / c["slots"] for c in counts if c["slots"]]
    out["padding_share"] = out["padding"] / out["slots"] if counts and out["slots"] else 0.0
    out["padding_share_min"] = min(shares, default=0.0)
    out["padding_share_max"] = max(shares, default=0.0)
    return out


class Recorder:
    """Stands where the engine's SEBP handle stands: keeps every mask the training code
    hands to `set_active_rows`, the rows SEBP would keep in that backward."""

    def __init__(self):
        self.masks = []

    def set_active_rows(self, mask) -> None:
        self.masks.append(mask.detach().cpu().clone())


# --------------------------------------------------------------------------- the methods' batches


def sft_batches(cfg, tok, steps: int) -> tuple[list[dict], list[dict]]:
    """(padded, packed) micro-batches of the first `steps` optimizer steps."""
    from edgetune.engine.data.packing import collate_packed

    from edgetune.engine.training.loop import step_rows

    from edgetune.engine import data as data_lib

    s = cfg.sft
    data = data_lib.load_sft(cfg.data, tok, cfg.run.seed)
    padded, packed = [], []
    for step in range(steps):
        for idx in step_rows(len(data.train), s.batch_size, s.grad_accum, step, cfg.run.seed):
            rows = [data.train[i] for i in idx]
            padded.append(data_lib.collate(rows, tok.pad_token_id))
            packed.append(collate_packed(rows, tok.pad_token_id))
    return padded, packed


def dpo_micro(cfg, tok, steps: int) -> list[list]:
    """The pairs of each micro-batch of the first `steps` optimizer steps."""
    from edgetune.engine.training.loop import step_rows

    from edgetune.engine import data as data_lib

    s = cfg.dpo
    data = data_lib.load_pairs(cfg.data, tok, cfg.run.seed)
    return [[data.train[i] for i in idx] for step in range(steps)
            for idx in step_rows(len(data.train), s.batch_size, s.grad_accum, step, cfg.run.seed)]


def dpo_batch(pairs, pad_id: int) -> dict:
    """One DPO forward's rows: every chosen row, then every rejected row (forward_pairs)."""
    from edgetune.engine import data as data_lib

    return data_lib.collate([p.chosen for p in pairs] + [p.rejected for p in pairs], pad_id)


def check_engine_masks(model, tok, sft_cfg, sft_batch: dict, dpo_cfg, pairs) -> None:
    """The engine's own SFT step and DPO forward hand SEBP exactly the masks counted here."""
    import torch

    from edgetune.engine.methods.dpo import dpo
    from edgetune.engine.methods.sft import sft

    rec = Recorder()
    device = next(model.parameters()).device
    sft.accumulate(model, [{k: v.to(device) for k, v in sft_batch.items()}], rec)
    model.zero_grad(set_to_none=True)
    if len(rec.masks) != 1 or not torch.equal(rec.masks[0], sft_batch["attention_mask"].bool()):
        raise SystemExit("sft.accumulate handed SEBP other rows than the batch counted here")
    rec = Recorder()
    with torch.enable_grad():
        dpo.forward_pairs(model, pairs, tok.pad_token_id, str(next(model.parameters()).device), dpo_cfg.dpo, rec,
                          dpo.Reference(model, False))
    if len(rec.masks) != 1 or not torch.equal(rec.masks[0], dpo_batch(pairs, tok.pad_token_id)["attention_mask"].bool()):
        raise SystemExit("dpo.forward_pairs handed SEBP other rows than the batch counted here")


def fgrpo_steps(cfg, model, tok, steps: int, log) -> tuple[list[dict], dict]:
    """The update batches of the first `steps` F-GRPO steps, as policy_update hands them to
    SEBP, each with its rows' completion tokens as targets; and what the rollouts held."""
    import torch

    from edgetune.engine.planning.effective import copy_budget

    from edgetune.engine.training.loop import make_optimizer, make_scheduler, micro_batch_indices
    from edgetune.engine.training.rewards import build_reward

    from edgetune.engine.methods.fgrpo import fgrpo

    from edgetune.engine import data as data_lib

    s = cfg.fgrpo
    data = data_lib.load_rl(cfg.data, cfg.run.seed, tok)
    reward = build_reward(s.reward, s.reward_file)
    optimizer = make_optimizer(model.parameters(), "auto", s.lr, 0.0, str(next(model.parameters()).device))
    scheduler = make_scheduler(optimizer, s.warmup_steps * s.num_iterations, s.steps * s.num_iterations)
    counts, seen = [], {"completions": 0, "truncated": 0, "dropped": 0, "completion_tokens": 0}
    for step in range(steps):
        rows = [data.train[i] for i in micro_batch_indices(len(data.train), s.prompts_per_step, step, cfg.run.seed)]
        t = time.time()
        traj = fgrpo.generate_trajectory(model, tok, rows, reward, s, cfg.data.system_prompt, copy_budget(cfg),
                                         seed=cfg.run.seed * fgrpo._TRAIN_STREAM + step)
        rec = Recorder()
        upd = fgrpo.policy_update(model, traj.roll, traj.advantages, s, optimizer, scheduler, rec)
        roll = traj.roll
        seen["completions"] += len(roll.truncated)
        seen["truncated"] += sum(roll.truncated)
        seen["dropped"] += upd["dropped"]
        seen["completion_tokens"] += int(roll.completion_mask.sum())
        # the rows policy_update keeps, in its order, micro_batch_size at a time (targets per batch)
        keep = (traj.advantages != 0).nonzero().view(-1) if s.beta == 0 else torch.arange(traj.advantages.numel())
        mb = s.micro_batch_size if s.micro_batch_size > 0 else max(keep.numel(), 1)
        chunks = [keep[i : i + mb] for i in range(0, keep.numel(), mb)] * s.num_iterations
        if len(chunks) != len(rec.masks):
            raise SystemExit(f"policy_update ran {len(rec.masks)} backward batches, the bench expected {len(chunks)}")
        for c, mask in zip(chunks, rec.masks):
            n = count(mask)
            if n["real"] != int(roll.prompt_mask[c].sum() + roll.completion_mask[c].sum()):
                raise SystemExit("a recorded update batch does not hold its rows' prompt and completion tokens")
            counts.append({**n, "targets": int(roll.completion_mask[c].sum())})
        log(f"fgrpo step {step + 1}: {len(roll.truncated)} completions, {upd['dropped']} dropped (zero advantage), "
            f"{len(rec.masks)} update batches, {time.time() - t:.0f} s")
    return counts, seen


# --------------------------------------------------------------------------- setup


def tiny_model(out: Path) -> Path:
    """A 2-layer Llama (hidden 64, random weights) with the embedded model's tokenizer and
    chat template, as the tests use."""
    if (out / "config.json").is_file():
        return out
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from edgetune.engine.models.model import embedded_model_dir, load_tokenizer

    tok = load_tokenizer(str(embedded_model_dir()))
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                      tie_word_embeddings=False, pad_token_id=tok.pad_token_id,
                      eos_token_id=tok.eos_token_id, bos_token_id=tok.bos_token_id)
    LlamaForCausalLM(cfg).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiny", action="store_true", help="a functional check on the CPU: a 2-layer random Llama")
    p.add_argument("--sft-steps", type=int, default=0, help="SFT optimizer steps counted (0: the preset's sft.steps)")
    p.add_argument("--dpo-steps", type=int, default=0, help="DPO optimizer steps counted (0: the preset's dpo.steps)")
    p.add_argument("--fgrpo-steps", type=int, default=3, help="F-GRPO steps sampled and updated")
    p.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                   help="a setting on top of every preset, e.g. fgrpo.max_new_tokens=128")
    p.add_argument("--work", default="", help="folder for the --tiny model and reward (default: a temporary one)")
    p.add_argument("--out", default=os.environ.get("OUT", "."))
    return p.parse_args(argv)


def configs(a, work: Path) -> dict:
    """Each method's quick-start preset as shipped (with --tiny: on the tiny model)."""
    from edgetune.engine.core.settings import resolve

    sets = []
    if a.tiny:
        (work / "reward.py").write_text(TINY_REWARD)
        sets = [f"model.name={tiny_model(work / 'tiny-model')}", "model.quant=none", "lora.r=4", "lora.alpha=8"]
    fgrpo_sets = ([f"fgrpo.reward_file={work / 'reward.py'}", "fgrpo.reward=file", "fgrpo.max_new_tokens=8"]
                  if a.tiny else [])
    return {"sft": resolve("sft-quickstart", overrides=sets + a.sets),
            "dpo": resolve("dpo-quickstart", overrides=sets + a.sets),
            "fgrpo": resolve("fgrpo-quickstart", overrides=sets + fgrpo_sets + a.sets)}


# --------------------------------------------------------------------------- report


def rows_of(result: dict) -> list[tuple[str, dict]]:
    m = result["methods"]
    return [("SFT, padded (`sft.packing: false`)", m["sft_padded"]),
            ("SFT, packed (`sft.packing: true`, the default)", m["sft_packed"]),
            ("DPO, chosen + rejected rows of a micro-batch", m["dpo"]),
            ("F-GRPO update, prompt + completion rows", m["fgrpo"])]


def table(result: dict) -> str:
    c, f = result["config"], result["methods"]["fgrpo_rollouts"]
    lines = [f"# Padding share of each method's training batches ({result['date']})", "",
             f"Machine: {result['machine']}", "", f"Command: `{result['command']}`", "",
             f"Model: {c['model']}. Batches built by the engine's own code from the quick-start presets: "
             f"`sft-quickstart` ({c['sft_steps']} steps of {c['sft_batch_size']} rows), `dpo-quickstart` "
             f"({c['dpo_steps']} steps of {c['dpo_batch_size']} pairs), `fgrpo-quickstart` ({c['fgrpo_steps']} steps of "
             f"{c['fgrpo_prompts']} prompts x {c['fgrpo_generations']} completions, {c['fgrpo_max_new_tokens']} new "
             f"tokens, micro-batches of {c['fgrpo_micro_batch_size']}).", "",
             "Slots: rows x width summed over the micro-batches (F-GRPO: over its iterations too); every slot runs "
             "through the forward and, without SEBP, through every linear layer's backward. Padding: attention 0 "
             "(left: before a row's first real token, right: after its last). Its share is what SEBP skips of the "
             "linear layers' backward rows, and what packing removes from the forward and the backward alike. "
             "Targets: tokens with a loss.", "",
             "| batches | micro-batches | rows | slots | real tokens | targets | padding (left / right) | "
             "padding share | least / most of one micro-batch |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, r in rows_of(result):
        lines.append(f"| {name} | {r['batches']} | {r['rows']} | {r['slots']:,} | {r['real']:,} | {r['targets']:,} | "
                     f"{r['padding']:,} ({r['left']:,} / {r['right']:,}) | {r['padding_share']:.1%} | "
                     f"{r['padding_share_min']:.1%} / {r['padding_share_max']:.1%} |")
    lines += ["", f"F-GRPO's rollouts: {f['completions']} completions, {f['truncated']} cut at the token limit, "
                  f"{f['dropped']} left out of the update (zero advantage: all of their group right or all wrong), "
                  f"{f['completion_tokens']:,} completion tokens in all.", "",
              "Each micro-batch's counts are in padding_share.json."]
    return "\n".join(lines) + "\n"


def machine() -> str:
    import torch

    try:
        load = f"{os.getloadavg()[0]:.1f}"
    except OSError:
        load = "n/a"
    return (f"{platform.machine()}, {os.cpu_count()} cores (load average {load} at the end: the counts do not "
            f"depend on it), torch {torch.__version__}, Python {platform.python_version()}")


def main(argv=None) -> dict:
    a = parse_args(argv)
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # shared cores: one thread is faster
    work = Path(a.work) if a.work else Path(tempfile.mkdtemp(prefix="edgetune-padding-"))
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    if a.tiny:
        a.sft_steps, a.dpo_steps, a.fgrpo_steps = a.sft_steps or 4, a.dpo_steps or 4, min(a.fgrpo_steps, 1)

    def log(msg: str) -> None:
        print(f"[{dt.datetime.now(dt.timezone.utc).strftime('%H:%M:%S')}] {msg}", flush=True)

    from edgetune.engine.models import model as model_lib

    from edgetune.engine.training.loop import seed_everything

    cfgs = configs(a, work)
    sft_steps, dpo_steps = a.sft_steps or cfgs["sft"].sft.steps, a.dpo_steps or cfgs["dpo"].dpo.steps
    t0 = time.time()
    tok = model_lib.load_tokenizer(model_lib.check_model(cfgs["sft"].model))
    padded, packed = sft_batches(cfgs["sft"], tok, sft_steps)
    micro = dpo_micro(cfgs["dpo"], tok, dpo_steps)
    dpo = [dpo_batch(p, tok.pad_token_id) for p in micro]
    log(f"SFT and DPO batches built ({time.time() - t0:.0f} s)")

    seed_everything(cfgs["fgrpo"].run.seed)
    model, tok, _ = model_lib.load(cfgs["fgrpo"])
    check_engine_masks(model, tok, cfgs["sft"], padded[0], cfgs["dpo"], micro[0])
    log(f"model loaded, the engine's SFT step and DPO forward hand SEBP the masks counted ({time.time() - t0:.0f} s)")
    fg, rollouts = fgrpo_steps(cfgs["fgrpo"], model, tok, a.fgrpo_steps, log)

    per = {"sft_padded": [count(b["attention_mask"], b["labels"]) for b in padded],
           "sft_packed": [count(b["attention_mask"], b["labels"]) for b in packed],
           "dpo": [count(b["attention_mask"], b["labels"]) for b in dpo], "fgrpo": fg}
    fs, ss, ds = cfgs["fgrpo"].fgrpo, cfgs["sft"].sft, cfgs["dpo"].dpo
    result = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="minutes"),
        "command": "python " + " ".join(shlex.quote(x) for x in
                                        ["bench/padding_share.py", *(argv if argv is not None else sys.argv[1:])]),
        "machine": machine(), "tiny": a.tiny, "wall_s": round(time.time() - t0, 1),
        "config": {"model": "a 2-layer random Llama with the embedded tokenizer" if a.tiny else
                   "the embedded SmolLM2-135M-Instruct (NF4, LoRA r16 on all linear layers, CPU)",
                   "sft_steps": sft_steps, "sft_batch_size": ss.batch_size * ss.grad_accum,
                   "dpo_steps": dpo_steps, "dpo_batch_size": ds.batch_size * ds.grad_accum,
                   "fgrpo_steps": a.fgrpo_steps, "fgrpo_prompts": fs.prompts_per_step,
                   "fgrpo_generations": fs.num_generations, "fgrpo_max_new_tokens": fs.max_new_tokens,
                   "fgrpo_micro_batch_size": fs.micro_batch_size, "fgrpo_num_iterations": fs.num_iterations},
        "methods": {**{k: total(v) for k, v in per.items()}, "fgrpo_rollouts": rollouts},
        "per_batch": per,
    }
    (out / "padding_share.json").write_text(json.dumps(result, indent=1) + "\n")
    (out / "padding_share.md").write_text(table(result))
    print(table(result))
    return result


if __name__ == "__main__":
    main()
