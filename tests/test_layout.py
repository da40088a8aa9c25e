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
    # Newer transformers releases depend on the PyPI package `kernels`, older ones do not:
    # either way `kernels` must be that package or nothing, never our folder, and
    # transformers must see it exactly when it is really installed.
    out = _probe(tmp_path)
    origin = out["spec_origin"]
    assert origin is None or not origin.startswith(str(ROOT / "kernels"))
    real = origin is not None  # the PyPI package (our folder has no __init__.py)
    assert out["transformers_sees_kernels"] is real
    assert out["ours"] == "edgetune.kernels.sebp"
    # From the repo root (where `python -c` puts our folder on sys.path): our folder is at
    # most a namespace portion, which a real `kernels` package wins over and which
    # transformers reads as "not installed".
    out = _probe(ROOT)
    assert out["spec_origin"] == origin
    assert out["transformers_sees_kernels"] is real


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


# --------------------------------------------------------------------------- import graph

PACKAGES = {"engine": "edgetune.engine", "kernels": "edgetune.kernels", "app": "edgetune.app"}


def _modules() -> dict:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).glob("*.py")):
            out[pkg if f.stem == "__init__" else f"{pkg}.{f.stem}"] = (f, pkg)
    return out


def _imports(path: Path, pkg: str, known) -> list[tuple[str, str]]:
    """(imported module, enclosing function or "") for every import in the file, lazy ones
    (inside functions) included: a cycle through a lazy import is still a cycle."""
    import ast

    found = []

    def visit(node, where):
        for ch in ast.iter_child_nodes(node):
            inner = ch.name if isinstance(ch, (ast.FunctionDef, ast.AsyncFunctionDef)) else where
            names = []
            if isinstance(ch, ast.Import):
                names = [a.name for a in ch.names]
            elif isinstance(ch, ast.ImportFrom):
                base = pkg.split(".")[: len(pkg.split(".")) - ch.level + 1] if ch.level else []
                mod = ".".join(base + ([ch.module] if ch.module else []))
                names = [mod] + [f"{mod}.{a.name}" for a in ch.names]
            found.extend((n, where) for n in names if n in known)
            visit(ch, inner)

    visit(ast.parse(path.read_text()), "")
    return found


def _graph():
    mods = _modules()
    return {name: _imports(f, pkg, mods) for name, (f, pkg) in mods.items()}


def _cycles(edges: dict) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def strong(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in edges[v]:
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in edges:
        if v not in index:
            strong(v)
    return out


def test_cycle_finder_finds_a_cycle():
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _cycles({"a": {"b"}, "b": set()}) == []


def test_import_graph_has_no_cycle_and_no_upward_import():
    graph = _graph()
    assert len(graph) > 40 and "edgetune.engine.models.model" in graph
    assert ("edgetune.engine.core.settings", "") in graph["edgetune.engine.models.model"]  # the walk sees imports
    edges = {m: {n for n, _ in imps if n != m and n in graph} for m, imps in graph.items()}
    assert _cycles(edges) == []
    for mod, imps in graph.items():
        if mod.startswith("edgetune.kernels"):
            assert not [n for n, _ in imps if not n.startswith("edgetune.kernels")], mod
        if mod.startswith("edgetune.engine"):
            up = [(n, where) for n, where in imps if n.startswith("edgetune.app")]
            # the one way down from the engine to the app: the `edgetune ui` command starts it
            allowed = [("edgetune.app.main", "cmd_ui")] if mod == "edgetune.engine.cli" else []
            assert up == allowed, (mod, up)


def test_engine_modules_use_each_others_public_names_only():
    """`from .model import _x` or `data._x(...)` from another module: a seam that breaks
    when the owner renames its private helper. Each module offers what others need."""
    import ast

    found = []
    for f in sorted((ROOT / "engine").glob("*.py")):
        tree = ast.parse(f.read_text())
        modules = set()  # names bound to engine modules: `from . import data as d`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level >= 1 or (node.module or "").startswith("edgetune.")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{f.name}: from {node.module} import {a.name}")
                    if node.module in (None, "edgetune.engine", "kernels", "edgetune.kernels"):
                        modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{f.name}: {node.value.id}.{node.attr}")
    assert found == []
