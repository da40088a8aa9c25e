"""Pieces two or more methods share: the run context and checkpoints, the language-model
losses, rewards, the statistics of an evaluation (intervals, paired tests). What one method
alone uses lives in its folder under engine/methods/."""
