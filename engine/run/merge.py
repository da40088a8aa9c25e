"""`edgetune merge`: several LoRA adapters of one base combined into a new adapter folder by
PEFT's `add_weighted_adapter`, with where it came from in its edgetune.json.

    edgetune merge run-a run-b --method ties --weights 0.6,0.4 --out merged/
    edgetune serve --adapter merged/            # served like a run's adapter
    edgetune eval --adapter merged/ --adapter run-a --adapter run-b --base   # against its parts

Methods (PEFT's combination types): linear (the factors' weighted sum: the adapters need one
rank and the same layers), ties and dare (TIES and DARE on the weighted task vectors, keeping
`--density` of each; one rank), svd (the weighted sum of the full updates, factored again by
SVD to the largest rank: any ranks and layers). The new folder is written whole or not at
all, and only where nothing is: a new folder or an empty one.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from edgetune.engine.core.errors import ConfigError, ModelError, RunError

# our names -> PEFT's combination_type
METHODS = {"linear": "linear", "ties": "ties", "dare": "dare_linear", "svd": "svd"}


def parse_weights(text: str | None, k: int) -> list[float]:
    """`--weights` as k numbers (default: 1/k each)."""
    if not text:
        return [1.0 / k] * k
    try:
        weights = [float(w) for w in text.split(",")]
    except ValueError:
        raise ConfigError(f"--weights {text}: give {k} numbers separated by commas") from None
    if len(weights) != k:
        raise ConfigError(f"--weights {text}: {len(weights)} weights for {k} adapters")
    return weights


def base_of(adapters: list[tuple[str, Path, Path | None]], base: str | None, quant: str | None):
    """The base's ModelSettings: --base / --quant, else the first run's model settings,
    else the folder the first adapter records (edgetune.json's base_path)."""
    from edgetune.engine.core.settings import ModelSettings

    from edgetune.engine.run.serve_app import run_model

    fields: dict = {}
    first_run = next((run for _, _, run in adapters if run is not None), None)
    if first_run is not None and not base:
        model = run_model(first_run)
        fields = {k: model[k] for k in ("name", "quant", "dtype") if k in model}
        if model.get("trust_remote_code"):
            raise RunError(f"{first_run}: its model.trust_remote_code runs the Python that {model.get('name')} "
                           "ships; merging needs no such code: give --base with a model that does not")
    elif not base:
        info = adapters[0][1] / "edgetune.json"
        recorded = json.loads(info.read_text()).get("base_path") if info.is_file() else None
        if not recorded or not Path(recorded).is_dir():
            raise ConfigError(f"{adapters[0][1]}: it names no base folder that exists here; give --base MODEL")
        fields["name"] = recorded
    if base:
        fields["name"] = base
    if quant:
        fields["quant"] = quant
    return ModelSettings(**fields)


def merge(inputs: list[str], out: str, method: str = "linear", weights: str | None = None, density: float = 0.5,
          base: str | None = None, quant: str | None = None, runs_dir: str = "runs") -> Path:
    """Write the combined adapter of `inputs` (run names, run folders, adapter folders) to
    `out`; returns the folder."""
    from edgetune.engine.core.runfolder import atomic_dir

    from edgetune.engine.run.serve import resolve_adapter

    if len(inputs) < 2:
        raise ConfigError("merge: give two adapters or more")
    if method not in METHODS:
        raise ConfigError(f"--method {method}: one of {', '.join(METHODS)}")
    if not 0 < density <= 1:
        raise ConfigError(f"--density {density}: above 0 and at most 1")
    target = Path(out)
    if target.exists() and (not target.is_dir() or any(target.iterdir())):
        raise RunError(f"{target} exists and is not an empty folder: merge into a new one")
    adapters = [resolve_adapter(x, runs_dir) for x in inputs]
    names = [n for n, _, _ in adapters]
    if len(set(names)) < len(names):
        raise ConfigError(f"merge: an adapter given twice ({', '.join(names)})")
    w = parse_weights(weights, len(adapters))
    ms = base_of(adapters, base, quant)

    from peft import PeftModel

    from edgetune.engine.models.adapter import check_adapter_fits
    from edgetune.engine.models.model import base_model_id, load_base

    model, tok, base_path = load_base(ms)
    for i, (name, folder, _) in enumerate(adapters):
        check_adapter_fits(model, folder)  # another base: one line naming it
        if i == 0:
            model = PeftModel.from_pretrained(model, str(folder), adapter_name=f"in{i}")
        else:
            model.load_adapter(str(folder), adapter_name=f"in{i}")
    ranks = [model.peft_config[f"in{i}"].r for i in range(len(adapters))]
    try:
        model.add_weighted_adapter([f"in{i}" for i in range(len(adapters))], w, adapter_name="default",
                                   combination_type=METHODS[method], density=density if method in ("ties", "dare")
                                   else None, svd_rank=max(ranks) if method == "svd" else None)
    except (ValueError, TypeError) as e:
        raise ModelError(f"merge --method {method}: {str(e).splitlines()[0].rstrip('.')}"
                         + ("; svd takes adapters of any ranks and layers" if method != "svd" else "")) from None
    base_id, _ = base_model_id(ms.name, base_path)
    with atomic_dir(target) as tmp:
        model.save_pretrained(tmp, selected_adapters=["default"])
        config_path = tmp / "adapter_config.json"
        config = json.loads(config_path.read_text())
        config["base_model_name_or_path"] = base_id
        config_path.write_text(json.dumps(config, indent=2, sort_keys=True))
        (tmp / "edgetune.json").write_text(json.dumps({
            "base_model": base_id, "base_path": base_path, "method": "merge",
            "merge": {"method": method, "peft_combination": METHODS[method], "weights": w,
                      **({"density": density} if method in ("ties", "dare") else {}),
                      "from": [{"name": n, "adapter": str(f.resolve()), "weight": x}
                               for (n, f, _), x in zip(adapters, w)]}}, indent=2))
        tok.save_pretrained(tmp)
    return target


def add_parser(sub) -> argparse.ArgumentParser:
    m = sub.add_parser("merge", help="combine adapters of one base into a new adapter (PEFT's add_weighted_adapter)",
                       description=__doc__.split("\n\n")[0])
    m.add_argument("adapters", nargs="+", metavar="RUN_OR_FOLDER",
                   help="run names of --runs-dir, run folders or adapter folders (two or more)")
    m.add_argument("--out", required=True, help="the new adapter folder (new, or an empty folder)")
    m.add_argument("--method", default="linear", choices=list(METHODS),
                   help="linear (one rank, same layers), ties, dare (one rank; --density), svd (any ranks and layers)")
    m.add_argument("--weights", metavar="W1,W2,...", help="one weight an adapter (default: equal, summing to 1)")
    m.add_argument("--density", type=float, default=0.5, help="ties, dare: the share of each update kept (default 0.5)")
    m.add_argument("--base", metavar="MODEL", help="the base (default: the first run's model)")
    m.add_argument("--quant", choices=("nf4", "int8", "none"), help="how the base is loaded (default: the first "
                                                                    "run's)")
    m.add_argument("--runs-dir", default="runs", help="where run names are looked up")
    m.set_defaults(fn=run)
    return m


def run(a) -> int:
    from transformers.utils import logging

    logging.disable_progress_bar()  # its output is one line
    out = merge(a.adapters, a.out, a.method, a.weights, a.density, a.base, a.quant, a.runs_dir)
    print(f"merged {len(a.adapters)} adapters ({a.method}) into {out}")
    return 0
