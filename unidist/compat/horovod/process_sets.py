"""Horovod's process sets on unidist Groups: ``hvd.ProcessSet``, ``add_process_set``, ``remove_process_set``.

A registered set holds the communicator its collectives run on: the Manager for ``global_process_set``
(id 0), a ``Manager.new_group(sorted ranks)`` Group for the others (every rank creates it, members keep the
Group). As in Horovod: ranks are kept sorted; equality is identity; ``size()``/``rank()`` are None until
registered; registering the same ranks twice (or every rank again) is a ValueError; adding or removing a set
after ``init()`` needs ``HOROVOD_DYNAMIC_PROCESS_SETS=1`` or ``init(process_sets="dynamic")``; collective
roots stay world ranks. Registration is collective: every rank makes the same calls in the same order.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from unidist.compat.horovod.state import manager, state
from unidist.errors import InvalidArgumentError

__all__ = ["NotInProcessSetError", "ProcessSet", "add_process_set", "comm_of", "global_process_set",
           "remove_process_set"]

DYNAMIC = "HOROVOD_DYNAMIC_PROCESS_SETS"  # Horovod's switch for adding/removing sets after init


class NotInProcessSetError(InvalidArgumentError):
    """This rank called a collective (or ``rank()``) on a process set it is not a member of: Horovod's
    ValueError."""


class ProcessSet:
    """A set of world ranks that run collectives together; pass it to ``hvd.init`` or ``add_process_set``."""

    process_set_id: int | None = None
    ranks: list[int] | None = None
    mpi_comm: Any = None

    def __init__(self, ranks_or_comm: Sequence[int]) -> None:
        if isinstance(ranks_or_comm, (str, bytes)) or not hasattr(ranks_or_comm, "__iter__"):
            raise InvalidArgumentError(
                "ProcessSet takes a list of world ranks; an mpi4py communicator cannot define a process set "
                "under unidist (pass the ranks of that communicator instead)")
        ranks = sorted(ranks_or_comm)
        if any(isinstance(r, bool) or not isinstance(r, int) for r in ranks):
            raise InvalidArgumentError(
                "ProcessSet should be initialized with a list of process ranks or an mpi4py Comm object")
        self.ranks = ranks

    def size(self) -> int | None:
        """Number of ranks, or None when not registered."""
        if self.process_set_id is None:
            return None
        manager()
        return len(self.ranks or ())

    def rank(self) -> int | None:
        """This process's rank within the set (None when not registered; a ValueError for a non-member).
        Collectives still take world ranks as roots, as in Horovod."""
        if self.process_set_id is None:
            return None
        me = manager().rank
        if self.ranks is None or me not in self.ranks:
            raise NotInProcessSetError("Process is not part of provided process set.")
        return self.ranks.index(me)

    def included(self) -> bool | None:
        """Whether this process is a member (None when the set has no ranks)."""
        if self.ranks is None:
            return None
        return manager().rank in self.ranks

    def __str__(self) -> str:
        return f"ProcessSet(process_set_id={self.process_set_id}, ranks={self.ranks}, mpi_comm={self.mpi_comm})"


global_process_set = ProcessSet([])
global_process_set.process_set_id = 0

_registered: dict[int, ProcessSet] = {}  # id -> set, the global one included
# a registered set -> the communicator its collectives run on here (the Manager or a Group; None off the set):
# kept beside the set, not on it, so a ProcessSet has Horovod's attributes and no more
_comms: dict[ProcessSet, Any] = {}
_next_id = 1


def _invalidate(ps: ProcessSet) -> None:
    ps.process_set_id = None
    _comms.pop(ps, None)


def comm_of(process_set: ProcessSet, call: str = "Allreduce") -> Any:
    """The communicator ``process_set``'s collectives run on: the Manager or a Group.

    Raises Horovod's ValueErrors: not initialized, an unregistered set, or this rank not a member.
    """
    comm = _comms.get(process_set)
    if comm is not None and process_set.process_set_id is not None and state.mgr is not None and state.mgr.started:
        return comm  # (a `with unidist.init()` block's Manager may have ended without hvd.shutdown())
    mgr = manager()
    if process_set.process_set_id is None or process_set.process_set_id not in _registered:
        raise InvalidArgumentError("Process set does not exist or has not been registered.")
    raise NotInProcessSetError(f"{call}: Rank {mgr.rank} is not a member of the provided process set.")


def reset() -> None:
    """Forget every registered set (shutdown): their Groups die with the Manager."""
    global _next_id
    for ps in list(_registered.values()):
        if ps is not global_process_set:
            _invalidate(ps)
    _registered.clear()
    _comms.clear()
    _next_id = 1


def prepare_init_sets(process_sets: Any) -> list[ProcessSet]:
    """``init``'s ``process_sets`` argument as a list, before the Manager starts (bad input raises early)."""
    if process_sets is None:
        return []
    if isinstance(process_sets, str):
        if process_sets.lower() != "dynamic":
            raise InvalidArgumentError(f'hvd.init(process_sets={process_sets!r}): use a list of ProcessSet, None '
                                       'or "dynamic"')
        os.environ[DYNAMIC] = "1"
        return []
    listed = list(process_sets)
    if any(not isinstance(ps, ProcessSet) for ps in listed):
        raise InvalidArgumentError("hvd.init(process_sets=...) takes a list of hvd.ProcessSet objects")
    return listed


