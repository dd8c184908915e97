"""``hvd.elastic.State`` and ``ObjectState``: Horovod's state objects, whose commits also reach the disk.

As in Horovod, ``commit()`` is ``save()`` (an in-memory copy that ``restore()`` returns to) followed by
``check_host_updates()`` (one broadcast from rank 0, so every rank agrees on whether hosts changed). Inside
``hvd.elastic.run`` every commit is also written to the job's commit directory (store.py), so a restart resumes
from the last ``commit()`` as Horovod's does; ``UNIDIST_ELASTIC_COMMIT_SECONDS=N`` writes at most one every N
seconds instead, when rank 0 says one is due (its answer rides on the same broadcast, so a commit costs no extra
collective unless it writes). That written commit is what a job restarted by its launcher resumes from (run.py):
unidist's engines cannot re-form the world in place.
"""

from __future__ import annotations

import enum
import queue
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist.compat.horovod.elastic.store import CommitStore
from unidist.compat.horovod.exceptions import HostsUpdatedInterrupt

__all__ = ["HostUpdateResult", "ObjectState", "State"]


class HostUpdateResult(enum.IntFlag):
    """What a host update did (Horovod's flags): ``removed`` alone lets ``hvd.elastic.run`` skip the sync."""

    no_update = 0
    removed = 1
    added = 2
    mixed = 3


def _broadcast_object(obj: Any) -> Any:
    return unidist.get_manager().broadcast_object(obj, 0)


def _rank() -> int:
    rank: int = unidist.get_manager().rank
    return rank


