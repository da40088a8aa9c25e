"""The F-GRPO loop. Mechanics on the tiny random Llama (conftest.py): log-probs recomputed
for training equal the sampling-time ones, events carry their fields, a stopped run
resumes to the same end, the KL reference is the base with the adapter off, and
`evaluate_adapter` reads an exported adapter. The learning test runs the quick-start
preset on the embedded SmolLM2-135M and checks held-out success rises (slow)."""

import json

import pytest
import torch
from inline_run import run_inline

from edgetune.engine.core.settings import resolve

from edgetune.engine.training import grading
from edgetune.engine.training.lm_loss import completion_logprobs

from edgetune.engine.methods.fgrpo import fgrpo

# Depends on every character, so rewards differ within groups even for a random model.
REWARD_PY = "def reward(completion, answer, row):\n    return (sum(map(ord, completion)) % 7) / 6\n"


@pytest.fixture(scope="module")
def rl_files(tmp_path_factory):
    root = tmp_path_factory.mktemp("fgrpo")
    rows = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (root / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (root / "reward.py").write_text(REWARD_PY)
    return root


def config(tiny_model_dir, rl_files, tmp_path, **fgrpo_overrides):
    return resolve(overrides={
        "method": "fgrpo",
        "model": {"name": str(tiny_model_dir), "quant": "none", "gradient_checkpointing": False},
        "lora": {"r": 4, "alpha": 8},
        "data": {"path": str(rl_files / "rl.jsonl"), "eval_fraction": 0.2},
        "run": {"runs_dir": str(tmp_path), "seed": 1, "checkpoint_every": 0},
        "fgrpo": {"num_generations": 4, "prompts_per_step": 2, "max_new_tokens": 6, "steps": 3,
                  "reward": "file", "reward_file": str(rl_files / "reward.py"), "success_threshold": 0.5,
                  "lr": 5e-3, "micro_batch_size": 3, "eval_prompts": 3, "eval_k": 2, "sample_every": 2,
                  "temperature": 0.9, **fgrpo_overrides},
    })


def run_fgrpo(cfg, path, stop_after=0, resume=False):
    return run_inline(fgrpo.train, cfg, path, stop_after=stop_after, resume=resume)


def test_training_logprobs_equal_sampling_logprobs(tiny_model_dir, rl_files, tmp_path):
    from edgetune.engine.models import model as model_lib

    from edgetune.engine.generation.rollouts import generate

    cfg = config(tiny_model_dir, rl_files, tmp_path)
    model, tok, _ = model_lib.load(cfg)
    with torch.no_grad():  # a non-zero adapter, so the LoRA path is part of what is compared
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    prompts = ["What is 1 plus 2?", "Hi", "What is the sum of three and four, please?"]
    roll = generate(model, tok, prompts, num_generations=2, max_new_tokens=12, temperature=0.7, seed=0)
    assert roll.prompt_mask[:, 0].min() == 0  # prompts of different lengths: left padding is exercised
    model.eval()
    with torch.no_grad():
        full = completion_logprobs(model, roll.prompt_ids, roll.prompt_mask, roll.completion_ids,
                                         roll.completion_mask, temperature=0.7)
        idx = torch.tensor([1, 4])  # a sub-batch is trimmed to its own padding
        part = completion_logprobs(model, *fgrpo._rows_of(roll, idx), temperature=0.7)
    m = roll.completion_mask.bool()
    assert (full[~m] == 0).all()
    assert torch.allclose(full[m], roll.logprobs[m], atol=1e-4)
    assert torch.allclose(part, full[idx], atol=1e-5)


def test_no_held_out_rows_means_no_evaluation_during_training(tiny_model_dir, rl_files, tmp_path):
    """data.eval_fraction 0 and no data.eval_path: every row trains and nothing is evaluated
    (the documented way to switch training-time evaluation off; fgrpo.eval_prompts 0 means
    the whole held-out split)."""
    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=2, eval_every=1)
    cfg.data.eval_fraction = 0.0
    _, _, events = run_fgrpo(cfg, tmp_path / "run")
    assert events[-1]["type"] == "finished" and events[-1]["step"] == 2
    report = next(e for e in events if e["type"] == "data")["report"]
    assert report["eval_rows"] == 0 and report["train_rows"] == 20
    assert not [e for e in events if e["type"] == "eval"]


