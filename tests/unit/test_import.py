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


def test_a_started_manager_loads_the_training_layer_only_when_it_trains() -> None:
    """init() costs what the engine's start costs (``python -m unidist.bench.startup`` measures it on every
    backend): the training layer, torch's compiler and what they bring load at the first call that needs them, and
    the compiler not even then unless something compiles (or torch loads it: a torch optimizer's constructor does)."""
    from unidist.bench.startup import HEAVY

    code = ("import sys, torch, unidist\nmgr = unidist.init()\nmgr.start()\n"
            "print('started', *sorted(sys.modules))\n"
            "list(mgr.shard(10))\nprint('sharded', *sorted(sys.modules))\nmgr.shutdown()")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    started, sharded = ({*line.split()[1:]} for line in out.splitlines() if line.startswith(("started", "sharded")))
    assert not [m for m in started if m.startswith(HEAVY)], sorted(m for m in started if m.startswith(HEAVY))
    assert "unidist.train.trainer" in sharded  # loaded by the first training call
    assert not [m for m in sharded if m.startswith(("torch._dynamo", "sympy", "transformers"))]


def test_error_family() -> None:
    for cls in (unidist.BackendUnavailableError, unidist.NotInitializedError, unidist.LaunchEnvironmentError,
                unidist.ConfigError, unidist.CollectiveMismatchError, unidist.CollectiveTimeoutError,
                unidist.InvalidArgumentError):
        assert issubclass(cls, unidist.UnidistError)
    assert issubclass(unidist.BackendUnavailableError, ImportError)
    assert unidist.ReduceOp("mean") is unidist.ReduceOp.MEAN


# Each layer may import only these unidist modules (docs/architecture.md). The base is the modules every layer may
# use: typed errors, the one parser of UNIDIST_* variables, launcher detection, the registration records. The
# shared Manager (managers/) is handed its engine and training strategy by the engine's package, so it never imports
# the layers above it; each engine's package (engines/<name>/) sits on everything it is written on. The training
# layer writes checkpoints through unidist.checkpoint, which knows files, manifests and agreement only (each prepared
# optimizer supplies its own layout), so it imports no training code. Every module of the package is in one layer.
BASE = ("unidist.errors", "unidist.tree", "unidist.net", "unidist.ops", "unidist.config", "unidist.hosts",
        "unidist.launch", "unidist.strategy", "unidist.request", "unidist.prepared", "unidist.registry",
        "unidist.precisions")
_BELOW_ENGINES = (*BASE, "unidist.comm", "unidist.checkpoint", "unidist.train", "unidist.parallel", "unidist.managers")
LAYERS = {
    "base": BASE,
    "comm": (*BASE, "unidist.comm"),
    "checkpoint": ("unidist.errors", "unidist.checkpoint"),
    "train": (*BASE, "unidist.comm", "unidist.train", "unidist.checkpoint"),
    "parallel": (*BASE, "unidist.comm", "unidist.parallel"),
    "managers": (*BASE, "unidist.comm", "unidist.managers"),
    "engines": (*_BELOW_ENGINES, "unidist.engines"),
    "top": ("unidist", *_BELOW_ENGINES, "unidist.engines", "unidist.selector"),
    # the engines' own APIs, written on everything below (the top-level unidist.init included)
    "compat": ("unidist", *_BELOW_ENGINES, "unidist.compat"),
    # the tools read the records (unidist.registry), never an engine's package
    "tools": ("unidist", *_BELOW_ENGINES, "unidist.selector", "unidist.bench", "unidist.doctor", "unidist.verify",
              "unidist.cli"),
}
# the places a module reaches past its layer, each with its reason (kept short on purpose)
EXCEPTIONS = {
    # the doctor asks the MPI library the question the MPI engine asks (MPIX_Query_cuda_support), one ctypes call
    ("unidist/doctor/probe.py", "unidist.engines.mpi.manager"),
}
# which layer each module is in: a folder, or a top-level module by name
HOME = {**{m.removeprefix("unidist."): "base" for m in BASE}, "__init__": "top", "selector": "top", "cli": "tools",
        "bench": "tools", "doctor": "tools", "verify": "tools",
        **{layer: layer for layer in LAYERS if layer not in ("base", "top", "tools")}}


def _layer_of(path: Path) -> str:
    rel = path.relative_to(Path(unidist.__file__).parent)
    key = rel.parts[0] if len(rel.parts) > 1 else rel.stem
    assert key in HOME, f"unidist/{rel} is in no layer: name its folder or module in test_import.HOME"
    return HOME[key]


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
    for path in sorted(root.rglob("*.py")):
        if _layer_of(path) != layer:
            continue
        for name in _imports(path):
            if (str(path.relative_to(root.parent)), name) in EXCEPTIONS:
                continue
            # "unidist" alone is the top-level package (unidist.init), not everything under it
            allowed = any(name == a or (a != "unidist" and name.startswith(a + ".")) for a in LAYERS[layer])
            assert allowed, f"{path.relative_to(root.parent)} imports {name}: {layer} may import only {LAYERS[layer]}"


def test_engine_packages_do_not_import_each_other_except_named() -> None:
    """What one engine alone knows stays in its package: an engine's package imports another's only where it is
    built on it (DeepSpeed's Manager is torch.distributed's; Horovod on MPICH sweeps MPICH's shared memory)."""
    allowed = {("deepspeed", "torch"), ("horovod", "mpi")}
    root = Path(unidist.__file__).parent / "engines"
    for pkg in sorted(p for p in root.iterdir() if p.is_dir() and not p.name.startswith("_")):
        for path in sorted(pkg.rglob("*.py")):
            for name in _imports(path):
                parts = name.split(".")
                if len(parts) > 2 and parts[1] == "engines" and parts[2] not in (pkg.name, "training"):
                    assert (pkg.name, parts[2]) in allowed, f"{path.relative_to(root.parent.parent)} imports {name}"


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

