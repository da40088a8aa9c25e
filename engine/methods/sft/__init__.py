"""SFT: supervised fine-tuning on demonstrations. `sft.py`: the loop, then the step's
backward over its micro-batches and the held-out loss."""