def test_events_and_resume(tiny_model_dir, rl_files, tmp_path):
    cfg = config(tiny_model_dir, rl_files, tmp_path, gamma=1.0)
    cfg.run.checkpoint_every = 1
    full, m_full, ev_full = run_fgrpo(cfg, tmp_path / "full")
    part, _, ev_part = run_fgrpo(cfg, tmp_path / "part", stop_after=2)
    assert ev_part[-1]["type"] == "stopped" and ev_part[-1]["step"] == 2
    part, m_part, ev_part = run_fgrpo(cfg, tmp_path / "part", resume=True)
    assert ev_part[-1]["type"] == "finished" and ev_part[-1]["step"] == 3

    def steps(events):
        return [(e["step"], e["reward_mean"], e["loss"], e["grad_norm"]) for e in events if e["type"] == "step"]

    assert steps(ev_part) == steps(ev_full)
    assert m_part["success_rate_end"] == m_full["success_rate_end"]
    from safetensors.torch import load_file

    a = load_file(str(full.adapter / "adapter_model.safetensors"))
    b = load_file(str(part.adapter / "adapter_model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(float(v.abs().max()) > 0 for k, v in a.items() if "lora_B" in k)  # training moved the adapter

    step = next(e for e in ev_full if e["type"] == "step")
    want = {"reward_mean", "reward_std", "success_rate", "all_correct", "all_wrong", "focal_weight", "dropped",
            "kl", "clip_ratio", "completion_len", "gen_tokens_per_s", "train_tokens_per_s", "gpu", "host_rss",
            "elapsed", "eta", "lr", "grad_norm", "loss"}
    assert want <= step.keys()
    assert step["reward_std"] > 0 and step["grad_norm"] > 0
    evals = [e for e in ev_full if e["type"] == "eval"]
    # the adapter's, then the base model's (step 0), measured after training with the adapter off
    assert [e["step"] for e in evals] == [3, 0]
    base = evals[-1]
    assert {"success_rate", "pass@1", "pass@2"} <= base.keys()
    assert 0 <= base["pass@1"] <= base["pass@2"] <= 1
    # the same figures as the base model measured alone (`edgetune eval --adapter ''`)
    alone = grading.evaluate_adapter(cfg, None)
    assert {k: alone[k] for k in ("success_rate", "pass@1", "pass@2")} == \
        {k: base[k] for k in ("success_rate", "pass@1", "pass@2")}
    assert m_full["success_rate_start"] == base["success_rate"]
    assert [e["step"] for e in ev_full if e["type"] == "sample"] == [2]
    # The final evaluation's greedy completions of the first fgrpo.samples (3) held-out
    # prompts, with their answers, as the Train tab and the CLI show them (the base's: none).
    samples = [e for e in ev_full if e["type"] == "samples"]
    assert [e["step"] for e in samples] == [3] and [len(e["samples"]) for e in samples] == [3]
    for x in samples[-1]["samples"]:
        a, b = map(int, x["prompt"].removeprefix("What is ").removesuffix("?").split(" plus "))
        assert x["reference"] == str(a + b) and isinstance(x["completion"], str)


def test_sebp_is_lifted_for_generation_and_back_for_the_update(tiny_model_dir, rl_files, tmp_path, monkeypatch):
    """With SEBP on, generation runs on the unpatched model (the rollouts' packed fast path
    refuses patched layers) and every update takes SEBP's sparse backward again; the run
    equals the run without SEBP."""
    from edgetune.kernels import sebp

    calls = {"sparse": 0, "patched_at_generate": []}
    orig_backward = sebp._sparse_backward
    orig_generate = fgrpo.generate

    def counting_backward(*a, **k):
        calls["sparse"] += 1
        return orig_backward(*a, **k)

    def watching_generate(model, *a, **k):
        calls["patched_at_generate"].append(getattr(model, "_sebp_handle", None) is not None)
        return orig_generate(model, *a, **k)

    monkeypatch.setattr(sebp, "_sparse_backward", counting_backward)
    monkeypatch.setattr(fgrpo, "generate", watching_generate)  # the training rollouts
    monkeypatch.setattr(grading, "generate", watching_generate)  # the held-out evaluations
    # the torch path of the same math: the Triton kernels' equality has its own tests, and the
    # interpreter would take a minute here
    monkeypatch.setattr(sebp, "_use_triton", lambda t, backend: False)
    # prompts of very different lengths: the update's micro-batches have left padding to skip
    rows = [{"prompt": "What is " + " ".join(["very"] * (3 * i)) + f" {i} plus 1?", "answer": str(i + 1)}
            for i in range(10)]
    (tmp_path / "varied.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def cfg_with(use):
        cfg = config(tiny_model_dir, rl_files, tmp_path, steps=2, sebp=use)
        cfg.data.path = str(tmp_path / "varied.jsonl")
        return cfg

    _, _, ev_off = run_fgrpo(cfg_with(False), tmp_path / "off")
    assert calls["sparse"] == 0
    _, _, ev_on = run_fgrpo(cfg_with(True), tmp_path / "on")
    assert calls["sparse"] > 0
    # every generation (two runs x two steps, and the held-out evaluations) saw no patch
    assert len(calls["patched_at_generate"]) >= 4 and not any(calls["patched_at_generate"])
    for a, b in zip([e for e in ev_off if e["type"] == "step"], [e for e in ev_on if e["type"] == "step"]):
        assert a["reward_mean"] == b["reward_mean"]
        assert abs(a["loss"] - b["loss"]) <= 1e-5 and abs(a["grad_norm"] - b["grad_norm"]) <= 1e-4 * a["grad_norm"]


ADV = torch.tensor([1.0, -1.0, 0.5, -0.5, 2.0, -2.0, 0.3, -0.3])


def fixed_rollouts(cfg, lengths):
    """The tiny model with random LoRA B factors, and 8 sampled completions cut to `lengths`,
    whose old log-probs are a little off (the ratio is not 1)."""
    from edgetune.engine.models import model as model_lib

    from edgetune.engine.generation.rollouts import generate

    model, tok, _ = model_lib.load(cfg)
    with torch.no_grad():
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.2)
    roll = generate(model, tok, ["What is 1 plus 2?", "Hi", "Count to five.", "Name a colour."],
                    num_generations=2, max_new_tokens=12, temperature=0.7, seed=0)
    for i, length in enumerate(lengths):
        roll.completion_mask[i, length:] = 0
        roll.logprobs[i, length:] = 0
    roll.logprobs -= 0.05 * roll.completion_mask
    return model, roll


def sgd_update(model, roll, adv, s) -> tuple[dict, list[torch.Tensor]]:
    """One policy_update from the model's current LoRA weights with plain SGD at lr 1 (the
    parameters move by exactly -gradient); the weights are put back. (metrics, change)."""
    params = [p for p in model.parameters() if p.requires_grad]
    start = [p.detach().clone() for p in params]
    opt = torch.optim.SGD(params, lr=1.0)
    out = fgrpo.policy_update(model, roll, adv, s, opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda _: 1.0))
    change = [p.detach() - p0 for p, p0 in zip(params, start)]
    with torch.no_grad():
        for p, p0 in zip(params, start):
            p.copy_(p0)
    return out, change


@pytest.mark.parametrize("loss_type", ["grpo", "dapo", "dr_grpo", "cispo"])
def test_micro_batches_give_the_whole_batch_update(tiny_model_dir, rl_files, tmp_path, loss_type):
    """The update on 8 completions of very different lengths is the same in one micro-batch,
    in 3 and in 1: each loss type's normaliser is that of the whole rollout batch."""
    import dataclasses

    cfg = config(tiny_model_dir, rl_files, tmp_path, loss_type=loss_type, max_grad_norm=0.0,
                 epsilon_high=5.0 if loss_type == "cispo" else 0.28)
    model, roll = fixed_rollouts(cfg, (1, 12, 2, 9, 3, 12, 1, 6))

    def update(micro_batch_size):
        return sgd_update(model, roll, ADV, dataclasses.replace(cfg.fgrpo, micro_batch_size=micro_batch_size))[1]

    whole = update(8)
    assert max(float(d.abs().max()) for d in whole) > 1e-4
    for mb in (3, 1):
        for a, b in zip(update(mb), whole):
            assert torch.allclose(a, b, atol=1e-6, rtol=0)


def test_mask_truncated_updates_as_if_the_cut_rows_were_not_there(tiny_model_dir, rl_files, tmp_path):
    """mask_truncated (dapo): the update on 8 completions, 3 of them cut at the cap, equals the
    plain update on the other 5 alone (their tokens leave the loss and its token count)."""
    import dataclasses

    cfg = config(tiny_model_dir, rl_files, tmp_path, max_grad_norm=0.0)
    lengths = (1, 12, 2, 9, 3, 12, 1, 12)
    model, roll = fixed_rollouts(cfg, lengths)
    roll.truncated = [length == 12 for length in lengths]
    kept = [i for i, cut in enumerate(roll.truncated) if not cut]
    rest = dataclasses.replace(
        roll, **{k: getattr(roll, k)[kept] for k in ("prompt_ids", "prompt_mask", "completion_ids",
                                                    "completion_mask", "logprobs")},
        texts=[roll.texts[i] for i in kept], prompt_index=[roll.prompt_index[i] for i in kept],
        truncated=[False] * len(kept))
    out, masked = sgd_update(model, roll, ADV, dataclasses.replace(cfg.fgrpo, mask_truncated=True))
    _, alone = sgd_update(model, rest, ADV[kept], cfg.fgrpo)
    _, plain = sgd_update(model, roll, ADV, cfg.fgrpo)
    assert out["dropped"] == 3
    for a, b in zip(masked, alone):
        assert torch.allclose(a, b, atol=1e-6, rtol=0)
    assert max(float((a - c).abs().max()) for a, c in zip(masked, plain)) > 1e-4  # the cut rows did matter


def test_zero_advantage_rows_are_dropped(tiny_model_dir, rl_files, tmp_path):
    # A constant reward: every group is uniform, nothing to learn, nothing computed.
    const = rl_files / "const.py"
    const.write_text("def reward(completion, answer, row):\n    return 1.0\n")
    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=1, reward_file=str(const), eval_prompts=0)
    _, _, events = run_fgrpo(cfg, tmp_path / "const")
    step = next(e for e in events if e["type"] == "step")
    assert step["dropped"] == 8 and step["all_correct"] == 1.0 and step["grad_norm"] == 0.0
    assert step["focal_weight"] == 0.0  # gamma = 1, p̂ = 1


