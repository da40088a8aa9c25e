"""ESSA: CMA-ES over the singular values of a warm-start LoRA. `essa.py`: the loop, then the
CMA-ES it drives; `population.py`: scoring a generation's candidates; `fitness.py`: the
gold-answer fitness; `space.py`: the search space; `state.py`: the search as a replayable
log; `warm_start.py`: the adapter the search starts from."""
