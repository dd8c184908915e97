"""Manager: one distributed run of one engine: lifecycle, topology, groups.

The Manager is the world's Communicator (``unidist.comm``: every collective, written once) over the Engine its
backend makes when it starts; each engine's package (``unidist/engines/<name>/manager.py``) has its Manager
subclass: start-up and shutdown. The training entry points (``prepare``, ``backward``, ...) are training.py's,
inherited: typed calls into the strategy the Manager was handed when made, so the collective layers below never
import the training layer.
"""

from __future__ import annotations

import abc
import logging
import os
import sys
import traceback
import weakref
from collections.abc import Callable, Mapping, Sequence
from types import ModuleType, TracebackType
from typing import Any, ClassVar, Literal, TypeVar

import torch

from unidist.comm import processes, timeline, watchdog
from unidist.comm.communicator import Communicator
from unidist.comm.engine import Engine
from unidist.comm.group import Group
from unidist.comm.work import DONE, EngineWork, Handle, Work
from unidist.config import Config
from unidist.errors import CollectiveMismatchError, ConfigError, InvalidArgumentError, NotInitializedError, UnidistError
from unidist.launch import LaunchInfo, detect
from unidist.managers import logs
from unidist.managers.training import TrainingEntryPoints
from unidist.net import host_address, local_only_env
from unidist.registry import get
from unidist.strategy import Loader, Strategy, TrainingStrategy
from unidist.tree import to_device

T = TypeVar("T")

__all__ = ["DONE", "EngineWork", "Group", "Handle", "Manager", "Work", "get_manager"]

_log = logging.getLogger("unidist")
_active: Manager | None = None


def get_manager() -> Manager:
    """The started Manager of this process."""
    if _active is None:
        raise NotInitializedError("no unidist Manager is active; start one with `with unidist.init() as mgr:`")
    return _active