def test_normalized_focal_weights_scale_the_first_gradient_by_one_over_their_mean(tiny_model_dir, rl_files, tmp_path):
    """Same seed, same rollouts: the first step's gradient (linear in the advantages) and the
    mean focal weight both change by the factor the normalisation divides by."""
    def first_step(normalize, name):
        cfg = config(tiny_model_dir, rl_files, tmp_path, steps=1, eval_prompts=0, focal_normalize=normalize)
        _, _, events = run_fgrpo(cfg, tmp_path / name)
        return next(e for e in events if e["type"] == "step")

    plain, norm = first_step(False, "plain"), first_step(True, "norm")
    assert plain["reward_mean"] == norm["reward_mean"]  # the same completions were scored
    factor = norm["focal_weight"] / plain["focal_weight"]
    assert abs(factor - 1) > 0.05  # the groups' p̂ differ here, so the normalisation did something
    assert norm["grad_norm"] / plain["grad_norm"] == pytest.approx(factor, rel=1e-4)


def test_a_run_whose_rollouts_stay_cut_at_the_cap_is_warned_once():
    assert fgrpo.cut_warning([1.0, 1.0, 1.0], 32) is None  # fewer steps than the window
    assert fgrpo.cut_warning([1.0, 0.5, 0.95, 0.9, 1.0], 32) is None  # one step of the last four below
    msg = fgrpo.cut_warning([0.5, 0.95, 0.9, 1.0, 0.93], 32)
    assert msg.startswith("94% of the completions of the last 4 steps") and "fgrpo.max_new_tokens=32" in msg


