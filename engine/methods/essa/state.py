"""ESSA's search state without pickle: CMA-ES is rebuilt by replaying what it was asked
and told.

cma's `CMAEvolutionStrategy` only round-trips through pickle, and unpickling a file from
disk can run any code. A checkpoint instead keeps, for every generation so far, the numpy
generator state before `ask()` (cma samples from numpy's global generator) and the values
passed to `tell()`. Resuming makes a fresh strategy with the run's options and replays
ask/tell in order; since both are deterministic given those, the strategy ends in the
same state as the one that was checkpointed (each replayed population is checked against
the recorded one). Replay costs one ask/tell per generation done, no model evaluation.
"""

from __future__ import annotations

import numpy as np
import torch

from edgetune.engine.core.errors import CheckpointError


class SearchLog:
    def __init__(self):
        self.rng: list[tuple] = []  # numpy's global state before each ask
        self.xs: list[np.ndarray] = []
        self.losses: list[list[float]] = []

    def ask(self, es) -> list:
        self.rng.append(np.random.get_state())
        xs = es.ask()
        self.xs.append(np.array(xs, dtype=np.float64))
        return xs

    def tell(self, es, xs, losses) -> None:
        es.tell(xs, losses)
        self.losses.append([float(v) for v in losses])

    def state(self) -> dict:
        """Tensors and numbers only (loads with torch.load(weights_only=True))."""
        return {
            "rng_keys": torch.from_numpy(np.stack([s[1] for s in self.rng]).astype(np.int64)) if self.rng
            else torch.zeros(0, 624, dtype=torch.int64),
            "rng_rest": torch.tensor([[s[2], s[3], s[4]] for s in self.rng], dtype=torch.float64),
            "xs": torch.from_numpy(np.stack(self.xs)) if self.xs else torch.zeros(0),
            "losses": torch.tensor(self.losses, dtype=torch.float64),
        }

    @classmethod
    def replay(cls, es, state: dict, where: str):
        """Bring a fresh `es` to the recorded state; returns (es, log)."""
        log = cls()
        keys, rest = state["rng_keys"].numpy().astype(np.uint32), state["rng_rest"].tolist()
        xs_all, losses = state["xs"].numpy(), state["losses"].tolist()
        for g in range(len(losses)):
            pos, has_gauss, cached = rest[g]
            np.random.set_state(("MT19937", keys[g], int(pos), int(has_gauss), float(cached)))
            xs = log.ask(es)
            if not np.array_equal(np.array(xs), xs_all[g]):
                raise CheckpointError(f"{where}: the search state does not replay (generation {g + 1}); "
                                      "was it written by another version or with other essa settings?")
            log.tell(es, xs, losses[g])
        return es, log
