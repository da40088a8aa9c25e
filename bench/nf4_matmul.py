"""NF4 decode matmuls per layer shape: bitsandbytes' matmul_4bit, dequantise + matmul,
the fused kernel (kernels/nf4_matmul.py) and a plain bf16 matmul, at decode batch sizes.

Shapes are Qwen2.5-7B's (out x in): q/o 3584x3584, gate/up 18944x3584, down 3584x18944;
M = 64 rows (and 16, 128). Random weights quantised by bitsandbytes (blocksize 64,
double-quantised absmax, as the engine loads NF4). Each method is timed with
triton.testing.do_bench_cudagraph (median ms, GPU time); the fused kernel after its own config search,
whose pick is reported. Also reported: effective weight bandwidth of each method
(NF4 bytes / time for the NF4 paths, bf16 bytes / time for the bf16 matmul) and the
largest difference of the fused output from dequantise + matmul.

    PYTHONPATH=$PWD/.gpu-site:$PYTHONPATH python bench/nf4_matmul.py   # GPU, ~1 min
    TRITON_INTERPRET=1 python bench/nf4_matmul.py --tiny               # CPU smoke run
Writes $OUT/nf4_matmul.json (or --out); prints a markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
ap.add_argument("--tiny", action="store_true", help="small shapes on the CPU (interpreter)")
ap.add_argument("--out", default=os.environ.get("OUT", "."))
ap.add_argument("--rows", default="16,64,128")
args = ap.parse_args()
if args.tiny:
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from edgetune.kernels import nf4_matmul as K  # noqa: E402

DEV = "cpu" if args.tiny or not torch.cuda.is_available() else "cuda"
SHAPES = {"q/o 3584x3584": (3584, 3584), "gate/up 18944x3584": (18944, 3584), "down 3584x18944": (3584, 18944)}
if args.tiny:
    SHAPES = {"tiny 96x128": (96, 128), "tiny 64x192": (64, 192)}
ROWS = [4] if args.tiny else [int(r) for r in args.rows.split(",")]


def bench(fn) -> float:
    if DEV == "cuda":
        import triton

        # replayed in a CUDA graph, as the decode loop runs them: GPU time without the
        # host-side launch cost (as long as these short kernels themselves)
        return float(triton.testing.do_bench_cudagraph(fn, rep=100))
    fn()
    t = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - t)


def one_shape(N: int, Kd: int, M: int) -> dict:
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbF

    g = torch.Generator(device=DEV).manual_seed(0)
    W = (torch.randn(N, Kd, generator=g, device=DEV) * 0.02).to(torch.bfloat16)
    q, qs = bnbF.quantize_4bit(W, blocksize=64, quant_type="nf4", compress_statistics=True)
    del W
    x = torch.randn(M, Kd, generator=g, device=DEV).to(torch.bfloat16)
    w = K.prepare(q, qs)
    wd = bnbF.dequantize_4bit(q, qs).to(torch.bfloat16)
    y_ref = F.linear(x, wd)
    y = torch.empty(M, N, dtype=torch.bfloat16, device=DEV)
    cfg = K.tune(x, w, None, y)
    K.linear(x, w, out=y, config=cfg)
    r = {"N": N, "K": Kd, "M": M, "config": dict(zip(("BLOCK_N", "BLOCK_K", "SPLIT_K", "warps", "stages"), cfg)),
         "block_m": K.block_m(M), "max_abs_diff_vs_dequant_matmul": float((y.float() - y_ref.float()).abs().max()),
         "ref_max_abs": float(y_ref.float().abs().max())}
    ms = {
        "bnb_matmul_4bit": bench(lambda: bnb.matmul_4bit(x, q.t(), quant_state=qs)),
        "dequant_then_matmul": bench(lambda: F.linear(x, bnbF.dequantize_4bit(q, qs))),
        "fused_nf4": bench(lambda: K.linear(x, w, out=y, config=cfg)),
        "bf16_matmul": bench(lambda: F.linear(x, wd)),
    }
    # every config of the search, so the table shows what wins
    sweep = {}
    for c in K.CONFIGS:
        try:
            sweep[c] = bench(lambda: K.linear(x, w, out=y, config=c))
        except Exception as e:  # noqa: BLE001 - a config the GPU cannot hold
            print(f"config {c}: {type(e).__name__}: {str(e)[:120]}", flush=True)
    diffs = {}
    for c in sweep:  # each config's output against dequantise + matmul (a wrong variant must not win)
        diffs[c] = float((K.linear(x, w, config=c).float() - y_ref.float()).abs().max())
    r["sweep"] = [{"config": list(c), "ms": round(t, 4), "max_abs_diff": diffs[c]}
                  for c, t in sorted(sweep.items(), key=lambda kv: kv[1])]
    nf4_bytes = N * Kd // 2 + N * Kd // 64 * 4  # codes + fp32 absmax the kernel reads
    r["ms"] = {k: round(v, 4) for k, v in ms.items()}
    r["weight_GB_per_s"] = {k: round((N * Kd * 2 if k == "bf16_matmul" else nf4_bytes) / (v / 1000) / 1e9, 1)
                            for k, v in ms.items()}
    r["fused_vs_bf16"] = round(ms["bf16_matmul"] / ms["fused_nf4"], 3)
    r["fused_vs_bnb"] = round(ms["bnb_matmul_4bit"] / ms["fused_nf4"], 3)
    return r


def main():
    R = {"device": torch.cuda.get_device_name(0) if DEV == "cuda" else "cpu (interpreter)",
         "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "rows": []}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for M in ROWS:
        for name, (N, Kd) in SHAPES.items():
            r = one_shape(N, Kd, M)
            r["shape"] = name
            R["rows"].append(r)
            print(json.dumps(r), flush=True)
            (out / "nf4_matmul.json").write_text(json.dumps(R, indent=1))
    lines = [f"{R['date']}, {R['device']}, torch {R['torch']}; ms per matmul (median), weight GB/s in brackets", "",
             "| shape | M | bnb matmul_4bit | dequant + matmul | fused NF4 | bf16 matmul | fused x bf16 | fused config |",
             "|---|---|---|---|---|---|---|---|"]
    for r in R["rows"]:
        c = [f"{r['ms'][k]:.4f} ({r['weight_GB_per_s'][k]:,})" for k in
             ("bnb_matmul_4bit", "dequant_then_matmul", "fused_nf4", "bf16_matmul")]
        cfg = r["config"]
        lines.append(f"| {r['shape']} | {r['M']} | {' | '.join(c)} | {r['fused_vs_bf16']} | "
                     f"{cfg['BLOCK_N']}x{cfg['BLOCK_K']} split {cfg['SPLIT_K']} w{cfg['warps']} s{cfg['stages']} |")
    R["table"] = "\n".join(lines)
    (out / "nf4_matmul.json").write_text(json.dumps(R, indent=1))
    print("\n" + R["table"])


if __name__ == "__main__":
    main()
