"""Fault injection for tests/test_distributed.py, loaded into each rank through
PYTHONPATH (Python imports `sitecustomize` at start-up), so the engine carries no test
hooks. EDGETUNE_RANK_FAULT=<rank>:<n> makes the n-th gradient clipping of that rank
raise, as a bug on one rank alone would."""

import os

_spec = os.environ.get("EDGETUNE_RANK_FAULT")
if _spec and os.environ.get("RANK") == _spec.split(":")[0]:
    import torch

    _n, _calls = int(_spec.split(":")[1]), [0]
    _clip = torch.nn.utils.clip_grad_norm_

    def _failing_clip(*args, **kwargs):
        _calls[0] += 1
        if _calls[0] == _n:
            raise RuntimeError("injected fault")
        return _clip(*args, **kwargs)

    torch.nn.utils.clip_grad_norm_ = _failing_clip