def test_the_cut_warning_reaches_the_events(tiny_model_dir, rl_files, tmp_path):
    # The tiny random model never stops before 6 tokens: every completion is cut.
    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=5, eval_prompts=0)
    _, _, events = run_fgrpo(cfg, tmp_path / "cut")
    assert all(e["truncated"] == 1.0 for e in events if e["type"] == "step")
    warnings = [(i, e["message"]) for i, e in enumerate(events) if e["type"] == "warning"]
    assert len(warnings) == 1 and "100% of the completions" in warnings[0][1]
    assert "fgrpo.max_new_tokens=6" in warnings[0][1]
    steps_before = [e["step"] for e in events[:warnings[0][0]] if e["type"] == "step"]
    assert steps_before == [1, 2, 3]  # found with the fourth step's rollouts


def test_kl_reference_is_the_base_with_the_adapter_off(tiny_model_dir, rl_files, tmp_path):
    cfg = config(tiny_model_dir, rl_files, tmp_path, beta=0.1, eval_prompts=0)
    _, _, events = run_fgrpo(cfg, tmp_path / "kl")
    kl = [e["kl"] for e in events if e["type"] == "step"]
    assert kl[0] < 1e-9  # step 1: a fresh LoRA (B = 0) is the base model exactly
    assert kl[2] > 1e-6  # after two updates the policy has left the base
    assert all(e["dropped"] == 0 for e in events if e["type"] == "step")  # KL keeps every row
    # at beta = 0 the loss has no KL term and none is measured: the step says so (None), and
    # the Train tab's KL plot says why it is empty
    cfg0 = config(tiny_model_dir, rl_files, tmp_path, beta=0.0, eval_prompts=0, steps=1)
    _, _, events0 = run_fgrpo(cfg0, tmp_path / "no-kl")
    assert [e["kl"] for e in events0 if e["type"] == "step"] == [None]
    from edgetune.app import live
    from edgetune.app.methods import BY_KEY

    kl_plot = BY_KEY["fgrpo"].plots[2]
    fig = live.plot_figure(live.plot_frame(events0, kl_plot), kl_plot, stepped=True)
    assert "fgrpo.beta is 0" in fig.axes[0].texts[0].get_text()
    fig = live.plot_figure(live.plot_frame(events, kl_plot), kl_plot, stepped=True)
    assert not fig.axes[0].texts and len(fig.axes[0].lines[0].get_ydata()) == 3


