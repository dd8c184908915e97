"""The backend table: one record per engine, and nothing else in the package keeps a list of backends.

A record says everything the rest of the code needs to know about a backend: the Manager class and the
training strategy behind ``prepare`` (both handed over as calls that import them when called, so that
``import unidist`` imports no engine), the packages it needs and how to install them, the launcher family that
starts it and the ones that imply it, and the launches the tests use; beside it, optional, the engine's own calls the
benchmarks compare with and the algorithms the cost model assumes for it (a :class:`RawEngine`). The selector,
``unidist launch``, ``unidist info``, the
benchmarks, the cost model and the multi-process tests read it, and keep no table of their own. unidist's own
five records live in ``unidist/engines/``; a backend written outside the package registers with one call,
:func:`register`, and is then chosen with ``UNIDIST_BACKEND``.

This module sits low (it imports only errors and launch): the managers read their record from here, and
the records point up at the managers through their calls, never the other way round.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from unidist.errors import ConfigError
from unidist.launch import LAUNCHERS, NO_LAUNCHER, family, find_program
from unidist.strategy import Strategy

__all__ = ["ENTRY_POINTS", "NO_RAW", "Backend", "Launch", "RawEngine", "Strategy", "first_launchable", "for_launcher",
           "get", "names", "records", "register", "unregister"]


@dataclass(frozen=True)
class Launch:
    """One way to start this backend: a launcher family of ``unidist.launch.LAUNCHERS`` (or ``"none"`` for
    plain python) and the environment it needs.

    Attributes:
        launcher: the family whose command line starts the processes.
        label: the test id pattern (``{n}`` is the process count: ``"mpiexec-{n}"``).
        sizes: the process counts the standard test suites run it with.
        env: variables the launch needs (``UNIDIST_BACKEND`` where the launcher implies another backend).
        cpu_env: variables it needs on a machine without a GPU (DeepSpeed's ``DS_ACCELERATOR=cpu``).
        bench: the name of this launch's run in ``python -m unidist.bench report`` (None: not run there).
    """

    launcher: str
    label: str
    sizes: tuple[int, ...] = (2,)
    env: Mapping[str, str] = field(default_factory=dict)
    cpu_env: Mapping[str, str] = field(default_factory=dict)
    bench: str | None = None

    def environment(self, gpu: bool) -> dict[str, str]:
        """The variables this launch needs on a machine with (or without) a GPU."""
        return {**self.env, **({} if gpu else self.cpu_env)}


@dataclass(frozen=True)
class RawEngine:
    """The engine's own API as its users call it: what the benchmarks put beside unidist (their raw columns) and
    the algorithms the cost model assumes. Optional in a record: a backend without one is benchmarked through unidist
    alone. It lives in the engine's package (``engines/<name>/raw.py``) and imports the engine only when called.

    Attributes:
        api: what the benchmarks call the engine's own API (``"mpi4py"``).
        calls: given a started Manager, the engine's own collective calls by name (``bench collectives``' raw
            column): ``{"allreduce": builder, ...}``, a builder taking the input tensor and returning a call.
        grad_mean: given a started Manager, the engine's in-place average of one gradient.
        trainer: the engine's own training engine (``bench step``'s raw column): given a started Manager, a model,
            its optimizer, a ZeRO stage and a precision mode, an object that is called as the model is and has
            ``backward(loss)`` and ``step()``, made with the config ``prepare`` would use.
        trainer_column: what ``bench step`` calls the columns of ``trainer`` (``"ds"``: ``ds-z2``); no ``-`` in it.
        p2p: given a started Manager, the engine's own blocking send and recv on the world, each called with a tensor
            and the peer's rank: ``{"engine": (send, recv), "engine+guard": (send, recv)}``, the second with the
            size guard unidist adds (MPI: the receive status's count; gloo: a header frame).
        optimizer: the engine's own data parallelism as its examples write it (``bench train``'s column named after
            the backend): given a started Manager, a model and its optimizer, makes the model's state equal on every
            rank and returns an optimizer whose ``step()`` averages the gradients first.
        reducer: what ``prepare(reducer='engine')`` averages the gradients with, as the benchmarks print it
            (``"hvd.DistributedOptimizer"``); None: no reducer of its own, and ``bench gradsync`` compares nothing
            more.
        start: the engine started as its own users start it in a training script (mpi4py's import,
            ``init_process_group``, ``deepspeed.init_distributed``, ``hvd.init``), importing it when called; returns
            the call that ends it (``bench startup``'s raw column).
        algorithms: the collective library whose documented algorithm choices run underneath, by the launcher family
            that starts it (``"*"``: any other), for the cost model (``unidist.bench.costmodel.KNOWN``: ``"mpich"``
            or ``"gloo"``). Empty: not documented; the cost model refuses to model the engine as if it were another.
    """

    api: str = "none"
    calls: Callable[[Any], Mapping[str, Callable[[Any], Callable[[], Any]]]] | None = None
    grad_mean: Callable[[Any], Callable[[Any], Any]] | None = None
    trainer: Callable[[Any, Any, Any, int, str], Any] | None = None
    trainer_column: str = "engine"
    p2p: Callable[[Any], Mapping[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]] | None = None
    optimizer: Callable[[Any, Any, Any], Any] | None = None
    reducer: str | None = None
    start: Callable[[], Callable[[], Any]] | None = None
    algorithms: Mapping[str, str] = field(default_factory=dict)


NO_RAW = RawEngine()  # a record without the benchmarks' part


@dataclass(frozen=True)
class Backend:
    """One engine's registration: what selecting, starting, installing and training it needs.

    Attributes:
        name: the value of ``UNIDIST_BACKEND`` that selects it.
        manager_name: the Manager class's name (``unidist.<manager_name>`` gives the class).
        manager: returns the Manager class (importing it when called).
        strategy: returns the training strategy class (see :class:`Strategy`) behind ``prepare``.
        requires: packages that must be importable; checked before the manager is imported, for a clear error.
        install: the command that installs them, shown when one is missing.
        launcher: the launcher family whose command ``unidist launch --backend <name>`` runs (None: plain
            python, one process).
        implied_by: launcher families that pick this backend when ``UNIDIST_BACKEND`` is unset.
        needs_pmi: its processes meet through an MPI world, so under Slurm srun must give them PMI
            (``unidist launch`` passes ``--mpi=pmi2`` for it, ``--mpi=none`` for the others).
        distributions: installed distributions beyond ``requires`` whose versions ``unidist info`` reports (the
            ``mpich`` wheel that provides mpiexec).
        env_prefixes: the prefixes of the variables the engine reads (``"NCCL_"``): ``unidist launch`` carries them
            to the processes it starts on other hosts over ssh (a launcher started per host gets no environment).
        launches: how the tests start it; the first one is its main launch.
        raw: the engine's own API for the benchmarks (:class:`RawEngine`), optional.
    """

    name: str
    manager_name: str
    manager: Callable[[], type[Any]]
    strategy: Callable[[], Strategy]
    requires: tuple[str, ...] = ()
    install: str = ""
    launcher: str | None = None
    implied_by: tuple[str, ...] = ()
    needs_pmi: bool = False
    distributions: tuple[str, ...] = ()
    env_prefixes: tuple[str, ...] = ()
    launches: tuple[Launch, ...] = ()
    raw: RawEngine = NO_RAW

    def missing(self) -> list[str]:
        """The required packages that are not installed."""
        return [pkg for pkg in self.requires if importlib.util.find_spec(pkg) is None]


_TABLE: dict[str, Backend] = {}


def register(backend: Backend, *, replace: bool = False) -> Backend:
    """Add a backend; ``UNIDIST_BACKEND=<backend.name>`` then selects it.

    Args:
        backend: its record.
        replace: allow replacing a backend registered under the same name (refused otherwise, so a plugin
            cannot silently shadow a built-in backend).

    A launcher family named in ``implied_by`` must exist and may imply one backend only.
    """
    if not isinstance(backend, Backend):
        raise ConfigError(f"register() takes a unidist.registry.Backend record, got {type(backend).__name__}")
    name = backend.name
    if not name or not isinstance(name, str):
        raise ConfigError(f"a backend name must be a non-empty string, not {name!r}")
    old = _TABLE.get(name)
    if old is not None and not replace:
        raise ConfigError(f"a backend named {name!r} is already registered; pick another name, or pass "
                          "replace=True to replace it")
    known = {fam.name for fam in LAUNCHERS} | {NO_LAUNCHER}
    for fam in (*backend.implied_by, *([backend.launcher] if backend.launcher else []),
                *(lch.launcher for lch in backend.launches), *(f for f in backend.raw.algorithms if f != "*")):
        if fam not in known:
            raise ConfigError(f"backend {name!r} names launcher family {fam!r}, which unidist.launch does not "
                              f"know; use one of {', '.join(sorted(known))}")
    if not backend.raw.trainer_column or "-" in backend.raw.trainer_column:
        raise ConfigError(f"backend {name!r}: raw.trainer_column {backend.raw.trainer_column!r} must be a non-empty "
                          "word without '-' (bench step names its columns '<it>-z<stage>')")
    for fam in backend.implied_by:
        other = next((b.name for b in _TABLE.values() if fam in b.implied_by and b.name != name), None)
        if other is not None:
            raise ConfigError(f"launcher family {fam!r} already implies the {other!r} backend; a backend "
                              "outside unidist is chosen with UNIDIST_BACKEND, not by its launcher")
    if backend.launcher is not None and (fam_row := family(backend.launcher)) is not None and fam_row.command is None:
        raise ConfigError(f"backend {name!r}: launcher family {backend.launcher!r} has no command line to run")
    _TABLE[name] = backend
    return backend


def unregister(name: str) -> None:
    """Remove a backend (a no-op for an unknown name)."""
    _TABLE.pop(name, None)


def names() -> tuple[str, ...]:
    """Every registered backend's name, in registration order."""
    return tuple(_TABLE)


def records() -> tuple[Backend, ...]:
    """Every registered backend's record, in registration order."""
    return tuple(_TABLE.values())


def get(name: str) -> Backend:
    """The record of backend ``name``; an unknown name is first looked up among the installed packages'
    ``unidist.backends`` entry points (see :data:`ENTRY_POINTS`), then a ConfigError listing the registered
    ones."""
    try:
        return _TABLE[name]
    except KeyError:
        pass
    _load_entry_point(name)
    try:
        return _TABLE[name]
    except KeyError:
        hint = ""
        if name in ("ray", "dask", "pymp", "pyseq"):
            hint = (" (that value is for Modin's unrelated 'unidist' package, which reads the same variable; "
                    "unset UNIDIST_BACKEND for this run)")
        elif close := _closest(name):
            hint = f" (did you mean {close!r}?)"
        raise ConfigError(
            f"UNIDIST_BACKEND={name!r} is not a registered backend; choose one of {', '.join(_TABLE)}{hint}"
        ) from None


ENTRY_POINTS = "unidist.backends"
"""The entry-point group of installed backends: a package that declares ``[project.entry-points."unidist.backends"]
name = "its_package.its_module"`` is imported when ``UNIDIST_BACKEND=name`` is first looked up, and its module
registers the backend (one :func:`register` call at import). So an unchanged script runs on it."""


# what users also call a built-in backend: the process-group libraries torch.distributed runs on, the abbreviations
_ALSO_CALLED = {"nccl": "torch", "gloo": "torch", "ddp": "torch", "ds": "deepspeed", "hvd": "horovod"}


def _closest(name: str) -> str | None:
    """The registered or installed backend name a misspelt ``name`` most likely meant (``mpii``, ``MPI``,
    ``pytorch``), or None."""
    import difflib
    from importlib.metadata import entry_points

    known = [*_TABLE, *(ep.name for ep in entry_points(group=ENTRY_POINTS) if ep.name not in _TABLE)]
    by_case = {k.lower(): k for k in known}
    if name.lower() in by_case:
        return by_case[name.lower()]
    if _ALSO_CALLED.get(name.lower()) in known:  # a library under the engine (nccl) or its usual abbreviation
        return _ALSO_CALLED[name.lower()]
    close = difflib.get_close_matches(name.lower(), known, n=1, cutoff=0.6)
    if close:
        return close[0]
    # a name that contains or is contained in one (``pytorch`` -> torch, ``hvd`` is too far)
    inside = [k for k in known if len(k) >= 3 and (k in name.lower() or name.lower() in k)]
    return inside[0] if len(inside) == 1 else None


def _load_entry_point(name: str) -> None:
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINTS, name=name):
        try:
            ep.load()
        except Exception as err:  # a broken plugin is named, not hidden behind "not registered"
            raise ConfigError(f"UNIDIST_BACKEND={name!r}: importing its entry point {ep.value!r} failed: "
                              f"{type(err).__name__}: {err}") from err
        if name not in _TABLE:
            raise ConfigError(f"UNIDIST_BACKEND={name!r}: its entry point {ep.value!r} was imported but registered "
                              f"no backend of that name; its module must call unidist.registry.register()")


def for_launcher(launcher: str) -> str:
    """The backend a launcher family implies when ``UNIDIST_BACKEND`` is unset."""
    for backend in _TABLE.values():
        if launcher in backend.implied_by:
            return backend.name
    raise ConfigError(f"no registered backend runs under the {launcher!r} launcher by default; set UNIDIST_BACKEND "
                      f"to one of {', '.join(_TABLE)}")


def first_launchable(find: Callable[[str], str | None] = find_program) -> Backend | None:
    """The first backend, in the records' order of preference, whose launcher program ``find`` finds: the one
    ``unidist launch`` runs without ``--backend`` (None: no launcher program is installed)."""
    for backend in _TABLE.values():
        fam = family(backend.launcher) if backend.launcher else None
        if fam is not None and fam.command is not None and any(find(p) for p in fam.command.programs):
            return backend
    return None
