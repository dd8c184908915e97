"""``hvd.elastic.run``: resume from the last written commit, train, and leave restarts to the launcher.

Horovod's elastic driver re-forms the world inside running processes. unidist's engines (MPI, gloo through
torch.distributed, DeepSpeed, Horovod under horovodrun without elastic flags) cannot: a dead peer ends the
job. So here elasticity is the launcher's restart plus durable commits: on start, rank 0 says the job's name and
directory and ``run`` resumes every rank from the job's newest commit when there is one (a restarted or re-run
job, at any world size; the line says when and by how many ranks it was written, so a commit left by an old
run is never picked up unannounced), else broadcasts rank 0's state as Horovod does. When a collective fails it
raises ``HorovodInternalError`` naming the commit the job will resume from; where the launcher kills every rank
first (mpiexec), rank 0's watcher (sentinel.py) says it. ``torchrun --max-restarts N`` then restarts every
worker, and under mpiexec, horovodrun or the deepspeed launcher the same command re-run resumes. When the
function returns on every rank the job's commits are deleted, so the next run of the same command starts afresh.
"""

from __future__ import annotations

import functools
import os
import sys
from collections.abc import Callable
from typing import Any, TypeVar

import unidist
from unidist.compat.horovod.elastic.sentinel import Sentinel, describe, read_latest
from unidist.compat.horovod.elastic.state import State
from unidist.compat.horovod.elastic.store import CommitStore, shown
from unidist.compat.horovod.exceptions import HorovodInternalError, HostsUpdatedInterrupt
from unidist.errors import CollectiveTimeoutError, InvalidArgumentError, LaunchEnvironmentError, PeerLostError

__all__ = ["run"]

F = TypeVar("F", bound=Callable[..., Any])

_ELASTIC_FLAGS = "HOROVOD_ELASTIC"  # set by horovodrun's gloo runner when started with elastic flags


def _refuse_horovod_driver() -> None:
    if os.environ.get(_ELASTIC_FLAGS, "0").strip() not in ("", "0"):
        raise LaunchEnvironmentError(
            f"hvd.elastic.run: this job was started by horovodrun with elastic flags ({_ELASTIC_FLAGS}=1: "
            "--min-np/--max-np/--host-discovery-script), which need Horovod's own elastic driver to re-form the "
            "world in place; unidist cannot join it. Start the job without those flags (horovodrun -np N), or "
            "with torchrun --max-restarts N for automatic restarts; hvd.elastic.run then resumes from the last "
            "commit")


def _engine_failure(err: BaseException) -> bool:
    """Is this a collective failing (a peer gone), not the training code's own error?"""
    kinds: list[type] = [HorovodInternalError, CollectiveTimeoutError, PeerLostError]
    for module, name in (("torch.distributed", "DistError"), ("horovod.common.exceptions", "HorovodInternalError")):
        found = getattr(sys.modules.get(module), name, None)
        if isinstance(found, type):
            kinds.append(found)
    mpi = sys.modules.get("mpi4py.MPI")
    if mpi is not None and isinstance(getattr(mpi, "Exception", None), type):
        kinds.append(mpi.Exception)
    return isinstance(err, tuple(kinds)) or (isinstance(err, RuntimeError) and "gloo" in str(err).lower())




def _restart_hint(mgr: Any, store: CommitStore) -> str:
    again = "run the same command again (any number of processes) to resume from it"
    if store.named:
        again += f" with UNIDIST_ELASTIC_JOB={store.job}"
    if mgr.launch.launcher == "torchrun":
        return (f"torchrun restarts every worker from it while restarts remain (--max-restarts N; this was attempt "
                f"{mgr.launch.attempt}); otherwise {again}")
    return again


def _start(state: State, store: CommitStore, mgr: Any) -> None:
    """Resume every rank from the newest commit, or make rank 0's state everyone's (Horovod's sync); rank 0 says
    which, naming the job and its directory."""
    path = store.latest()
    if path is None:
        if mgr.rank == 0:
            print(f"hvd.elastic: job {store.job!r}: no commit to resume in {store.directory}; starting from rank "
                  f"0's state on {mgr.size} rank(s)", file=sys.stderr, flush=True)
        state.sync()
    else:
        state.resume_from(store, path)
        if mgr.rank == 0:
            latest = read_latest(store.directory)
            said = describe(store.directory) if latest is not None and latest["commit"] == path.name else \
                f"the last commit is {path} {shown(store.last_objects)}"
            print(f"hvd.elastic: job {store.job!r}: attempt {mgr.launch.attempt} on {mgr.size} rank(s) resumes: "
                  f"{said}; to start afresh instead, delete {store.directory} or set UNIDIST_ELASTIC_JOB to a new "
                  "name", file=sys.stderr, flush=True)
        state.on_reset()
    state.save()


def run(func: F) -> F:
    """Decorate the training function ``func(state, *args, **kwargs)`` (``state``: an ``hvd.elastic.State``).

    On entry every rank resumes from the job's last written commit if there is one, else takes rank 0's
    state; then ``func`` runs. A ``HostsUpdatedInterrupt`` (raised by ``state.commit()`` when hosts change;
    never on unidist's launchers) resets the state and calls ``func`` again, as in Horovod. A failed
    collective ends this process with ``HorovodInternalError``: the launcher's restart (``torchrun
    --max-restarts``) or re-running the command resumes from the last commit. Call no collective before it.
    """
    if not callable(func):
        raise InvalidArgumentError(f"hvd.elastic.run decorates a function, got {type(func).__name__}")

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> Any:
        if not isinstance(state, State):
            raise InvalidArgumentError(f"{getattr(func, '__name__', 'the function')}'s first argument must be an "
                                       f"hvd.elastic.State (TorchState, ObjectState), got {type(state).__name__}")
        _refuse_horovod_driver()
        mgr = unidist.get_manager()
        store = CommitStore.open(mgr)
        watcher = Sentinel(store.directory, store.job, _restart_hint(mgr, store)) if mgr.rank == 0 else None
        state.attach_store(store)
        try:
            try:
                _start(state, store, mgr)
            except Exception:  # a commit that cannot be read: its error says so, the watcher need not
                if watcher is not None:
                    watcher.settle("said")
                raise
            skip_sync = True  # _start synced
            while True:
                try:
                    if not skip_sync:
                        state.sync()
                    result = func(state, *args, **kwargs)
                    break
                except HostsUpdatedInterrupt as err:
                    skip_sync = err.skip_sync
                    state.on_reset()
                except Exception as err:
                    if watcher is not None:
                        watcher.settle("said")
                    if _engine_failure(err):
                        raise HorovodInternalError(
                            f"hvd.elastic.run: a collective failed on rank {mgr.rank}, and unidist's engines cannot "
                            f"re-form the world in place, so this process ends; "
                            f"{describe(store.directory, _restart_hint(mgr, store))}. The engine said: "
                            f"{type(err).__name__}: {err}") from err
                    print(f"hvd.elastic: rank {mgr.rank}: training stopped by {type(err).__name__}; "
                          f"{describe(store.directory, _restart_hint(mgr, store))}", file=sys.stderr, flush=True)
                    raise
            store.remove()
            if watcher is not None:
                watcher.settle("done")
            return result
        finally:
            state.attach_store(None)
            store.close()

    return wrapper  # type: ignore[return-value]
