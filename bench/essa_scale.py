"""Is there a better adapter along a warm start's own direction? ESSA's search space, probed.

ESSA searches offsets to the warm-start adapter's singular values. Scaling every one of
them by the same c (the same as multiplying each LoRA B by c) is one line through that
space: c = 1 is the warm start, c = 0 the base model, c > 1 goes further the way the
warm-start SFT went. This script writes the scaled copies of a warm-start adapter and
measures held-out greedy success of each through `edgetune eval`, as bench/learning.py
does. If some c > 1 does much better than c = 1, the space holds a better point a few
steps of SFT away and the search is what misses it; if not, the warm start's own
singular values are near their best and a larger gain needs other directions.

    python bench/essa_scale.py --adapter RUN/warm_start/adapter --data DIR/<task> --task gcd \\
        --scales 0.5,1,1.5,2,3 --out bench/results/<date>-cpu/essa-scale/gcd
    (DIR/<task> holds bench/learning.py's train_rl.jsonl and eval_rl.jsonl)
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import learning as lh  # noqa: E402  (bench/learning.py: the same CLI calls as the learning bench)


def scaled_copy(adapter: Path, c: float, out: Path) -> Path:
    """The adapter with every LoRA B multiplied by c: B A -> c B A."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(adapter, out)
    f = out / "adapter_model.safetensors"
    w = load_file(str(f))
    save_file({k: v * c if ".lora_B." in k else v for k, v in w.items()}, str(f))
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--adapter", required=True, help="a warm-start adapter folder (PEFT)")
    p.add_argument("--data", required=True, help="folder with train_rl.jsonl and eval_rl.jsonl")
    p.add_argument("--task", required=True, help="reasoning-gym task of the reward (rg:<task>)")
    p.add_argument("--scales", default="0.5,1,1.5,2,3")
    p.add_argument("--eval-prompts", type=int, default=40)
    p.add_argument("--eval-tokens", type=int, default=32)
    p.add_argument("--set", dest="eval_set", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--max-run-s", type=float, default=900)
    p.add_argument("--out", required=True)
    a = p.parse_args(argv)
    data, out = Path(a.data), Path(a.out)
    for need in (Path(a.adapter) / "adapter_model.safetensors", data / "train_rl.jsonl", data / "eval_rl.jsonl"):
        if not need.is_file():
            p.error(f"{need}: no such file")
    try:
        scales = [float(x) for x in a.scales.split(",")]
    except ValueError:
        p.error(f"--scales {a.scales!r}: expected numbers separated by commas")
    if (out / "essa_scale.json").exists():
        p.error(f"{out / 'essa_scale.json'} exists: give another --out (nothing is overwritten)")
    out.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="edgetune-essa-scale-"))
    sets = [f"data.path={data / 'train_rl.jsonl'}", f"data.eval_path={data / 'eval_rl.jsonl'}",
            f"fgrpo.reward=rg:{a.task}", f"fgrpo.eval_prompts={a.eval_prompts}", "fgrpo.eval_k=0",
            f"fgrpo.max_new_tokens={a.eval_tokens}", *a.eval_set]
    res = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": lh.machine(),
           "adapter": a.adapter, "task": a.task, "scales": {}}
    for c in scales:
        ad = scaled_copy(Path(a.adapter), c, work / f"scale-{c:g}")
        args = [*lh.edgetune(), "eval", "--preset", "fgrpo-quickstart", *lh.sets(sets), "--json",
                "--adapter", str(ad), "--runs-dir", str(work / "runs")]
        rc, secs, m = lh.run_json(args, work / f"scale-{c:g}.log", a.max_run_s)
        res["scales"][f"{c:g}"] = ({"success_rate": m["success_rate"], "prompts": m["prompts"], "eval_s": round(secs, 1)}
                                   if m else {"error": f"eval exited {rc}: see {work / f'scale-{c:g}.log'}"})
        res["eval_cmd"] = lh.printable(args)
        print(f"{a.task} c={c:g}: {json.dumps(res['scales'][f'{c:g}'])}", flush=True)
        (out / "essa_scale.json").write_text(json.dumps(res, indent=2))
    return res


if __name__ == "__main__":
    main()
