"""Our `kernels/` folder must never shadow, or be shadowed by, the PyPI package
`kernels` that transformers and bitsandbytes import when it is installed."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

PROBE = r"""
import importlib.util, json, sys
spec = importlib.util.find_spec("kernels")
from transformers.utils.import_utils import is_kernels_available
import transformers.integrations.hub_kernels  # the integration that imports `kernels`
import edgetune.kernels.sebp as ours
print(json.dumps({
    "spec_origin": getattr(spec, "origin", None),
    "spec_is_namespace": spec is not None and spec.origin is None,
    "transformers_sees_kernels": is_kernels_available(),
    "ours": ours.__name__,
    "ours_file": ours.__file__,
}))
"""


def _probe(cwd):
    p = subprocess.run([sys.executable, "-c", PROBE], cwd=cwd, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    return json.loads(p.stdout.strip().splitlines()[-1])


def test_kernels_folder_is_not_a_top_level_package():
    assert not (ROOT / "kernels" / "__init__.py").exists()


def test_transformers_integrations_import_with_ours_installed(tmp_path):
    # From elsewhere: `kernels` resolves to nothing of ours.
    out = _probe(tmp_path)
    assert out["spec_origin"] is None or "edgetune" not in out["spec_origin"]
    assert out["transformers_sees_kernels"] is False
    assert out["ours"] == "edgetune.kernels.sebp"
    # From the repo root (where `python -c` puts our folder on sys.path): at most a
    # namespace portion, which transformers reads as "not installed" and which a real
    # `kernels` package would win over.
    out = _probe(ROOT)
    assert out["spec_origin"] is None
    assert out["transformers_sees_kernels"] is False


def test_a_real_kernels_package_wins_over_our_folder(tmp_path):
    fake = tmp_path / "site" / "kernels"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("REAL = True\n")
    code = "import kernels; print(getattr(kernels, 'REAL', False), kernels.__file__)"
    env_path = f"{ROOT}:{tmp_path / 'site'}"  # our root first on the path, on purpose
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                       env={"PYTHONPATH": env_path, "PATH": "/usr/bin:/bin"}, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout.startswith("True"), p.stdout
