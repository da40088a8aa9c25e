"""Pieces the methods share: the run context and checkpoints, losses, rewards, pass@k, the
statistics of an evaluation (intervals, paired tests), K LoRA candidates in one forward."""