def test_evaluate_adapter(tiny_model_dir, rl_files, tmp_path):
    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=1)
    run, metrics, _ = run_fgrpo(cfg, tmp_path / "ev")
    out = grading.evaluate_adapter(cfg, str(run.adapter))
    assert out["prompts"] == 3 and {"success_rate", "pass@1", "pass@2"} <= out.keys()
    assert out["pass@1"] == pytest.approx(metrics["pass@1_end"])  # same seed, same adapter
    from edgetune.engine.core.errors import ConfigError

    with pytest.raises(ConfigError, match="adapter_config.json"):
        grading.evaluate_adapter(cfg, str(tmp_path))


def test_eval_compares_the_base_and_adapters_on_the_same_prompts(tiny_model_dir, rl_files, tmp_path):
    """The base and two adapters graded on the same held-out prompts: each score is the mean
    of its per-prompt outcomes and equals what the run measured, and every pair is compared
    prompt by prompt. A finished run records its own base-against-adapter comparison, the
    same numbers `edgetune eval` finds."""
    from edgetune.engine.run import evaluation

    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=2, eval_prompts=4)
    run_a, m_a, ev_a = run_fgrpo(cfg, tmp_path / "a")
    run_b, m_b, _ = run_fgrpo(config(tiny_model_dir, rl_files, tmp_path, steps=2, eval_prompts=4, lr=3e-2),
                              tmp_path / "b")
    a, b = str(run_a.path), str(run_b.path)
    (out,) = evaluation.compare(cfg, evaluation.system_names([a, b, a], base=True))["tasks"]
    base, sa, sb = out["systems"]
    assert [s["name"] for s in out["systems"]] == ["the base", a, b] and out["prompts"] == 4
    for s in out["systems"]:
        assert {k: len(v) for k, v in s["per_prompt"].items()} == dict.fromkeys(
            ("success_rate", "reward", "pass@1", "pass@2"), 4)
        for metric, score in s["scores"].items():
            assert score["estimate"] == pytest.approx(sum(s["per_prompt"][metric]) / 4)
            assert score["low"] <= score["estimate"] <= score["high"]
    for metric in ("success_rate", "pass@1"):  # the numbers the runs measured, base and adapter
        assert sa["scores"][metric]["estimate"] == pytest.approx(m_a[f"{metric}_end"])
        assert sb["scores"][metric]["estimate"] == pytest.approx(m_b[f"{metric}_end"])
        assert base["scores"][metric]["estimate"] == pytest.approx(m_a[f"{metric}_start"])
    assert [(c["a"], c["b"], c["metric"]) for c in out["comparisons"]] == [
        ("the base", a, "success_rate"), ("the base", a, "reward"), ("the base", b, "success_rate"),
        ("the base", b, "reward"), (a, b, "success_rate"), (a, b, "reward")]
    systems = {s["name"]: s["per_prompt"] for s in out["systems"]}
    for c in out["comparisons"]:
        xa, xb = systems[c["a"]][c["metric"]], systems[c["b"]][c["metric"]]
        assert c["difference"] == pytest.approx(sum(xb) / 4 - sum(xa) / 4) and c["n"] == 4
        if c["metric"] == "success_rate":
            assert (c["better"], c["worse"]) == (sum(y > x for x, y in zip(xa, xb)), sum(x > y for x, y in zip(xa, xb)))
        assert c["words"].startswith(f"{c['a']} vs {c['b']}: no detectable difference on 4 prompts") or \
            c["words"].startswith(f"{c['b']} is ")
    # the run's own comparison: base (step 0) against its final adapter on the same prompts
    recorded = [e for e in ev_a if e["type"] == "comparison"]
    assert [(e["a"], e["b"], e["metric"]) for e in recorded] == [
        ("the base", "the adapter", "success_rate"), ("the base", "the adapter", "reward")]
    fields = ("difference", "low", "high", "p_value", "better", "worse", "needed")
    for e, c in zip(recorded, out["comparisons"][:2]):
        assert {k: e[k] for k in fields} == pytest.approx({k: c[k] for k in fields})
    from edgetune.app import live

    shown = live.log_lines(ev_a).splitlines()  # the Train tab's events, newest first
    assert [ln[9:] for ln in shown[2:4]] == [f"held-out {e['metric']}: {e['words']}" for e in recorded[::-1]]


