"""The ESSA loop on a tiny random Llama with the embedded model's tokenizer: batched and
sequential evaluation agree, a stopped run resumes to the same end, the exported adapter
is a plain PEFT adapter, and the SFT warm start runs inside the ESSA run."""

import json

import numpy as np
import pytest
import torch
from inline_run import essa_start, run_inline

from edgetune.engine.core.settings import resolve

from edgetune.engine.training.loop import RunContext

from edgetune.engine.methods.essa import essa
from edgetune.engine.methods.essa.population import Evaluator
from edgetune.engine.methods.essa.space import SVDSpace
from edgetune.engine.methods.essa.warm_start import warm_start

# A reward that depends on every character of the completion, so that equal fitness
# means equal text (random tiny models rarely write the right number).
REWARD_PY = "def reward(completion, answer, row):\n    return (sum(map(ord, completion)) % 101) / 100\n"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory, tiny_model_dir):
    """(folder with: model -> the tiny Llama, warm -> a warm-start adapter with non-zero
    factors, rl.jsonl, sft.jsonl, reward.py)."""
    root = essa_start(tmp_path_factory.mktemp("essa"), tiny_model_dir)
    sft = [{"prompt": f"What is {a} plus {b}?", "completion": f"Answer: {a + b}"} for a in range(4) for b in range(4)]
    (root / "sft.jsonl").write_text("".join(json.dumps(r) + "\n" for r in sft))
    (root / "reward.py").write_text(REWARD_PY)
    return root


def config(tiny, tmp_path, **essa_overrides):
    overrides = {
        "method": "essa",
        "model": {"name": str(tiny / "model"), "quant": "none"},
        "lora": {"r": 4, "alpha": 8, "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj"]},
        "data": {"path": str(tiny / "rl.jsonl"), "eval_fraction": 0.2},
        "run": {"runs_dir": str(tmp_path), "seed": 3, "checkpoint_every": 0},
        "essa": {"warm_start": str(tiny / "warm"), "population": 4, "generations": 4, "prompts_per_generation": 3,
                 "max_new_tokens": 6, "reward": "file", "reward_file": str(tiny / "reward.py"), "eval_every": 2,
                 "eval_prompts": 4, "sigma0": 0.5, **essa_overrides},
    }
    return resolve(overrides=overrides)


def run_essa(cfg, path, stop_after=0, resume=False):
    return run_inline(essa.train, cfg, path, stop_after=stop_after, resume=resume)


def evaluator_parts(tiny, tmp_path):
    """(settings, model, tokenizer, space, reward, rows) for scoring candidates directly."""
    from edgetune.engine.training.rewards import build_reward

    cfg = config(tiny, tmp_path)
    model, tok, _ = essa.load_model(cfg, tiny / "warm")
    rows = [{"prompt": f"What is {a} plus 2?", "answer": str(a + 2)} for a in range(3)]
    return cfg, model, tok, SVDSpace(model), build_reward("file", str(tiny / "reward.py")), rows


def test_batched_and_sequential_give_the_same_fitness(tiny, tmp_path):
    cfg, model, tok, space, reward, rows = evaluator_parts(tiny, tmp_path)
    xs = np.random.default_rng(0).normal(scale=1.0, size=(5, space.dim))
    seq = Evaluator(model, tok, space, reward, cfg.essa).population(xs, rows)
    cfg.essa.evaluation = "batched"
    got = {}
    for k in (5, 2):  # all at once, and chunks of 2 + 2 + 1
        got[k] = Evaluator(model, tok, space, reward, cfg.essa, candidates_per_batch=k).population(
            xs, rows, on_candidate=lambda i, f, s: None)
    assert got[5] == seq and got[2] == seq
    assert len(set(seq)) > 1  # candidates really differ


def test_a_batch_that_runs_out_of_gpu_memory_is_scored_again_in_halves(tiny, tmp_path):
    """Another process taking GPU memory after K was sized: the run goes on with fewer
    candidates a batch, the same fitness, and one warning each time K is halved."""
    cfg, model, tok, space, reward, rows = evaluator_parts(tiny, tmp_path)
    xs = np.random.default_rng(1).normal(scale=1.0, size=(5, space.dim))
    seq = Evaluator(model, tok, space, reward, cfg.essa).population(xs, rows)
    cfg.essa.evaluation = "batched"
    warnings, batches = [], []
    ev = Evaluator(model, tok, space, reward, cfg.essa, candidates_per_batch=5, warn=warnings.append)
    real = ev._fitness

    def fitness_that_fits_two(rows_, seed, fast, k=1, kind=None):
        batches.append(k)
        if k > 2:
            raise torch.OutOfMemoryError("CUDA out of memory (stand-in)")
        return real(rows_, seed, fast, k, kind)

    ev._fitness = fitness_that_fits_two
    got = ev.population(xs, rows, on_candidate=lambda i, f, s: None)
    assert got == seq
    assert batches == [5, 2, 2, 1] and ev.k == 2  # 5 fails, then 2 + 2 + the last 1
    assert len(warnings) == 1 and "5 ESSA candidates" in warnings[0] and "continuing with 2" in warnings[0]
    one = Evaluator(model, tok, space, reward, cfg.essa, candidates_per_batch=1)
    one._fitness = lambda *a, **k: (_ for _ in ()).throw(torch.OutOfMemoryError("stand-in"))
    with pytest.raises(torch.OutOfMemoryError):  # one candidate a batch: nothing smaller to try
        one.population(xs, rows)


