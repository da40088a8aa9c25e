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

# engine/'s folders from the bottom up (each one's role is its __init__'s docstring): a module
# imports from its own layer or lower ones, never from a higher one. cli/ stays on top.
LAYERS = ("core", "planning", "data", "models", "generation", "training", "methods", "run", "cli")
# What a module of app/ must never import when it is imported (the page starts without them).
HEAVY = {"torch", "transformers", "peft", "bitsandbytes", "accelerate", "triton", "liger_kernel", "datasets"}


def _modules() -> dict:
    out = {}
    for folder, pkg in PACKAGES.items():
        for f in sorted((ROOT / folder).rglob("*.py")):
            rel = f.relative_to(ROOT / folder).with_suffix("").parts
            if "assets" in rel:  # data files and the script that makes them
                continue
            package = ".".join([pkg, *rel[:-1]])
            out[package if rel[-1] == "__init__" else f"{package}.{rel[-1]}"] = (f, package)
    return out


def _layer(mod: str) -> int:
    part = mod.split(".")[2]
    assert part in LAYERS, f"{mod}: in no layer of LAYERS (engine/'s folders); place it in one"
    return LAYERS.index(part)


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
                subs = [f"{mod}.{a.name}" for a in ch.names if f"{mod}.{a.name}" in known]
                # `from package import module` uses the module, not the package's own code
                names = subs if subs and len(subs) == len(ch.names) else [mod] + subs
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
            allowed = [("edgetune.app.main", "cmd_ui")] if mod == "edgetune.engine.cli.ui" else []
            assert up == allowed, (mod, up)


def test_engine_layers_import_downward_only():
    """The folders of engine/ are layers: core, planning, data, models, generation,
    training, methods, run, then the CLI. A lower one never imports a higher one (lazy
    imports inside functions included), so each folder can be read knowing only those
    below it."""
    graph = _graph()
    engine = {m: imps for m, imps in graph.items() if m.startswith("edgetune.engine.")}
    assert {m.split(".")[2] for m in engine} == set(LAYERS)
    up = [(m, n, where or "top") for m, imps in engine.items() for n, where in imps
          if n.startswith("edgetune.engine.") and _layer(n) > _layer(m)]
    assert up == []
    for folder in LAYERS[:-1]:  # the listing reads as the architecture: each folder says its role
        init = ROOT / "engine" / folder / "__init__.py"
        assert init.exists() and (init.read_text().lstrip().startswith('"""')), folder


def test_app_imports_nothing_torch_heavy():
    """What app/ imports at import time, followed through our own modules, never reaches
    torch, transformers and the like: the page starts in a second and works the engine
    through engine/run/api.py's light calls and subprocesses."""
    import ast

    mods = _modules()
    graph = _graph()

    def heavy(path: Path) -> list[str]:
        found = []
        for node in ast.parse(path.read_text()).body:  # module level only (lazy imports are fine)
            stmts = [node] + [n for n in ast.walk(node) if isinstance(node, (ast.If, ast.Try))]
            for n in stmts:
                if isinstance(n, ast.Import):
                    found += [a.name for a in n.names if a.name.split(".")[0] in HEAVY]
                elif isinstance(n, ast.ImportFrom) and not n.level and n.module.split(".")[0] in HEAVY:
                    found.append(n.module)
        return found

    assert heavy(mods["edgetune.engine.methods.sft.sft"][0]) == ["torch"]  # the check sees them
    for start in [m for m in mods if m.startswith("edgetune.app")]:
        seen, todo = set(), [start]
        while todo:
            m = todo.pop()
            if m in seen:
                continue
            seen.add(m)
            assert heavy(mods[m][0]) == [], (start, m)
            todo += [n for n, where in graph[m] if where == ""]


def test_engine_modules_use_each_others_public_names_only():
    """`from .model import _x` or `data._x(...)` from another module: a seam that breaks
    when the owner renames its private helper. Each module offers what others need."""
    import ast

    found = []
    known = _modules()
    for f in sorted((ROOT / "engine").rglob("*.py")):
        tree = ast.parse(f.read_text())
        modules = set()  # names bound to engine modules: `from edgetune.engine.data import sft as d`
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level >= 1 or (node.module or "").startswith("edgetune.")):
                for a in node.names:
                    if a.name.startswith("_") and not a.name.startswith("__"):
                        found.append(f"{f.name}: from {node.module} import {a.name}")
                    if node.module in (None, "kernels") or f"{node.module}.{a.name}" in known:
                        modules.add(a.asname or a.name)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                    and node.attr.startswith("_") and not node.attr.startswith("__")):
                found.append(f"{f.name}: {node.value.id}.{node.attr}")
    assert found == []


