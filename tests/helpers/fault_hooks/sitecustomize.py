"""Fault injection for tests/test_faults.py, loaded into a worker process through
PYTHONPATH (Python imports `sitecustomize` at start-up), so the engine carries no test
hooks. EDGETUNE_FAULT=<where>:<n> pauses the n-th call of <where> after writing the file
EDGETUNE_FAULT_MARKER (holding the pid), until the file EDGETUNE_FAULT_UNTIL exists (or
for ever, for a test that kills the process there); with EDGETUNE_FAULT_HOLD, a Ctrl-C
there writes that file and the pause goes on (as a long cleanup would):

- `save`: the checkpoint's training-state write; the adapter weights are already in the
  checkpoint's temporary folder, so a kill leaves half a checkpoint
- `step`: gradient clipping, between the backward and the optimizer step
- `copy`: a file copy (shutil.copyfileobj), as an export copies the adapter's files
"""

import os

_spec = os.environ.get("EDGETUNE_FAULT")
if _spec:
    import time

    _where, _n = _spec.split(":")
    _calls = [0]

    def _pause():
        _calls[0] += 1
        if _calls[0] != int(_n):
            return
        with open(os.environ["EDGETUNE_FAULT_MARKER"], "w") as f:
            f.write(str(os.getpid()))
        until = os.environ.get("EDGETUNE_FAULT_UNTIL")
        held = os.environ.get("EDGETUNE_FAULT_HOLD")  # a cleanup that takes long: the first Ctrl-C is held here
        while not (until and os.path.exists(until)):
            try:
                time.sleep(0.05)
            except KeyboardInterrupt:
                if not held:
                    raise
                with open(held, "w") as f:
                    f.write("interrupted")

    if _where == "copy":
        import shutil

        _copy = shutil.copyfileobj

        def _paused_copy(*args, **kwargs):
            _pause()
            return _copy(*args, **kwargs)

        shutil.copyfileobj = _paused_copy
    elif _where in ("save", "step"):
        import torch
    if _where == "save":
        _save = torch.save

        def _paused_save(*args, **kwargs):
            _pause()
            return _save(*args, **kwargs)

        torch.save = _paused_save
    elif _where == "step":
        _clip = torch.nn.utils.clip_grad_norm_

        def _paused_clip(*args, **kwargs):
            _pause()
            return _clip(*args, **kwargs)

        torch.nn.utils.clip_grad_norm_ = _paused_clip
