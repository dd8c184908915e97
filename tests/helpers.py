"""Start real launchers from tests: argv lists, a hard timeout that kills the whole process group."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
WORKERS = Path(__file__).resolve().parent / "workers"
BIN = Path(sys.executable).parent


@dataclass
class Run:
    argv: list[str]
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool

    def describe(self) -> str:
        return (f"$ {' '.join(self.argv)}\nexit {self.returncode}{' (timed out)' if self.timed_out else ''}\n"
                f"--- stdout\n{self.stdout[-4000:]}\n--- stderr\n{self.stderr[-6000:]}")


def clean_env(extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """This environment minus any launcher/unidist variables the test runner itself may have inherited."""
    prefixes = ("UNIDIST_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "HOROVOD_", "SLURM_", "TORCHELASTIC_")
    names = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "GROUP_RANK",
             "MASTER_ADDR", "MASTER_PORT")
    env = {k: v for k, v in os.environ.items() if not k.startswith(prefixes) and k not in names}
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONUNBUFFERED"] = "1"
    env.update(extra or {})
    return env


def run(argv: Sequence[str], *, env: Mapping[str, str] | None = None, timeout: float = 600,
        cwd: Path | None = None) -> Run:
    """Run argv in its own session; on timeout kill the whole group so no rank is left behind."""
    proc = subprocess.Popen(list(argv), env=clean_env(env), cwd=cwd or ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        timed_out = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        timed_out = True
    return Run(list(argv), proc.returncode, out, err, timed_out)


def python(n: int, *args: str) -> list[str]:
    """No launcher: one process (the local backend)."""
    if n != 1:
        raise ValueError("plain python starts one process")
    return [sys.executable, *args]


def family_argv(launcher: str, n: int, *args: str) -> list[str]:
    """The command line of launcher family ``launcher`` (a row of unidist.launch.LAUNCHERS, as ``unidist
    launch`` spells it), with the program installed beside this interpreter; ``"none"`` is plain python."""
    from unidist.launch import NO_LAUNCHER, family

    if launcher == NO_LAUNCHER:
        return python(n, *args)
    fam = family(launcher)
    if fam is None or fam.command is None:
        raise ValueError(f"no command line for launcher family {launcher!r}")
    argv = fam.command.argv(str(BIN / fam.command.programs[0]), n, sys.executable, free_port(), list(args))
    if launcher == "deepspeed":
        # leave out --no_local_rank so the launcher appends --local_rank=N, as it does for users' scripts
        argv = [a for a in argv if a != "--no_local_rank"]
    return argv


def launcher(backend: str, n: int, *args: str) -> list[str]:
    """The command line ``unidist launch --backend <backend>`` would run (the launcher its record names)."""
    from unidist import registry

    fam = registry.get(backend).launcher
    return family_argv(fam if fam is not None else "none", n, *args)


def mpiexec(n: int, *args: str) -> list[str]:
    return launcher("mpi", n, *args)


def results(out: Path, size: int) -> dict[int, dict[str, str]]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(size)
            if (out / f"rank{r}.json").exists()}


def torchrun(n: int, *args: str) -> list[str]:
    return launcher("torch", n, *args)


def require(*engines: str) -> None:
    """Skip when an engine is not installed, unless REQUIRE_ENGINES (set by tox/CI) names it: then fail."""
    import importlib.util

    required = os.environ.get("REQUIRE_ENGINES", "").replace(",", " ").split()
    for engine in engines:
        if importlib.util.find_spec(engine) is not None:
            continue
        reason = f"{engine} is not installed"
        if engine in required or "all" in required:
            pytest.fail(f"{reason}, but REQUIRE_ENGINES={os.environ['REQUIRE_ENGINES']!r} requires it")
        pytest.skip(reason)


def free_port() -> int:
    from unidist.net import free_port as port

    return port()


def deepspeed(n: int, *args: str) -> list[str]:
    """The deepspeed launcher on this CPU-only machine: its CPU accelerator starts n local processes."""
    return family_argv("deepspeed", n, *args)


def horovodrun(n: int, *args: str) -> list[str]:
    """horovodrun with its gloo controller (no MPI needed), all ranks on this host."""
    return launcher("horovod", n, *args)


@dataclass(frozen=True)
class Launch:
    """One way to start N processes: the launcher family, the backend init() must pick, the packages it needs."""

    size: int
    launcher: str
    backend: str
    engines: tuple[str, ...] = ("torch",)
    env: dict[str, str] = field(default_factory=dict)
    own_training: bool = True  # prepare runs unidist's DistributedOptimizer (no engine trainer of its own)

    def command(self, *args: str) -> list[str]:
        return family_argv(self.launcher, self.size, *args)

    def resized(self, n: int) -> Launch:
        return Launch(n, self.launcher, self.backend, self.engines, self.env, self.own_training)


def _launch(record: Any, way: Any, n: int) -> Launch:
    from unidist.engines import unidist_training
    from unidist.launch import family

    fam = family(way.launcher)
    engines = tuple(record.requires) + (("mpi4py",) if fam is not None and fam.mpi_like else ())
    return Launch(n, way.launcher, record.name, tuple(dict.fromkeys(engines)), way.environment(_has_cuda()),
                  record.strategy is unidist_training)


def _has_cuda() -> bool:
    import torch

    return torch.cuda.is_available()


def _all_launches() -> dict[str, Launch]:
    """Every registered backend's test launches (its record's ``launches``) at their standard sizes, by id."""
    from unidist import registry

    return {way.label.format(n=n): _launch(rec, way, n)
            for rec in registry.records() for way in rec.launches for n in way.sizes}


def main_launches(n: int) -> dict[str, Launch]:
    """Each registered multi-process backend's main launch (its record's first) at n processes, by id."""
    from unidist import registry

    return {rec.launches[0].label.format(n=n): _launch(rec, rec.launches[0], n)
            for rec in registry.records() if rec.launches and rec.launcher is not None}


def solo_launches() -> dict[str, Launch]:
    """Each registered one-process backend's launch (plain python), by id."""
    from unidist import registry

    return {rec.launches[0].label.format(n=1): _launch(rec, rec.launches[0], 1)
            for rec in registry.records() if rec.launches and rec.launcher is None}