def test_stopped_run_resumes_to_the_same_end(tiny, tmp_path):
    cfg = config(tiny, tmp_path)
    full, m_full, ev_full = run_essa(cfg, tmp_path / "full")
    part, _, ev_part = run_essa(cfg, tmp_path / "part", stop_after=2)
    assert ev_part[-1]["type"] == "stopped" and ev_part[-1]["step"] == 2
    assert part.last_checkpoint()[0] == 2
    part, m_part, ev_part = run_essa(cfg, tmp_path / "part", resume=True)
    assert ev_part[-1]["type"] == "finished" and ev_part[-1]["step"] == 4

    def fitnesses(events):
        return [(e["generation"], e["index"], e["fitness"]) for e in events if e["type"] == "candidate"]

    assert fitnesses(ev_part) == fitnesses(ev_full)
    steps = [(e["step"], e["sigma"], e["best_so_far"]) for e in ev_full if e["type"] == "step"]
    assert steps == [(e["step"], e["sigma"], e["best_so_far"]) for e in ev_part if e["type"] == "step"]
    assert m_part["best_fitness"] == m_full["best_fitness"]
    assert m_part["reward"] == m_full["reward"]
    from safetensors.torch import load_file

    a = load_file(str(full.adapter / "adapter_model.safetensors"))
    b = load_file(str(part.adapter / "adapter_model.safetensors"))
    warm = load_file(str(tiny / "warm" / "adapter_model.safetensors"))
    assert a.keys() == b.keys() == warm.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], warm[k]) for k in a)  # the search moved the adapter
    kinds = {e["type"] for e in ev_full}
    assert {"candidate", "step", "eval", "finished"} <= kinds
    evals = [e for e in ev_full if e["type"] == "eval"]
    assert [e["step"] for e in evals] == [0, 2, 4]
    step = next(e for e in ev_full if e["type"] == "step")
    assert {"best", "mean", "std", "sigma", "best_so_far", "elapsed", "eta", "gpu", "host_rss"} <= step.keys()


def test_exported_adapter_loads_with_peft_and_gives_the_same_logits(tiny, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    cfg = config(tiny, tmp_path)
    model, tok, _ = essa.load_model(cfg, tiny / "warm")
    space = SVDSpace(model)
    space.write(np.random.default_rng(1).normal(scale=0.5, size=space.dim))
    model.save_pretrained(tmp_path / "exported")
    fresh = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), tmp_path / "exported")
    ids = torch.tensor([[5, 17, 300, 41, 9]])
    with torch.no_grad():
        want = model(input_ids=ids).logits
        got = fresh.eval()(input_ids=ids).logits
    warm = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny / "model"), tiny / "warm").eval()
    with torch.no_grad():
        before = warm(input_ids=ids).logits
    assert torch.allclose(got, want, atol=1e-5)
    assert not torch.allclose(got, before, atol=1e-4)


def test_sft_warm_start_runs_first_and_is_kept_on_resume(tiny, tmp_path):
    cfg = config(tiny, tmp_path, warm_start="", warm_start_data=str(tiny / "sft.jsonl"), warm_start_steps=2,
                 generations=2, eval_every=0)
    cfg.sft.batch_size = 2
    run, metrics, events = run_essa(cfg, tmp_path / "ws")
    assert (run.path / "warm_start" / "COMPLETE").is_file()
    warm_events = [e for e in events if e["type"] == "warm_start"]
    assert [e["step"] for e in warm_events if e["event"] == "step"] == [1, 2]
    assert warm_events[-1]["event"] == "finished"
    assert events[-1]["type"] == "finished" and events[-1]["step"] == 2
    assert warm_start(RunContext(cfg=cfg, run=run, emit=lambda *a, **k: None)) == run.path / "warm_start" / "adapter"


def test_missing_warm_start_adapter_is_a_config_error(tiny, tmp_path):
    from edgetune.engine.core.errors import ConfigError

    cfg = config(tiny, tmp_path, warm_start=str(tmp_path / "nowhere"))
    with pytest.raises(ConfigError, match="essa.warm_start"):
        run_essa(cfg, tmp_path / "bad")


@pytest.mark.parametrize("override, message", [
    ("essa.warm_start_steps=0", "essa.warm_start_steps"),
    ("essa.eval_prompts=-1", "essa.eval_prompts"),
    ("essa.export=worst", "essa.export"),
    ("essa.evaluation=parallel", "essa.evaluation"),
    ("essa.alpha=0", "essa.alpha"),
    ("essa.population=2", r"essa.population must be in \[3, 4096\]"),
])
def test_bad_essa_settings_name_the_setting(override, message):
    from edgetune.engine.core.errors import ConfigError

    with pytest.raises(ConfigError, match=message):
        resolve(preset="essa-quickstart", overrides=[override])


def test_the_smallest_population_survives_generations_that_tie():
    """Greedy 0/1 fitness on a few prompts often ties a whole generation; with 2 candidates
    cma then fails in its next tell (so 3 is the least essa.population allows)."""
    s = resolve(preset="essa-quickstart", overrides=["essa.population=3"]).essa
    es = essa.make_es(480, s, seed=0)
    for _ in range(4):
        xs = es.ask()
        es.tell(xs, [0.0] * len(xs))
    assert len(xs) == 3 and np.isfinite(es.result.xfavorite).all()
