"""No module of unidist reads another object's private attribute (docs/architecture.md: seams between layers are typed
Protocols and public accessors).

An ast walk over every module under unidist/ finds each ``X._name`` (not a dunder) whose ``X`` is not ``self``,
``cls`` or ``super()``. It is allowed when ``X`` is reached from a module the file imports from outside unidist
(``torch._C``, ``os._exit``, ``torch.nn.modules.batchnorm._BatchNorm``: those libraries' own names), or when it is
listed in ALLOWED with its reason: another library's object held in an attribute, whose private state unidist
must read or set because the library offers no public way. Anything else fails, listed as file:line.
"""

from __future__ import annotations

import ast
from collections.abc import Iterator
from pathlib import Path

import unidist

PACKAGE = Path(unidist.__file__).parent
ROOT = PACKAGE.parent

# (file, the access as written): why it is allowed. Keep it short: each entry is another library's private state.
ALLOWED = {
    # DeepSpeed's ZeRO optimizer: loading a checkpoint into a fresh engine means making its optimizer state and
    # linking its per-parameter views (no public call does), and stage 3's partition of a parameter's state
    ("unidist/engines/deepspeed/layout.py", "self.zero._hp_optimizer_states_linked"): "DeepSpeed ZeRO internals",
    ("unidist/engines/deepspeed/layout.py", "self.zero._lazy_init_hp_params_optimizer_state"): "DeepSpeed ZeRO "
                                                                                               "internals",
    ("unidist/engines/deepspeed/layout.py", "self.zero._get_fp32_opt_state_partition"): "DeepSpeed ZeRO internals",
    ("unidist/engines/deepspeed/layout.py", "self.zero._get_param_partition_rank"): "DeepSpeed ZeRO internals",
    # Horovod's DistributedOptimizer counts backward passes per parameter in _allreduce_delay; accumulate() sets
    # those countdowns out of reach for the block (Horovod has no public switch)
    ("unidist/engines/horovod/trainer.py", "self.optimizer._allreduce_delay"): "Horovod optimizer internals",
    # torch's tensor version counter: no public getter (torch.autograd.graph.increment_version is its public
    # writer); a ZeRO-3 prefetch compares it to see a shard rewritten since the prefetch started
    ("unidist/train/zero_init.py", "t._version"): "torch's tensor version counter",
}


def _outside_names(tree: ast.Module) -> set[str]:
    """The names a module binds to imports from outside unidist (standard library and third-party)."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] != "unidist":
                    names.add(alias.asname or alias.name.split(".")[0])
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] != "unidist":
            names.update(alias.asname or alias.name for alias in node.names)
    return names


def _root(node: ast.expr) -> ast.expr:
    """The innermost object of ``a.b().c[0]``: ``a``."""
    while True:
        if isinstance(node, ast.Attribute):
            node = node.value
        elif isinstance(node, ast.Call):
            node = node.func
        elif isinstance(node, ast.Subscript):
            node = node.value
        else:
            return node


def _own(receiver: ast.expr) -> bool:
    """``self``, ``cls``, or ``super()`` / ``super(C, self)``: this object's own attributes."""
    if isinstance(receiver, ast.Name):
        return receiver.id in ("self", "cls")
    return isinstance(receiver, ast.Call) and isinstance(receiver.func, ast.Name) and receiver.func.id == "super"


def private_reads(source: str, path: str) -> Iterator[tuple[int, str]]:
    """(line, access) for each read or write of another object's private attribute in ``source`` that neither an
    outside import nor ALLOWED covers."""
    tree = ast.parse(source)
    outside = _outside_names(tree)
    attributes = sorted((n for n in ast.walk(tree) if isinstance(n, ast.Attribute)),
                        key=lambda n: (n.lineno, n.col_offset))
    for node in attributes:
        if not node.attr.startswith("_"):
            continue
        if node.attr.startswith("__") and node.attr.endswith("__"):
            continue
        if _own(node.value):
            continue
        root = _root(node.value)
        if isinstance(root, ast.Name) and root.id in outside:
            continue
        text = ast.unparse(node)
        if (path, text) in ALLOWED:
            continue
        yield node.lineno, text


def _modules() -> list[Path]:
    return sorted(p for p in PACKAGE.rglob("*.py") if "__pycache__" not in p.parts)


def _allowed_seen() -> set[tuple[str, str]]:
    seen = set()
    for p in _modules():
        rel = p.relative_to(ROOT).as_posix()
        tree = ast.parse(p.read_text())
        seen.update((rel, ast.unparse(n)) for n in ast.walk(tree)
                    if isinstance(n, ast.Attribute) and (rel, ast.unparse(n)) in ALLOWED)
    return seen


def test_no_module_reads_another_objects_private_names() -> None:
    found = []
    for p in _modules():
        rel = p.relative_to(ROOT).as_posix()
        found += [f"{rel}:{line}: {text}" for line, text in private_reads(p.read_text(), rel)]
    assert not found, ("these read another object's private attribute; give its owner a public accessor (or a "
                       "typed Protocol), or, for another library's object, add it to ALLOWED with the reason:\n"
                       + "\n".join(found))


def test_every_allowed_entry_is_still_used() -> None:
    stale = sorted(set(ALLOWED) - _allowed_seen())
    assert not stale, f"ALLOWED entries that match nothing any more (remove them): {stale}"


def test_the_walk_sees_what_it_should() -> None:
    source = """
import os
import torch.nn.functional as F
from mpi4py import MPI
from unidist.comm import regions

class C(Base):
    def f(self, other):
        self._mine, cls._too, super()._base, super(C, self)._base2
        os._exit, F._private_fn, MPI._x, torch_is_not_imported._y
        other._theirs
        self.held._private
        regions._state
        C._static
        other.__class__, other.__private_mangled
"""
    got = [text for _, text in private_reads(source, "x.py")]
    assert got == ["torch_is_not_imported._y", "other._theirs", "self.held._private", "regions._state",
                   "C._static", "other.__private_mangled"]
