"""Run a method's `train(ctx)` in the test process on a run folder, the way the worker
does, with an optional stop request once step `stop_after` (or an event `stop_when` picks)
has been reported; and the small SFT config the method tests train the tiny model with;
the tiny model with a warm-start adapter and an addition task that the ESSA tests start
from."""

from edgetune.engine.core import settings
from edgetune.engine.core.events import EventWriter, read_events
from edgetune.engine.core.runfolder import RunDir

from edgetune.engine.training.loop import RunContext


def run_inline(train, cfg, path, stop_after=0, resume=False, schedule_steps=None, stop_when=None):
    """(RunDir, metrics, events). `resume=True` continues from the last checkpoint;
    `schedule_steps`: the learning-rate schedule's length (RunContext); `stop_when(type,
    fields)`: a stop request once it says True of an event just written."""
    run = RunDir(path)
    run.path.mkdir(parents=True, exist_ok=True)
    writer = EventWriter(run.events_path)
    ckpt = run.last_checkpoint()[1] if resume else None
    ctx = RunContext(cfg=cfg, run=run, emit=writer, resume=ckpt, schedule_steps=schedule_steps)

    def emit(type, **fields):
        ev = writer(type, **fields)
        if stop_after and type == "step" and fields["step"] == stop_after or stop_when and stop_when(type, fields):
            ctx.stop_flag[0] = True
        return ev

    ctx.emit = emit
    try:
        metrics = train(ctx)
    finally:
        writer.close()
    return run, metrics, read_events(run.events_path)


def sft_config(model_dir, runs_dir, **over):
    """SFT on the tiny model: 6 steps of 4 x grad_accum 2 on the embedded arithmetic rows,
    NF4, a checkpoint every 3 steps. `over` updates sections: `run={"checkpoint_every": 2}`."""
    base = {
        "method": "sft",
        "model": {"name": str(model_dir), "quant": "nf4", "gradient_checkpointing": False},
        "lora": {"r": 8, "alpha": 16},
        "data": {"path": "embedded:arith-sft", "max_rows": 64, "max_seq_len": 128},
        "run": {"runs_dir": str(runs_dir), "seed": 3, "checkpoint_every": 3},
        "sft": {"lr": 1e-3, "steps": 6, "batch_size": 4, "grad_accum": 2, "warmup_steps": 1, "eval_every": 0},
    }
    for k, v in over.items():
        base[k].update(v)
    return settings.from_dict(base)


def essa_start(root, tiny_model_dir):
    """Fill `root` with: model -> the tiny Llama, warm -> an adapter whose LoRA B factors are
    non-zero (so its singular values are too), rl.jsonl (20 addition questions)."""
    import json

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    (root / "model").symlink_to(tiny_model_dir)
    torch.manual_seed(0)
    peft_model = get_peft_model(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]))
    with torch.no_grad():
        for n, p in peft_model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.3)
    peft_model.save_pretrained(root / "warm")
    rl = [{"prompt": f"What is {a} plus {b}?", "answer": str(a + b)} for a in range(5) for b in range(4)]
    (root / "rl.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rl))
    return root
