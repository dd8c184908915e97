"""Start real launchers from tests: argv lists, a hard timeout that kills the whole process group."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

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


def launcher(backend: str, n: int, *args: str) -> list[str]:
    """The command line of ``backend``'s launcher family (the table in unidist.launch, as ``unidist launch``
    spells it), with the program installed beside this interpreter."""
    from unidist.launch import command_family

    fam = command_family(backend)
    if fam is None or fam.command is None:
        raise ValueError(f"no launcher command for {backend!r}")
    return fam.command.argv(str(BIN / fam.command.programs[0]), n, sys.executable, free_port(), list(args))


def mpiexec(n: int, *args: str) -> list[str]:
    return launcher("mpi", n, *args)


def results(out: Path, size: int) -> dict[int, dict[str, str]]:
    return {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(size)
            if (out / f"rank{r}.json").exists()}


def torchrun(n: int, *args: str) -> list[str]:
    return launcher("torch", n, *args)


def require(engine: str) -> None:
    """Skip when ``engine`` is not installed, unless REQUIRE_ENGINES (set by tox/CI) names it: then fail."""
    import importlib.util

    if importlib.util.find_spec(engine) is not None:
        return
    required = os.environ.get("REQUIRE_ENGINES", "").replace(",", " ").split()
    reason = f"{engine} is not installed"
    if engine in required or "all" in required:
        pytest.fail(f"{reason}, but REQUIRE_ENGINES={os.environ['REQUIRE_ENGINES']!r} requires it")
    pytest.skip(reason)


def free_port() -> int:
    from unidist.net import free_port as port

    return port()


def deepspeed(n: int, *args: str) -> list[str]:
    """The deepspeed launcher on this CPU-only machine: its CPU accelerator starts n local processes. Tests
    leave out --no_local_rank so the launcher appends --local_rank=N and unidist's stripping of it runs."""
    return [a for a in launcher("deepspeed", n, *args) if a != "--no_local_rank"]


def horovodrun(n: int, *args: str) -> list[str]:
    """horovodrun with its gloo controller (no MPI needed), all ranks on this host."""
    return launcher("horovod", n, *args)


@dataclass(frozen=True)
class Launch:
    """One way to start N processes: the launcher, the backend init() must pick, the engine it needs."""

    size: int
    argv: Callable[..., list[str]]
    backend: str
    engine: str = "torch"
    env: dict[str, str] = field(default_factory=dict)

    def command(self, *args: str) -> list[str]:
        return self.argv(self.size, *args)


LAUNCHES = {
    "local-1": Launch(1, python, "local"),
    "mpiexec-2": Launch(2, mpiexec, "mpi", "mpi4py"),
    "mpiexec-3": Launch(3, mpiexec, "mpi", "mpi4py"),
    "mpiexec-2-checked": Launch(2, mpiexec, "mpi", "mpi4py", {"UNIDIST_CHECK_COLLECTIVES": "1"}),
    "torchrun-2": Launch(2, torchrun, "torch"),
    "torch-under-mpiexec-3": Launch(3, mpiexec, "torch", "mpi4py", {"UNIDIST_BACKEND": "torch"}),
    "deepspeed-2": Launch(2, deepspeed, "deepspeed", "deepspeed"),
    "horovodrun-gloo-2": Launch(2, horovodrun, "horovod", "horovod"),
    "horovod-under-mpiexec-2": Launch(2, mpiexec, "horovod", "horovod", {"UNIDIST_BACKEND": "horovod"}),
}
MARKS = {"local": pytest.mark.local, "mpi": pytest.mark.mpi, "torch": pytest.mark.torch,
         "deepspeed": pytest.mark.deepspeed, "horovod": pytest.mark.horovod}


