"""Pieces the methods share: the run context and checkpoints, losses, rewards, pass@k, K LoRA
candidates in one forward."""