def ways(n: int) -> dict[str, Launch]:
    """Every way each registered multi-process backend is started (all its record's launches) at n, by id."""
    from unidist import registry

    return {way.label.format(n=n): _launch(rec, way, n)
            for rec in registry.records() if rec.launcher is not None for way in rec.launches}


LAUNCHES = _all_launches()


class _Marks(dict[str, Any]):
    """The pytest mark of each backend (pyproject.toml registers unidist's; a backend registered elsewhere
    gets one of its own name)."""

    def __missing__(self, backend: str) -> Any:
        return getattr(pytest.mark, backend)


MARKS = _Marks(local=pytest.mark.local, mpi=pytest.mark.mpi, torch=pytest.mark.torch,
               deepspeed=pytest.mark.deepspeed, horovod=pytest.mark.horovod)


def assert_trains_like_one_process(reports: Mapping[int, Mapping[str, Any]], backend: str,
                                   tolerance: Mapping[str, float]) -> None:
    """tests/workers/equivalence.py's reports, every rank: run by ``backend``, each variant not refused, the ranks'
    parameters identical after every step and within its tolerance of one process on the whole batch, and
    synchronize() then step() reducing once (the several-host and Slurm suites check the same)."""
    for rank, report in reports.items():
        assert report["backend"] == backend, (rank, report["backend"])
        for variant, tol in tolerance.items():
            r = report[variant]
            assert "refused" not in r, (rank, variant, r)
            assert r["max_spread"] == 0.0, (rank, variant, r)  # identical parameters on every rank
            assert r["max_diff"] <= tol, (rank, variant, r)
        once = report["synchronize_once"]
        assert once["applied_minus_synchronized"] <= 1e-6 and once["synchronized_minus_expected"] <= 1e-4, once


def upstream_copy(src: Path, script: str, siblings: Sequence[str], imports: Mapping[str, str], dest: Path,
                  compat: bool) -> Path:
    """An upstream example (tests/data/...) with its siblings in ``dest``; with ``compat`` its import lines are
    replaced (each ``imports`` key must be a whole line of the script, exactly once, and no ``import deepspeed`` /
    ``from deepspeed`` line may remain). Returns ``dest``."""
    dest.mkdir(parents=True, exist_ok=True)
    for name in siblings:
        shutil.copy(src / name, dest / name)
    text = (src / script).read_text()
    if compat:
        lines = text.splitlines(keepends=True)
        for old, new in imports.items():
            where = [i for i, line in enumerate(lines) if line == old]
            if len(where) != 1:
                raise AssertionError(f"{script} must contain the line {old!r} exactly once")
            lines[where[0]] = new
        text = "".join(lines)
        left = [line for line in text.splitlines() if line.startswith(("import deepspeed", "from deepspeed"))]
        if left:
            raise AssertionError(f"{script} still imports real DeepSpeed after the replacement: {left}")
    (dest / script).write_text(text)
    return dest


def compat_local_manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A fixture's body for the DeepSpeed compat layer's one-process tests: its own ``with unidist.init()`` block on
    the local backend, with the variables init_distributed sets restored and its process group gone afterwards
    (nothing leaks into the next test module). The tensors are CPU tensors: the Manager is told the CPU, and
    DS_ACCELERATOR (a GPU machine's set-up may export cuda) is unset so that the accelerator follows it."""
    import torch

    import unidist
    import unidist.compat.deepspeed as deepspeed

    monkeypatch.setenv("UNIDIST_BACKEND", "local")
    monkeypatch.setenv("UNIDIST_DEVICE", "cpu")
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_SIZE", "DS_ACCELERATOR"):
        monkeypatch.delenv(name, raising=False)
    with unidist.init() as mgr:
        try:
            yield mgr
        finally:
            if deepspeed.comm.is_initialized():
                deepspeed.comm.destroy_process_group()
    assert not torch.distributed.is_initialized()
