#!/usr/bin/env python3
"""The user path on a GPU in one run: the CLI driven as a user would on a 7B model folder.

A random-init Qwen2.5-7B architecture (bf16, written with `save_pretrained`, with the
embedded model's tokenizer), data files written here, and then, each part timed and its
result kept in one JSON (`$OUT/gpu_smoke.json`, rewritten after every part, so a time
limit loses nothing done):

  estimate     `edgetune estimate --preset sft-qlora-7b --json`: the planner's peak
  sft_first    `edgetune train --preset sft-qlora-7b` on a fresh quantisation cache
               (first-ever start: quantisation, compilation), predicted vs measured peak
  sft_second   the same command again (base from the cache): seconds from the command to
               its first step, and where they went (phases from the run's events)
  padded_sebp_on, padded_sebp_runs, padded_sebp_off
               `sft.packing=false`, SEBP on / on with `sft.sebp_kernel=runs` / off: every
               step's time (stalls after the first)
  export       `edgetune export` of the first run: PEFT folder, then `--gguf`
  fgrpo        `fgrpo-7b` for a few steps, with a reward file that varies between a group's
               completions (a random model solves nothing), so the policy update runs
  essa         `essa-7b`, a short warm start then two CMA-ES generations

    python bench/gpu_smoke.py --tokenizer DIR [--out DIR]     # GPU: under nine minutes on an H100
    python bench/gpu_smoke.py --tiny                          # CPU: the same path on a tiny model

DIR is a tokenizer folder (tokenizer.json + tokenizer_config.json); by default the embedded
model's, converted from its GGUF (`edgetune.engine.models.model.embedded_model_dir`).
Run it first and last whenever a GPU is at hand: every part is a command a user types.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

# Qwen2.5-7B's config (the real model's shape, random weights)
QWEN7B = dict(architectures=["Qwen2ForCausalLM"], model_type="qwen2", hidden_size=3584, intermediate_size=18944,
              num_hidden_layers=28, num_attention_heads=28, num_key_value_heads=4, vocab_size=152064,
              max_position_embeddings=32768, rope_theta=1000000.0, rms_norm_eps=1e-6, tie_word_embeddings=False,
              hidden_act="silu", initializer_range=0.02, bos_token_id=None, eos_token_id=2)
TINY = dict(QWEN7B, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=49152)

REWARD_FILE = '''\
def reward(completion, answer, row):
    """Varies between the completions of a group whatever the model: the share of
    characters that are letters. A random model solves nothing; this still gives the
    group-relative advantages a spread, so the policy update runs."""
    return sum(c.isalpha() for c in completion) / max(1, len(completion))
'''

WORDS = ("the model reads each row and learns to answer with care one two three four five six seven eight nine "
         "ten data step loss token layer weight adapter rank value memory batch train test result").split()


def write_data(d: Path, n_sft: int, n_rl: int, max_words: int) -> dict:
    """SFT chat rows of varied lengths and RL prompt/answer rows, deterministic."""
    rng = random.Random(0)
    sft, rl = d / "sft.jsonl", d / "rl.jsonl"
    with sft.open("w") as f:
        for _ in range(n_sft):
            q = " ".join(rng.choice(WORDS) for _ in range(rng.randint(8, 40)))
            a = " ".join(rng.choice(WORDS) for _ in range(rng.randint(20, max_words)))
            f.write(json.dumps({"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": a}]})
                    + "\n")
    with rl.open("w") as f:
        for _ in range(n_rl):
            a, b = rng.randint(0, 99), rng.randint(0, 99)
            f.write(json.dumps({"prompt": f"What is {a} plus {b}?", "answer": str(a + b)}) + "\n")
    (d / "reward.py").write_text(REWARD_FILE)
    return {"sft": str(sft), "rl": str(rl), "reward_file": str(d / "reward.py")}


def build_model(folder: Path, tokenizer: Path, tiny: bool) -> dict:
    """Random-init weights of the config, saved as a user's model folder would be."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    t0 = time.perf_counter()
    cfg = Qwen2Config(**(TINY if tiny else QWEN7B))
    dev = "cuda" if torch.cuda.is_available() and not tiny else "cpu"
    torch.manual_seed(0)
    with torch.device(dev):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    model.save_pretrained(folder, max_shard_size="4GB")
    del model
    tok = AutoTokenizer.from_pretrained(tokenizer)
    tok.save_pretrained(folder)
    size = sum(f.stat().st_size for f in folder.iterdir()) / 1e9
    if dev == "cuda":
        torch.cuda.empty_cache()
    return {"seconds": round(time.perf_counter() - t0, 1), "GB": round(size, 2), "device": dev}