def _method_name_comparisons(path: Path, names: set, root: Path = ROOT) -> list[str]:
    """`x == "sft"`, `method in ("fgrpo", "essa")` and the like: a comparison with a
    method's name as a string constant (one, or inside a tuple, list or set)."""
    import ast

    def named(node) -> set:
        if isinstance(node, ast.Constant) and node.value in names:
            return {node.value}
        if isinstance(node, (ast.Tuple, ast.List, ast.Set)):
            return set().union(*(named(e) for e in node.elts)) if node.elts else set()
        return set()

    out = []
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Compare):
            for side in [node.left, *node.comparators]:
                for n in named(side):
                    out.append(f"{path.relative_to(root)}:{node.lineno} compares with '{n}'")
    return out


def _own_method(path: Path, names: set) -> set:
    """The method whose folder (engine/methods/<name>/) holds `path`: {name}, or none."""
    parts = path.relative_to(ROOT).parts
    return {parts[2]} & names if parts[:2] == ("engine", "methods") and len(parts) > 3 else set()


def test_a_method_is_named_only_in_its_record_and_its_own_folder():
    """What a method can do is a field of its record (engine/core/methods.py); code outside
    the record and the method's own folder reads the field and never compares the method's
    name, so a new method is a record, a folder and presets, not a search for every if."""
    from edgetune.engine.core.methods import METHODS

    names = set(METHODS)
    assert _own_method(ROOT / "engine" / "methods" / "essa" / "fitness.py", names) == {"essa"}
    assert _own_method(ROOT / "engine" / "methods" / "essa.py", names) == set()
    found = []
    for folder in ("engine", "app"):
        for f in sorted((ROOT / folder).rglob("*.py")):
            if f == ROOT / "engine" / "core" / "methods.py":
                continue
            found += _method_name_comparisons(f, names - _own_method(f, names))
    assert found == []


# A method's loop reads top to bottom on a screen or two; what grows inside it (a step, an
# evaluation, a warm start) becomes a function of the method's folder that the loop calls.
LOOP_LINES = 130


def test_each_method_is_a_folder_with_its_loop_at_the_top():
    """engine/methods/ holds one folder per record and nothing else: <name>/<name>.py opens
    with `train(ctx)`, the loop, short enough to read whole; the rest of the method (its
    losses, evaluation, search) sits beside it in the folder."""
    import ast

    from edgetune.engine.core.methods import METHODS

    methods = ROOT / "engine" / "methods"
    assert sorted(p.name for p in methods.iterdir() if p.name != "__pycache__") == sorted([*METHODS, "__init__.py"])
    for name in METHODS:
        main = methods / name / f"{name}.py"
        assert (methods / name / "__init__.py").read_text().lstrip().startswith('"""'), name  # says what is where
        defs = [n for n in ast.parse(main.read_text()).body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        assert defs[0].name == "train", (name, defs[0].name)
        assert defs[0].end_lineno - defs[0].lineno + 1 <= LOOP_LINES, (name, defs[0].end_lineno - defs[0].lineno + 1)


def test_the_method_name_check_finds_a_comparison(tmp_path):
    f = tmp_path / "x.py"
    f.write_text('if cfg.method == "sft" or m in ("essa", "other"):\n    pass\nok = {"fgrpo": 1}\n')
    assert sorted(_method_name_comparisons(f, {"sft", "fgrpo", "essa"}, tmp_path)) == [
        "x.py:1 compares with 'essa'", "x.py:1 compares with 'sft'"]


def test_sizes_and_durations_read_the_same_everywhere():
    from edgetune.engine.core.units import duration, size

    assert [size(x) for x in (0, 963 * 2**20, 2**30, 1.5 * 2**30, "n/a")] == [
        "0 MiB", "963 MiB", "1.00 GiB", "1.50 GiB", "n/a"]
    assert [duration(x) for x in (None, 0, 59.4, 61, 3600 + 7 * 60 + 30)] == ["–", "0s", "59s", "1m 01s", "1h 07m"]
