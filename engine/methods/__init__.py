"""One training loop per method: sft, fgrpo, essa (with ESSA's search space, state and
fitness)."""
