"""Did it help? The base model and any number of adapters graded on the same held-out
prompts, each score with its 95% interval, and every pair of systems compared on those
prompts with a paired test (engine/training/stats.py) and a sentence saying the answer.

`compare(cfg, systems)` grades each system in turn (the config's held-out prompts, its
method's reward: engine/methods/fgrpo/evaluate.py's `evaluate_adapter`) and returns a plain dict
(`edgetune eval --json` prints it as it is):

    {"reward_fn", "prompts",
     "systems": [{"name", "adapter", "scores": {metric: {estimate, low, high}},
                  "per_prompt": {metric: [value of each prompt]}}],
     "comparisons": [{"a", "b", "metric", "kind", "n", "difference", "low", "high",
                      "p_value", "needed", "better", "worse", "words"}]}

Comparisons: each adapter against the base first, then the adapters against each other, on
the metrics of evaluate.COMPARED there.
"""

from __future__ import annotations

from itertools import combinations

from edgetune.engine.core.errors import ConfigError

from edgetune.engine.methods.fgrpo.evaluate import BASE, compare_held_out, evaluate_adapter, held_out_scores


def compare_results(results: list[tuple[str, dict]]) -> dict:
    """The comparison dict of already graded systems: (name, evaluate_adapter's result),
    the base (if any) named BASE."""
    if not results:
        raise ConfigError("nothing to evaluate: give --adapter (repeatable) and/or --base")
    counts = {r["prompts"] for _, r in results}
    if len(counts) != 1:
        raise ConfigError(f"the systems were graded on different numbers of prompts ({sorted(counts)})")
    systems = [{"name": name, "adapter": r.get("adapter"), "scores": held_out_scores(r["per_prompt"]),
                "per_prompt": r["per_prompt"]} for name, r in results]
    base = [s for s in systems if s["name"] == BASE]
    adapters = [s for s in systems if s["name"] != BASE]
    pairs = [(base[0], s) for s in adapters] if base else []
    pairs += list(combinations(adapters, 2))
    comparisons = [c for a, b in pairs
                   for c in compare_held_out(a["name"], a["per_prompt"], b["name"], b["per_prompt"])]
    return {"reward_fn": results[0][1].get("reward_fn"), "prompts": counts.pop(), "systems": systems,
            "comparisons": comparisons}


def system_names(adapters: list[str], base: bool) -> list[tuple[str, str]]:
    """(name, adapter path or "") of each system to grade: the base first. An adapter given
    as '' is the base; a name given twice is graded once."""
    out = [(BASE, "")] if base or "" in adapters else []
    for a in adapters:
        if a and a not in [p for _, p in out]:
            out.append((a, a))
    return out


def compare(cfg, systems: list[tuple[str, str]], progress=None) -> dict:
    """Grade each (name, adapter path or "" for the base) on cfg's held-out prompts and
    compare them. progress(name, index, prompts_done, total) as it goes."""
    results = []
    for i, (name, path) in enumerate(systems):
        tick = (lambda done, total, name=name, i=i: progress(name, i, done, total)) if progress else None
        results.append((name, evaluate_adapter(cfg, path, progress=tick)))
    return compare_results(results)