class Manager(TrainingEntryPoints, Communicator):
    """One distributed run. ``with Manager() as mgr:`` starts the engine and always shuts it down; in between
    the Manager is the world's communicator over that engine."""

    name: ClassVar[str] = "base"

    def __init__(self, config: Config | None = None, launch: LaunchInfo | None = None, *,
                 strategy: Callable[[], Strategy] | None = None) -> None:
        """Args:
            config: the settings (default: ``Config.from_env()``). launch: what the launcher said (default:
                ``detect()``).
            strategy: returns the training layer behind ``prepare``, ``backward`` and the checkpoints, called
                (so the layer imported) at the first of them (default: the call this backend's record in
                ``unidist.registry`` names).
        """
        self.config = config if config is not None else Config.from_env()
        self.launch = launch if launch is not None else detect()
        # the training layer is imported at the first call that needs it (prepare, a checkpoint...), not here: a
        # script that only communicates never loads it, and init costs what the engine's own start costs
        self._strategy_source = strategy if strategy is not None else get(self.name).strategy
        self._strategy_made: Strategy | None = None
        self._started = False
        self._rank = self._size = self._local_rank = self._local_size = self._node_rank = -1
        self._device = torch.device("cpu")
        self._saved_env: dict[str, str | None] = {}
        self._failing = False  # set by __exit__ when an exception is leaving the with block
        self._trainer: TrainingStrategy | None = None
        self._preemption: Any = None  # mgr.preemption()'s object: its signal handlers are undone at shutdown
        self._made_groups: weakref.WeakSet[Group] = weakref.WeakSet()  # disabled at shutdown
        self._init_collectives()

    # ----------------------------------------------------------------- lifecycle
    def start(self) -> Manager:
        """Start the engine; ``with`` does this for you. A Manager starts once."""
        global _active
        if self._started:
            raise UnidistError(f"{type(self).__name__} is already started; start it once (one `with` block)")
        if _active is not None:
            raise UnidistError(
                f"another Manager ({type(_active).__name__}) is active in this process; shut it down first"
            )
        logging.getLogger("unidist").setLevel(self.config.log_level)
        # UNIDIST_LOG_LEVEL set: unidist's lines on stderr with the rank, unless the script configured logging
        self._log_handler: logs.RankHandler | None = logs.attach(self.config, self.launch.rank, self.launch.size)
        try:
            if 1 < self.launch.size == self.launch.local_size:  # one node: the engines listen on loopback only
                for name, value in local_only_env().items():
                    self._setenv(name, value, only_if_unset=True)
            engine = self._start()
            self._device = self._pick_device()
        except BaseException:
            self._restore_env()
            logs.detach(self._log_handler)
            raise
        # every call recorded when UNIDIST_TIMELINE is set (comm/timeline.py: the engine itself when not), and
        # every wait on peers bounded by UNIDIST_TIMEOUT (comm/watchdog.py): the engine is wrapped once, here
        engine = timeline.recording(engine, self.config.timeline, self.config.timeline_events)
        self._bind(watchdog.watch(engine) if engine.size > 1 else engine)
        self._started = True
        _active = self
        self._enable_fast_path()
        if self._size > 1:
            token = torch.frombuffer(bytearray(os.urandom(12)), dtype=torch.uint8)  # not the user's RNG
            self._broadcast(token, 0)  # the job's name for its heartbeat directory
            # the ranks of other hosts are asked over the network: every rank exchanges (the local sizes the
            # launcher gives need not agree); those sharing their host with fewer than all listen, on its cluster
            # address (none when the host has no route: loopback cannot be reached from another host)
            address = host_address() if self._local_size < self._size else "127.0.0.1"
            timeline.align(self)  # before the watchdog starts counting calls: the count is the same either way
            watchdog.start(self.config.timeout, self._rank, self._size, bytes(token.tolist()).hex(),
                           self._engine.abort, address=None if address.startswith("127.") else address,
                           exchange=self.allgather_object, stall_warning=self.config.stall_warning)
        _log.info("%s started: rank %d of %d on %s", type(self).__name__, self._rank, self._size, self._device)
        return self

    def shutdown(self) -> None:
        """Shut the engine down and undo what ``start`` changed; safe to call twice."""
        global _active
        if not self._started:
            return
        refused = None
        try:
            # the training layer's own leaving (a background save nobody waited for); optional, so a strategy
            # written outside unidist needs none
            close = getattr(self._trainer, "close", None)
            if callable(close):
                close(failing=self._failing)
            if not self._failing and self._size > 1:
                # ranks leave together; one leaving while a peer still waits in a collective is caught here,
                # by the watchdog (a rank that leaves on failure skips it: its peers may be gone)
                with watchdog.watching(watchdog.LEAVING):
                    self._barrier()
                refused = self._pending_mismatch()  # a message its receiver refused: said once all have left
                timeline.finish(self)
            self._shutdown()
        finally:
            if self._preemption is not None:  # the handlers it installed go with the Manager
                self._preemption.close()
                self._preemption = None
            timeline.abandon()  # still recording: this rank failed, or ran alone; its part is kept
            watchdog.stop()
            self._started = False
            self._disable_fast_path()
            for group in list(self._made_groups):  # their fast path skips the started check too
                group.close()
            self._made_groups.clear()
            if _active is self:
                _active = None
            self._restore_env()
            logs.detach(self._log_handler)
            self._log_handler = None
        if refused is not None:
            raise refused

    def __enter__(self) -> Manager:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> Literal[False]:
        try:
            failed = exc is not None and not (isinstance(exc, SystemExit) and exc.code in (0, None))
            self._failing = failed
            if failed and self._started and self._size > 1:
                self._abort_job(exc)  # type: ignore[arg-type]
        finally:
            self.shutdown()
        return False

    def _abort_job(self, exc: BaseException) -> None:
        """One rank failed while the others may wait in a collective; engines that can, end the job (the
        others' launchers stop the job when this process exits)."""
        if self._engine.aborts_job:
            self._report_failure(exc)
            processes.end_job(self._engine.abort, 1)

    def _report_failure(self, exc: BaseException) -> None:
        print(f"unidist: rank {self._rank} of {self._size} failed; ending the job so the other ranks do not "
              "wait forever:", file=sys.stderr)
        traceback.print_exception(type(exc), exc, exc.__traceback__, file=sys.stderr)
        sys.stderr.flush()

    def _setenv(self, name: str, value: str, *, only_if_unset: bool = False) -> None:
        """Set an environment variable for the engine (or leave the user's, ``only_if_unset``); restored at
        shutdown."""
        if only_if_unset and os.environ.get(name):
            return
        self._saved_env.setdefault(name, os.environ.get(name))
        os.environ[name] = value

    def _restore_env(self) -> None:
        for name, old in self._saved_env.items():
            if old is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = old
        self._saved_env.clear()

    def _pick_device(self) -> torch.device:
        want = self.config.device
        if want == "cpu":
            return torch.device("cpu")
        if want.startswith("cuda:"):
            count = torch.cuda.device_count() if torch.cuda.is_available() else 0
            if int(want.split(":")[1]) >= count:
                raise ConfigError(f"UNIDIST_DEVICE={want!r} but torch sees {count} CUDA device(s)"
                                  + ("; unset it or use 'cpu'" if count == 0 else f"; use cuda:0..cuda:{count - 1}"))
            return torch.device(want)
        if torch.cuda.is_available():
            return torch.device(f"cuda:{self._local_rank % torch.cuda.device_count()}")
        if want == "cuda":
            raise ConfigError("UNIDIST_DEVICE='cuda' but torch sees no CUDA device; unset it or use 'cpu'")
        return torch.device("cpu")

    # ----------------------------------------------------------------- topology
    def _need_started(self) -> None:
        if not self._started:
            raise NotInitializedError(
                f"{type(self).__name__} is not started; use `with unidist.init() as mgr:` or call mgr.start()"
            )

    @property
    def started(self) -> bool:
        return self._started

    @property
    def local_rank(self) -> int:
        self._need_started()
        return self._local_rank

    @property
    def local_size(self) -> int:
        self._need_started()
        return self._local_size

    @property
    def node_rank(self) -> int:
        self._need_started()
        return self._node_rank

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def backend(self) -> str:
        return self.name

    @property
    def device(self) -> torch.device:
        self._need_started()
        return self._device

    @property
    def engine_api(self) -> ModuleType | None:
        """The engine's own Python API (the ``deepspeed`` module, ``horovod.torch``) for code built on the engine,
        such as its trainer; None where the backend has none (local, mpi, torch: unidist trains)."""
        return None

    def check_root(self, root: int) -> int:
        """``root`` as a rank of this run; an InvalidArgumentError naming the valid range otherwise.

        Args:
            root: a world rank.
        """
        return self._check_root(root)

    def to_device(self, batch: T, non_blocking: bool | None = None) -> T:
        """``batch`` with every tensor on ``device``: tensors in dicts, lists, tuples, namedtuples, dataclasses and
        ``ModelOutput``-like mappings, each container keeping its type (other objects come back unchanged).

        Args:
            batch: a tensor or a nested batch.
            non_blocking: asynchronous copies; by default only from pinned memory to a GPU, where it is safe.
        """
        return to_device(batch, self.device, non_blocking)

    def loader(self, dataset: Any, batch_size: int = 1, shuffle: bool = False, *, seed: int = 0,
               drop_last: bool = False, **kwargs: Any) -> Loader:
        """This rank's ``DataLoader`` over ``dataset``: its disjoint share (reshuffled each epoch, the same on every
        rank, with ``shuffle``), pinned memory on a GPU, each batch already on ``device``. Iterating again starts
        the next epoch; ``.set_epoch(e)`` picks one (a resume). See ``unidist.train.data.Loader``.

        Args:
            dataset: a map-style dataset (``len()`` and ``[i]``).
            batch_size: rows per batch on this rank.
            shuffle: a new permutation every epoch.
            seed: the permutation's seed.
            drop_last: drop the tail that does not divide among the ranks and an incomplete last batch (False:
                wrap around, so every rank gets as many rows).
            kwargs: other ``torch.utils.data.DataLoader`` arguments (``num_workers``, ``collate_fn``...).
        """
        return self._training().loader(dataset, batch_size=batch_size, shuffle=shuffle, seed=seed,
                                       drop_last=drop_last, **kwargs)

    def __repr__(self) -> str:
        if not self._started:
            return f"<{type(self).__name__} not started>"
        return f"<{type(self).__name__} rank {self._rank}/{self._size} local {self._local_rank}/" \
               f"{self._local_size} node {self._node_rank} device {self._device}>"

    # ----------------------------------------------------------------- lifecycle primitives
    @abc.abstractmethod
    def _start(self) -> Engine:
        """Initialise the library, set _local_rank, _local_size, _node_rank and return the world's engine."""

    @abc.abstractmethod
    def _shutdown(self) -> None: ...

    # ----------------------------------------------------------------- groups
    def new_group(self, ranks: Sequence[int]) -> Group | None:
        """A Group of ``ranks`` (world ranks, in group order); every rank calls it with the same list.

        Members get the Group, the others None. A rank that passes another list is a CollectiveMismatchError
        on every rank, instead of a hang inside the engine.
        """
        self._need_started()
        members = _rank_list(ranks, self._size)
        seen = self.allgather_object(members)
        if any(other != members for other in seen):
            raise CollectiveMismatchError("new_group: ranks passed different lists: " +
                                          "; ".join(f"rank {r}: {v}" for r, v in enumerate(seen)))
        return self._groups([members])[0]

    def split(self, color: int | None, key: int | None = None) -> Group | None:
        """MPI_Comm_split: ranks passing the same ``color`` form one Group, ordered by ``key`` (default: world
        rank; ties by world rank). Every rank calls it; ``color=None`` joins no group and gets None."""
        self._need_started()
        if color is not None and (isinstance(color, bool) or not hasattr(color, "__index__")):
            raise InvalidArgumentError(f"split(color={color!r}) takes an int, or None for no group")
        if key is not None and (isinstance(key, bool) or not hasattr(key, "__index__")):
            raise InvalidArgumentError(f"split(key={key!r}) takes an int")
        mine = (None if color is None else int(color), self._rank if key is None else int(key))
        table = self.allgather_object(mine)
        colors = sorted({c for c, _ in table if c is not None})
        lists = [[r for _, r in sorted((k, r) for r, (c, k) in enumerate(table) if c == col)] for col in colors]
        made = self._groups(lists)
        return None if mine[0] is None else made[colors.index(mine[0])]

    def _groups(self, lists: Sequence[Sequence[int]]) -> list[Group | None]:
        """One Group per list (this rank's or None), created on every rank in the same order, each over its
        sub-engine (``Engine.sub``)."""
        engines = self._engine.sub(lists)
        out = [None if e is None else Group(self, members, e) for members, e in zip(lists, engines, strict=True)]
        self._made_groups.update(g for g in out if g is not None)
        return out

    # ----------------------------------------------------------------- the training strategy
    def _strategy(self) -> Strategy:
        """The training strategy: the one given, else the record's, asked for (so imported) on first use."""
        if self._strategy_made is None:
            self._strategy_made = self._strategy_source()
        return self._strategy_made

    def _training(self) -> TrainingStrategy:
        """This backend's trainer (its strategy made over this Manager), made on first use."""
        if self._trainer is None:
            self._need_started()
            self._trainer = self._strategy()(self)
        return self._trainer


def _rank_list(ranks: Sequence[int], size: int) -> list[int]:
    """World ranks in group order from a list, tuple, range, array or tensor (a set has no order: refused)."""
    if isinstance(ranks, (str, bytes, set, frozenset, Mapping)) or not hasattr(ranks, "__iter__"):
        raise InvalidArgumentError(f"new_group(ranks={ranks!r}) takes a list of world ranks, in group order")
    listed = list(ranks)
    if not listed:
        raise InvalidArgumentError("new_group(ranks=[]) names no rank; a group needs at least one")
    members = []
    for r in listed:
        if isinstance(r, bool) or not hasattr(r, "__index__") or not 0 <= int(r) < size:
            raise InvalidArgumentError(f"new_group: {r!r} is not a world rank (0..{size - 1})")
        members.append(int(r))
    if len(set(members)) != len(members):
        raise InvalidArgumentError(f"new_group(ranks={members}) names a rank twice")
    return members