def test_eval_grades_with_the_methods_own_reward_and_refuses_a_method_without_one():
    from edgetune.engine.core.errors import ConfigError

    essa = resolve(preset="essa-quickstart", overrides=["essa.reward=exact"])
    s = grading.held_out_grading(essa)
    assert (s.reward, s.max_new_tokens, s.eval_prompts) == ("exact", 24, 30)
    with pytest.raises(ConfigError, match="SFT runs have no held-out prompts to grade"):
        grading.held_out_grading(resolve(preset="sft-quickstart"))


@pytest.mark.slow
def test_quickstart_raises_held_out_success(tmp_path):
    """The fgrpo-quickstart preset, as shipped (seed 0, embedded SmolLM2-135M in NF4, fp32
    compute on the CPU, 32 steps of 4 prompts x 8 completions), raises greedy success and
    sampled pass@1 on the 30 held-out pairs above their start, both measured in fp32.
    About 11 minutes on 2 idle CPU cores; a recorded run (10% -> 97% greedy) is in
    bench/results/2026-12-03-cpu/fgrpo-quickstart/."""
    cfg = resolve(preset="fgrpo-quickstart", overrides=[f"run.runs_dir={tmp_path}"])
    assert cfg.model.dtype == "auto" and not torch.cuda.is_available()  # fp32 before and after
    run, metrics, events = run_fgrpo(cfg, tmp_path / "quickstart")
    assert events[-1]["type"] == "finished" and events[-1]["step"] == cfg.fgrpo.steps
    evals = [e for e in events if e["type"] == "eval"]
    # the adapter's evaluation, then the base's (step 0: the adapter switched off) after training
    assert [e["step"] for e in evals] == [cfg.fgrpo.steps, 0] and evals[1]["prompts"] == 30
    assert metrics["success_rate_end"] > metrics["success_rate_start"]
    assert metrics["pass@1_end"] > metrics["pass@1_start"]
    steps = [e for e in events if e["type"] == "step"]
    first, last = steps[: len(steps) // 2], steps[len(steps) // 2 :]
    assert sum(e["reward_mean"] for e in last) / len(last) > sum(e["reward_mean"] for e in first) / len(first)


def test_finished_run_trains_more_steps_at_the_final_learning_rate(tiny_model_dir, rl_files, tmp_path):
    """`resume --more-steps` on an F-GRPO run: from its final checkpoint to the new step
    count in config.yaml, the added step at the schedule's final rate (0.1 x fgrpo.lr)."""
    import signal

    from edgetune.engine.core.events import read_events
    from edgetune.engine.core.settings import load_run_config

    from edgetune.engine.run import api, worker

    cfg = config(tiny_model_dir, rl_files, tmp_path, steps=2, eval_prompts=2, eval_k=0)
    path = tmp_path / "r"
    run_fgrpo(cfg, path)
    (path / "config.yaml").write_text(cfg.to_yaml())
    api.more_steps(api.Run(path), load_run_config(path / "config.yaml"), 1)
    sigterm = signal.getsignal(signal.SIGTERM)  # the worker sets its own
    try:
        assert worker.run(str(path), resume=True, owns_pid=False) == 0
    finally:
        signal.signal(signal.SIGTERM, sigterm)
    events = read_events(path / "events.jsonl")
    assert load_run_config(path / "config.yaml").fgrpo.steps == 3
    assert [e["resumed_from"] for e in events if e["type"] == "started"] == [2]
    assert events[-1]["type"] == "finished" and events[-1]["step"] == 3
    lrs = {e["step"]: e["lr"] for e in events if e["type"] == "step"}
    assert lrs == pytest.approx({1: lrs[1], 2: 0.1 * cfg.fgrpo.lr, 3: 0.1 * cfg.fgrpo.lr}) and lrs[1] > lrs[2]
    assert [e["step"] for e in events if e["type"] == "samples"] == [2, 3]
    # the base model measured once, after the first two steps; not again after the third
    assert [e["step"] for e in events if e["type"] == "eval"] == [2, 0, 3]