def register_init_sets(mgr: Any, listed: list[ProcessSet]) -> None:
    """Register the global set and ``init``'s list, in order; a duplicate raises after the others registered
    (Horovod stays initialized then, as here)."""
    global_process_set.ranks = list(range(mgr.size))
    _comms[global_process_set] = mgr
    _registered[0] = global_process_set
    duplicate: int | None = None
    for i, ps in enumerate(listed):
        if _find(ps.ranks) is not None:
            _invalidate(ps)
            duplicate = i if duplicate is None else duplicate
            continue
        _register(mgr, ps)
    if duplicate is not None:
        raise InvalidArgumentError(f"Horovod could not be initialized because process_sets entry number "
                                   f"{duplicate} is a duplicate: {listed[duplicate]}")


def _find(ranks: list[int] | None) -> ProcessSet | None:
    for ps in _registered.values():
        if ps.ranks == ranks:
            return ps
    return None


def _register(mgr: Any, ps: ProcessSet) -> None:
    global _next_id
    ranks = ps.ranks or []
    bad = [r for r in ranks if not 0 <= r < mgr.size]
    if bad or not ranks or len(set(ranks)) != len(ranks):
        raise InvalidArgumentError(f"process set ranks {ranks} must be distinct world ranks in 0..{mgr.size - 1} "
                                   "(at least one)")
    _comms[ps] = mgr.new_group(ranks)  # collective: every rank calls it; None off the set
    ps.process_set_id = _next_id
    _registered[_next_id] = ps
    _next_id += 1


def _need_dynamic(verb: str) -> None:
    if os.environ.get(DYNAMIC, "") != "1":
        raise InvalidArgumentError(f"Set {DYNAMIC}=1 to allow {verb} process sets after Horovod initialization.")


def add_process_set(process_set: ProcessSet | Sequence[int]) -> ProcessSet:
    """Register a set after ``init()`` (every rank calls it with the same ranks) and return it."""
    mgr = manager()
    _need_dynamic("adding")
    ps = process_set if isinstance(process_set, ProcessSet) else ProcessSet(process_set)
    if _find(ps.ranks) is not None:
        raise InvalidArgumentError(f"Attempted to add a duplicate process set: {ps}")
    _register(mgr, ps)
    return ps


def remove_process_set(process_set: ProcessSet) -> bool:
    """Unregister a set; False for the global set or one not registered (as in Horovod)."""
    if not is_registered(process_set) or process_set.process_set_id == 0:
        return False
    manager()
    _need_dynamic("removing")
    _registered.pop(process_set.process_set_id or 0, None)
    _invalidate(process_set)
    return True


def is_registered(process_set: ProcessSet) -> bool:
    return process_set.process_set_id is not None and _registered.get(process_set.process_set_id) is process_set