class State:
    """What ``hvd.elastic.run`` keeps in step across workers and restarts; subclasses say what to save.

    Args:
        bcast_object: broadcasts a picklable object from rank 0 (default: the running Manager's).
        get_rank: this worker's rank (default: the running Manager's).
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None,
                 get_rank: Callable[[], int] | None = None) -> None:
        self._bcast_object = bcast_object if bcast_object is not None else _broadcast_object
        self._rank = get_rank if get_rank is not None else _rank
        self._host_messages: queue.Queue[tuple[float, HostUpdateResult]] = queue.Queue()
        self._last_updated_timestamp: float = 0
        self._update_seen: tuple[float, HostUpdateResult] = (0, HostUpdateResult.no_update)
        self._reset_callbacks: list[Callable[[], Any]] = []
        self._store: CommitStore | None = None  # set by hvd.elastic.run while it runs

    def register_reset_callbacks(self, callbacks: Iterable[Callable[[], Any]]) -> None:
        """Functions to call after a reset (here: a restart that resumed from a commit, or a host update),
        before training goes on, e.g. to rescale the learning rate by the new ``hvd.size()``."""
        self._reset_callbacks.extend(callbacks)

    def on_reset(self) -> None:
        """Run ``reset()`` and the registered callbacks (``hvd.elastic.run`` calls it)."""
        self._host_messages = queue.Queue()
        self.reset()
        for callback in self._reset_callbacks:
            callback()

    def on_hosts_updated(self, timestamp: float, update_res: HostUpdateResult | int) -> None:
        """Queue a host update (Horovod's driver calls this; nothing does on unidist's launchers)."""
        self._host_messages.put((timestamp, HostUpdateResult(int(update_res))))

    def commit(self) -> None:
        """Save the state in memory (what ``restore()`` returns to) and, inside ``hvd.elastic.run`` when due,
        to the job's commit directory; then raise ``HostsUpdatedInterrupt`` if hosts changed.

        A commit copies the state and writes it (a unidist checkpoint, file syncs included), so commit every few
        batches rather than every one, as Horovod's examples do; rank 0 says so when writes take over a quarter of
        the job's time. ``UNIDIST_ELASTIC_COMMIT_SECONDS`` bounds how often a commit reaches disk.
        """
        self.save()
        write = self._agree_on_updates(self._store is not None and self._rank() == 0 and self._store.due())
        if write and self._store is not None:
            self._write_commit(self._store)
        self._raise_if_updated()

    def check_host_updates(self) -> None:
        """Raise ``HostsUpdatedInterrupt`` on every rank if a host update was queued (one broadcast)."""
        self._agree_on_updates(False)
        self._raise_if_updated()

    def _agree_on_updates(self, write: bool) -> bool:
        """Horovod's one broadcast of (previous, newest timestamp, updates), with rank 0's ``write`` beside."""
        prev = newest = self._last_updated_timestamp
        seen = HostUpdateResult.no_update
        while not self._host_messages.empty():
            timestamp, update = self._host_messages.get()
            if timestamp > newest:
                newest = timestamp
                seen |= update
        prev, self._last_updated_timestamp, seen, write = self._bcast_object((prev, newest, int(seen), write))
        self._update_seen = (prev, HostUpdateResult(seen))
        return bool(write)

    def _raise_if_updated(self) -> None:
        prev, seen = self._update_seen
        if self._last_updated_timestamp > prev:
            raise HostsUpdatedInterrupt(seen == HostUpdateResult.removed)

    # ------------------------------------------------------------------ what subclasses provide
    def save(self) -> None:
        """Copy the state to memory."""
        raise NotImplementedError

    def restore(self) -> None:
        """Go back to the last ``save()``, undoing what was not committed."""
        raise NotImplementedError

    def sync(self) -> None:
        """Make every rank's state rank 0's."""
        raise NotImplementedError

    def reset(self) -> None:
        """Adjust objects after a reset, before the callbacks (nothing by default)."""

    def _durable(self) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
        """(model, optimizer or None, picklable objects) to write; a state without a model writes an empty one."""
        return torch.nn.Module(), None, {}

    def _load_durable(self, objects: dict[str, Any]) -> None:
        """Take back what ``_durable`` gave, after the model and optimizer were loaded."""

    def _write_commit(self, store: CommitStore) -> None:
        model, optimizer, objects = self._durable()
        store.write(model, optimizer, objects)

    def attach_store(self, store: CommitStore | None) -> None:
        """Where ``commit()`` writes durably (``hvd.elastic.run`` attaches its store while it runs; None detaches)."""
        self._store = store

    def resume_from(self, store: CommitStore, path: Any) -> dict[str, Any]:
        """Load the commit at ``path`` into this state's model, optimizer and objects; returns the objects."""
        model, optimizer, _ = self._durable()
        objects = store.read(path, model, optimizer)
        self._load_durable(objects)
        return objects


class ObjectState(State):
    """State made of plain picklable objects, each keyword argument an attribute (``state.epoch``).

    Args:
        bcast_object, get_rank: as for ``State`` (default: the running Manager's).
        kwargs: the objects; ``commit()`` saves their current values, ``sync()`` broadcasts the saved ones.
    """

    def __init__(self, bcast_object: Callable[[Any], Any] | None = None, get_rank: Callable[[], int] | None = None,
                 **kwargs: Any) -> None:
        self._saved_state: dict[str, Any] = kwargs
        self._set_attrs()
        super().__init__(bcast_object=bcast_object, get_rank=get_rank)

    def save(self) -> None:
        self._saved_state = {name: getattr(self, name) for name in self._saved_state}

    def restore(self) -> None:
        self._set_attrs()

    def sync(self) -> None:
        if self._saved_state:
            self._saved_state = self._bcast_object(self._saved_state)
            self._set_attrs()

    if TYPE_CHECKING:  # the kwargs are attributes (state.epoch): say so to type checkers, change nothing
        def __getattr__(self, name: str) -> Any: ...

        def __setattr__(self, name: str, value: Any) -> None: ...

    def _set_attrs(self) -> None:
        for name, value in self._saved_state.items():
            setattr(self, name, value)

    def _durable(self) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
        return torch.nn.Module(), None, {"objects": dict(self._saved_state)}

    def _load_durable(self, objects: dict[str, Any]) -> None:
        self._saved_state = dict(objects["objects"])
        self._set_attrs()
