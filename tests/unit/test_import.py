"""``import unidist`` stays light: no engine, no MPI start, not even torch; layers import only those below."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import unidist


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", f"{code}\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True)
    return set(out.stdout.split())


def test_import_loads_no_backend() -> None:
    mods = _loaded_after("import unidist")
    for heavy in ("mpi4py", "horovod", "deepspeed", "torch"):
        assert not any(m == heavy or m.startswith(heavy + ".") for m in mods), heavy


def test_init_under_no_launcher_loads_no_engine() -> None:
    mods = _loaded_after("import unidist\nmgr = unidist.init()")
    assert not any(m.startswith(("mpi4py", "horovod", "deepspeed")) for m in mods)


def test_error_family() -> None:
    for cls in (unidist.BackendUnavailableError, unidist.NotInitializedError, unidist.LaunchEnvironmentError,
                unidist.ConfigError, unidist.CollectiveMismatchError, unidist.CollectiveTimeoutError,
                unidist.InvalidArgumentError):
        assert issubclass(cls, unidist.UnidistError)
    assert issubclass(unidist.BackendUnavailableError, ImportError)
    assert unidist.ReduceOp("mean") is unidist.ReduceOp.MEAN


# Each layer may import only these unidist modules (README "Layout"). The managers are handed their training
# strategy when made (a call in their backend's record, unidist/backends/), so they never import the layers
# above them; the records sit on top and point down. The training layer writes checkpoints through
# unidist.checkpoint, which knows files, manifests and agreement only (each prepared optimizer supplies its own
# layout), so it imports no training code.
BASE = ("unidist.errors", "unidist.ops", "unidist.config", "unidist.tree")
LAYERS = {
    "comm": (*BASE, "unidist.comm"),
    "managers": (*BASE, "unidist.comm", "unidist.managers", "unidist.launch", "unidist.net", "unidist.registry"),
    "train": (*BASE, "unidist.comm", "unidist.train", "unidist.checkpoint"),
    "checkpoint": ("unidist.errors", "unidist.checkpoint"),
    "parallel": (*BASE, "unidist.comm", "unidist.parallel"),
    # the engines' own APIs, written on everything below (the top-level unidist.init included)
    "compat": ("unidist", *BASE, "unidist.comm", "unidist.managers", "unidist.launch", "unidist.registry",
               "unidist.train", "unidist.checkpoint", "unidist.parallel", "unidist.compat"),
}


def _imports(path: Path) -> list[str]:
    tree = ast.parse(path.read_text())
    names = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            names.append(node.module)
        elif isinstance(node, ast.Import):
            names += [a.name for a in node.names]
    return [n for n in names if n == "unidist" or n.startswith("unidist.")]


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_layers_import_only_below(layer: str) -> None:
    root = Path(unidist.__file__).parent
    for path in sorted((root / layer).rglob("*.py")):
        rel = f"unidist/{layer}/{path.name}"
        for name in _imports(path):
            allowed = any(name == a or name.startswith(a + ".") for a in LAYERS[layer])
            assert allowed, f"{rel} imports {name}: {layer}/ may import only {LAYERS[layer]}"


def _module_graph() -> dict[str, set[str]]:
    """unidist's modules and the unidist modules each imports anywhere in its text (function bodies too, where
    unidist defers heavy imports), ``from pkg import sub`` counted as an import of the submodule."""
    root = Path(unidist.__file__).parent
    modules = {}
    for path in root.rglob("*.py"):
        parts = path.relative_to(root.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        edges = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                subs = [f"{node.module}.{a.name}" for a in node.names if f"{node.module}.{a.name}" in modules]
                edges.update(subs or ([node.module] if node.module in modules else []))
            elif isinstance(node, ast.Import):
                edges.update(a.name for a in node.names if a.name in modules)
        graph[name] = edges - {name}
    return graph


def test_no_import_cycle() -> None:
    """No module of unidist reaches itself through imports (Tarjan's strongly connected components)."""
    graph = _module_graph()
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    assert not cycles, f"import cycles: {cycles}"


def test_checkpoint_reads_no_private_names_of_other_layers() -> None:
    """checkpoint/ touches other objects only through public names: an attribute starting with ``_`` is read
    only on ``self`` (ZeRO units, trainers and managers are other layers' business)."""
    root = Path(unidist.__file__).parent / "checkpoint"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Attribute) and node.attr.startswith("_") and not node.attr.startswith("__")):
                continue
            if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                continue
            raise AssertionError(f"unidist/checkpoint/{path.name}:{node.lineno} reads {node.attr}: checkpoint/ uses "
                                 "public names only")