def read_events(run: Path) -> list[dict]:
    p = run / "events.jsonl"
    if not p.is_file():
        return []
    out = []
    for line in p.read_text().splitlines():
        try:
            out.append(json.loads(line))
        except ValueError:
            pass
    return out


def cli(args: list[str], env: dict, timeout: float) -> tuple[int, str, float, float]:
    """(exit code, last lines of the output, start time, seconds) of `edgetune ARGS`. Past
    `timeout` it is interrupted as a user's Ctrl-C would (a run stops after its step and
    saves), then killed if it does not end; 124 then."""
    t0 = time.time()
    p = subprocess.Popen([sys.executable, "-m", "edgetune.engine.cli", *args], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True)
    try:
        text, _ = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGINT)
        try:
            text, _ = p.communicate(timeout=90)
        except subprocess.TimeoutExpired:
            p.kill()
            text, _ = p.communicate()
        rc = 124
    return rc, "\n".join((text or "").strip().splitlines()[-12:]), t0, time.time() - t0


def run_summary(run: Path, t_cmd: float) -> dict:
    """What a user waits for and sees, from the run's own events."""
    ev = read_events(run)
    steps = [e for e in ev if e["type"] == "step"]
    out: dict = {"events": len(ev), "last": ev[-1]["type"] if ev else None, "steps": len(steps)}
    phases = [(e["phase"], e["time"]) for e in ev if e["type"] == "phase" and "done" not in e]
    started = next((e["time"] for e in ev if e["type"] == "started"), None)
    if started:
        out["command_to_started_s"] = round(started - t_cmd, 2)
    marks = [("started", started)] + phases + ([("first_step", steps[0]["time"])] if steps else [])
    out["phases_s"] = {f"{a}->{b}": round(tb - ta, 2) for (a, ta), (b, tb) in zip(marks, marks[1:])
                       if ta and tb and tb >= ta}
    if steps:
        out["command_to_first_step_s"] = round(steps[0]["time"] - t_cmd, 2)
        times = [b["time"] - a["time"] for a, b in zip(steps, steps[1:])]
        out["step_s"] = [round(x, 3) for x in times]
        if times:
            med = statistics.median(times)
            out["median_step_s"] = round(med, 3)
            out["max_step_after_first_over_median"] = round(max(times) / med, 2)
        peaks = [e.get("gpu", {}).get("peak", 0) for e in ev if e["type"] in ("step", "eval", "finished")]
        out["peak_GiB"] = round(max(peaks) / 2**30, 2) if peaks else None
        last = steps[-1]
        out["last_step"] = {k: last[k] for k in last if k not in ("gpu", "i", "time", "type", "ranks")}
    fin = next((e for e in ev if e["type"] == "finished"), None)
    if fin:
        out["finished_metrics"] = fin.get("metrics")
        out["adapter"] = fin.get("adapter")
    err = next((e for e in ev if e["type"] == "error"), None)
    if err:
        out["error"] = err.get("message")
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tiny", action="store_true", help="a tiny model on the CPU: the same commands, seconds each")
    ap.add_argument("--tokenizer", default="", help="tokenizer folder (default: the embedded model's)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--work", default="", help="where the model folder, data and runs go (default: a temp folder)")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds for the whole script")
    ap.add_argument("--only", default="", help="comma-separated parts to run (default: all)")
    a = ap.parse_args(argv)
    t_start = time.time()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    work = Path(a.work or tempfile.mkdtemp(prefix="edgetune-smoke-", dir="/var/tmp" if os.path.isdir("/var/tmp")
                                          else None))
    work.mkdir(parents=True, exist_ok=True)
    R: dict = {"tiny": a.tiny, "parts": {}, "notes": []}
    path = out / "gpu_smoke.json"

    def dump() -> None:
        R["wall_s"] = round(time.time() - t_start, 1)
        path.write_text(json.dumps(R, indent=1))

    def left() -> float:
        return a.time_limit - (time.time() - t_start)

    only = set(filter(None, a.only.split(",")))

    def part(name: str, need_s: float):
        def wrap(fn):
            if only and name not in only:
                return None
            if left() < need_s:
                R["parts"][name] = {"skipped": f"{left():.0f} s left, needs ~{need_s:.0f} s"}
                dump()
                return None
            t0 = time.time()
            print(f"[smoke {time.time() - t_start:6.1f}s] {name}", flush=True)
            try:
                res = fn()
            except Exception as e:  # noqa: BLE001 - one failing part must not lose the others
                res = {"ok": False, "exception": f"{type(e).__name__}: {e}"[:800]}
            res["wall_s"] = round(time.time() - t0, 1)
            R["parts"][name] = res
            print(f"[smoke {time.time() - t_start:6.1f}s] {name}: {json.dumps(res)[:600]}", flush=True)
            dump()
            return res
        return wrap

    import torch

    R["env"] = {"torch": torch.__version__, "cuda": torch.cuda.is_available(),
                "device": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"}
    for pkg in ("transformers", "peft", "bitsandbytes", "liger_kernel", "triton"):
        try:
            from importlib.metadata import version

            R["env"][pkg] = version(pkg.replace("_", "-"))
        except Exception:  # noqa: BLE001
            R["env"][pkg] = None
    try:
        R["env"]["commit"] = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True,
                                            text=True).stdout.strip() or None
    except OSError:
        R["env"]["commit"] = None

    model_dir = work / "Qwen2.5-7B-random"
    tok = Path(a.tokenizer) if a.tokenizer else None
    if tok is None:
        from edgetune.engine.models.model import embedded_model_dir

        tok = Path(embedded_model_dir())
    if not model_dir.is_dir():
        R["model"] = build_model(model_dir, tok, a.tiny)
    data = write_data(work, n_sft=80 if a.tiny else 600, n_rl=40 if a.tiny else 200,
                      max_words=60 if a.tiny else 700)
    runs = work / "runs"
    env = dict(os.environ, EDGETUNE_CACHE=str(work / "cache"), PYTHONUNBUFFERED="1")
    if a.tiny:
        env.pop("TRITON_INTERPRET", None)  # the CPU path of SEBP, not its kernels in Triton's interpreter
    try:
        import tensorboard  # noqa: F401
    except ImportError:
        R["notes"].append("tensorboard not importable here: runs use run.report_to=none")
        env["EDGETUNE_SMOKE_NO_TB"] = "1"
    base = ["--set", f"model.name={model_dir}"] + (["--set", "run.report_to=none"] if "EDGETUNE_SMOKE_NO_TB" in env
                                                   else [])
    tiny = ["--set", "data.max_seq_len=128"] if a.tiny else []
    sft = ["--preset", "sft-qlora-7b", *base, "--set", f"data.path={data['sft']}", "--set", "sft.eval_every=0",
           "--set", "sft.samples=0", "--set", "run.checkpoint_every=0", *tiny]
    if a.tiny:
        sft += ["--set", "model.quant=none", "--set", "sft.batch_size=2"]
    dump()

    @part("estimate", 20)
    def _():
        t0 = time.time()
        p = subprocess.run([sys.executable, "-m", "edgetune.engine.cli", "estimate", *sft, "--json"], env=env,
                           capture_output=True, text=True, timeout=120)
        if p.returncode:
            return {"ok": False, "rc": p.returncode, "output": (p.stdout + p.stderr)[-1500:]}
        est = json.loads(p.stdout)
        R["predicted_peak"] = est.get("allocated_peak")
        return {"ok": bool(est.get("allocated_peak")), "predicted_peak_GiB": round(est["allocated_peak"] / 2**30, 2),
                "shape": est.get("shape"), "command_s": round(time.time() - t0, 1)}

    def train(name: str, args: list[str], timeout: float) -> dict:
        rc, text, t0, s = cli(["train", "--runs-dir", str(runs), "--name", name, *args], env, timeout)
        res = {"ok": rc == 0, "rc": rc, "command_s": round(s, 1), **run_summary(runs / name, t0)}
        if rc:
            res["output"] = text
        return res

    @part("sft_first", 60)
    def _():
        steps = 6 if a.tiny else 20
        res = train("sft-first", [*sft, "--set", f"sft.steps={steps}"], min(240, left() - 10))
        if R.get("predicted_peak") and res.get("peak_GiB"):
            pred = R["predicted_peak"] / 2**30
            res["predicted_peak_GiB"] = round(pred, 2)
            res["predicted_over_measured"] = round(pred / res["peak_GiB"], 3)
        return res

    @part("sft_second", 40)
    def _():
        res = train("sft-second", [*sft, "--set", "sft.steps=4"], min(150, left() - 10))
        res["target_first_step_s"] = 10
        return res

    padded = [*sft, "--set", "sft.packing=false", "--set", f"sft.steps={6 if a.tiny else 14}"]
    for name, sets in (("on", ["sft.sebp=on"]), ("runs", ["sft.sebp=on", "sft.sebp_kernel=runs"]),
                       ("off", ["sft.sebp=off"])):
        @part(f"padded_sebp_{name}", 60)
        def _(name=name, sets=sets):
            extra = [x for kv in sets for x in ("--set", kv)]
            return train(f"padded-sebp-{name}", [*padded, *extra], min(200, left() - 10))

    @part("export", 30)
    def _():
        res: dict = {}
        for what, extra in (("peft", []), ("gguf", ["--gguf"])):
            dest = work / f"export-{what}"
            rc, text, _, s = cli(["export", str(runs / "sft-first"), "--out", str(dest), *extra], env, 180)
            files = sorted(str(p.relative_to(dest)) for p in dest.rglob("*") if p.is_file()) if dest.exists() else []
            res[what] = {"ok": rc == 0, "rc": rc, "seconds": round(s, 1), "files": files[:20],
                         "output": text if rc else text.splitlines()[-1:] if text else []}
        res["ok"] = all(r["ok"] for r in res.values() if isinstance(r, dict))
        return res

    @part("fgrpo", 60)
    def _():
        small = ["--set", "fgrpo.steps=3", "--set", "fgrpo.prompts_per_step=4", "--set", "fgrpo.num_generations=4",
                 "--set", f"fgrpo.max_new_tokens={16 if a.tiny else 64}", "--set", "fgrpo.eval_prompts=8",
                 "--set", "fgrpo.eval_k=0", "--set", "fgrpo.sample_every=1", "--set", "fgrpo.samples=0",
                 "--set", "run.checkpoint_every=0"]
        args = ["--preset", "fgrpo-7b", *base, "--set", f"data.path={data['rl']}", "--set", "fgrpo.reward=file",
                "--set", f"fgrpo.reward_file={data['reward_file']}", *small, *tiny]
        if a.tiny:
            args += ["--set", "model.quant=none"]
        res = train("fgrpo", args, min(240, left() - 10))
        ev = read_events(runs / "fgrpo")
        res["update_ran"] = any(e["type"] == "step" and (e.get("grad_norm") or 0) > 0 for e in ev)
        res["reward_std"] = [e.get("reward_std") for e in ev if e["type"] == "step"]
        return res

    @part("essa", 45)
    def _():
        small = ["--set", "essa.warm_start_steps=3", "--set", "essa.population=4", "--set", "essa.generations=2",
                 "--set", "essa.prompts_per_generation=8", "--set", f"essa.max_new_tokens={16 if a.tiny else 32}",
                 "--set", "essa.eval_prompts=8", "--set", "essa.reward=file",
                 "--set", f"essa.reward_file={data['reward_file']}", "--set", "run.checkpoint_every=0"]
        args = ["--preset", "essa-7b", *base, "--set", f"data.path={data['rl']}",
                "--set", f"essa.warm_start_data={data['sft']}", *small, *tiny]
        if a.tiny:
            args += ["--set", "model.quant=none", "--set", "sft.batch_size=2"]
        res = train("essa", args, min(240, left() - 10))
        res["generations"] = [{k: e.get(k) for k in ("step", "best", "mean", "std")}
                              for e in read_events(runs / "essa") if e["type"] == "step"]
        return res

    R["ok"] = all(p.get("ok") for p in R["parts"].values() if "skipped" not in p)
    dump()
    print("\n| part | ok | wall s | result |\n|---|---|---|---|")
    for name, p in R["parts"].items():
        keys = ("command_to_first_step_s", "median_step_s", "max_step_after_first_over_median", "peak_GiB",
                "predicted_peak_GiB", "update_ran", "error", "skipped", "exception")
        print(f"| {name} | {p.get('ok')} | {p.get('wall_s')} | "
              + ", ".join(f"{k}={p[k]}" for k in keys if p.get(k) is not None) + " |")
    if not a.work:
        shutil.rmtree(work, ignore_errors=True)
    return 0 if R["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
