"""engine/models/model.import_bitsandbytes: bitsandbytes without its import-time compiler cost."""

import os
import subprocess
import sys

import pytest

from edgetune.engine.models import model as model_lib


def test_deferred_compile_compiles_on_first_call_only():
    calls = []

    def fake_compile(fn, **kwargs):
        calls.append(kwargs)
        return lambda *a: fn(*a) * 10  # marks results that went through the "compiled" function

    compile_later = model_lib.deferred_compile(fake_compile)

    @compile_later(dynamic=False)
    def double(x):
        return 2 * x

    square = compile_later(lambda x: x * x)
    assert calls == [] and double.__name__ == "double"
    assert double(3) == 60 and double(4) == 80 and square(3) == 90
    assert calls == [{"dynamic": False}, {}]  # one compile per function, at its first call


def test_deferred_compile_falls_back_when_compiling_fails():
    def broken(fn, **kwargs):
        raise RuntimeError("no compiler")

    f = model_lib.deferred_compile(broken)(lambda x: x + 1)
    assert f(1) == 2 and f(2) == 3


@pytest.mark.slow  # a fresh interpreter importing torch and bitsandbytes
def test_bitsandbytes_import_leaves_the_compiler_unimported():
    pytest.importorskip("bitsandbytes")
    code = (
        "import sys, torch\n"
        "real = torch.compile\n"
        "from edgetune.engine.models import model\n"
        "bnb = model.import_bitsandbytes()\n"
        "print(bnb.__name__, torch.compile is real, 'torch._inductor.compile_fx' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert out.stdout.split() == ["bitsandbytes", "True", "False"]
