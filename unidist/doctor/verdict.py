"""The verdict of ``unidist info --check``: for every registered backend, usable here or what stops it and the
command that fixes it; which backend would run; the exit code. Pure functions of the answers
``unidist.doctor.ask`` gathered, so the tests can hand them any situation.

A backend is usable when every package its record requires imported in the probe child and passed the
package's own check below, and its launcher program (its family's row in ``unidist.launch``) is found,
answers, belongs to this Python, and for MPI comes from the MPI that mpi4py loaded (an mpiexec of another
MPI starts every rank as a world of one). The fixes are the records' install hints, the README's commands.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Mapping
from typing import Any

from unidist import registry
from unidist.config import Config
from unidist.errors import UnidistError
from unidist.launch import detect, family
from unidist.net import IFACE_VARS, Interface

__all__ = ["EXIT_ANOTHER", "EXIT_LOCAL_ONLY", "EXIT_USABLE", "backend_verdict", "exit_code", "iface_variables",
           "mpi_family", "mpi_version", "would_run"]

EXIT_USABLE, EXIT_ANOTHER, EXIT_LOCAL_ONLY = 0, 1, 3
"""The exit codes: the backend that would run here is usable; it is not but another multi-process backend is;
none is (at most the one-process local backend)."""


def mpi_family(text: str) -> str | None:
    """The MPI implementation a version text names (mpiexec's ``--version``, ``MPI.Get_library_version()``);
    MVAPICH and Intel MPI count as MPICH's (they share its ABI and its Hydra launcher)."""
    low = text.lower()
    if "open mpi" in low or "openrte" in low or "open-mpi" in low:
        return "Open MPI"
    if any(word in low for word in ("mpich", "hydra", "mvapich", "intel(r) mpi")):
        return "MPICH"
    return None


def mpi_version(text: str) -> str | None:
    found = re.search(r"(?:Version:?|Open MPI\)?|Library)\s+v?(\d+(?:\.\d+)+)", text)
    return found.group(1) if found else None


def _torch(answer: Mapping[str, Any]) -> list[str]:
    if not answer.get("distributed"):
        return ["torch was built without torch.distributed; install a build that has it (pip install torch)"]
    return [] if answer.get("backends") else ["torch.distributed has no process-group backend (gloo, nccl)"]


def _horovod(answer: Mapping[str, Any]) -> list[str]:
    problems = []
    if "torch" not in answer.get("frameworks", ()):
        problems.append("Horovod was built without its PyTorch extension")
    if not answer.get("controllers"):
        problems.append("Horovod was built with neither its gloo nor its MPI controller")
    return problems


def _deepspeed(answer: Mapping[str, Any]) -> list[str]:
    return [] if answer.get("accelerator") else ["DeepSpeed found no accelerator (set DS_ACCELERATOR=cpu on CPU)"]


_CHECKS: dict[str, Callable[[Mapping[str, Any]], list[str]]] = {
    "torch": _torch, "horovod": _horovod, "deepspeed": _deepspeed,
}


def _launcher_problems(record: registry.Backend, packages: Mapping[str, Any], programs: Mapping[str, Any],
                       is_this_python: Callable[[str], bool], install_said: bool) -> tuple[list[str], list[str]]:
    fam = family(record.launcher) if record.launcher else None
    if fam is None or fam.command is None:
        return [], []
    names = fam.command.programs
    found = [programs[n] for n in names if programs.get(n, {}).get("found")]
    if not found:
        fix = "the install above brings it" if install_said else record.install  # its fix said once
        return [f"no {' or '.join(names)} beside this Python or on PATH; {fix}"], []
    prog = found[0]
    if not prog.get("answered"):
        return [f"{prog['path']} does not answer: {prog.get('error')}"], []
    if prog.get("python") and not is_this_python(prog["python"]):
        return [f"{prog['path']} runs {prog['python']}, not this Python ({sys.executable}); install the engine "
                f"here ({record.install}) or put this environment's bin first on PATH"], []
    mpi = packages.get("mpi4py", {})
    if not fam.mpi_like or "mpi4py" not in record.requires or not mpi.get("ok"):  # only an engine on mpi4py's MPI
        return [], []
    theirs, ours = mpi_family(prog.get("output", "")), mpi_family(mpi.get("library_version", ""))
    if theirs and ours and theirs != ours:
        return [f"{prog['path']} is {theirs}'s, but mpi4py loaded {ours} ({mpi.get('library')}): every rank would "
                f"start alone; use the mpiexec of mpi4py's MPI (first on PATH), or rebuild mpi4py against {theirs}"], []
    v1, v2 = mpi_version(prog.get("output", "")), mpi_version(mpi.get("library_version", ""))
    if v1 and v2 and v1 != v2:
        return [], [f"{prog['path']} is version {v1}, mpi4py's library {v2}"]
    return [], []


def backend_verdict(record: registry.Backend, packages: Mapping[str, Any], programs: Mapping[str, Any],
                    is_this_python: Callable[[str], bool]) -> dict[str, Any]:
    """``{"usable": bool, "problems": [...], "notes": [...]}`` for one backend; each problem says its fix."""
    problems: list[str] = []
    for pkg in record.requires:
        answer = packages.get(pkg, {"ok": False, "absent": False, "error": "not probed"})
        if answer.get("absent"):
            problems.append(f"needs {pkg}: {record.install}")
        elif not answer.get("ok"):
            problems.append(f"{pkg} fails to import: {answer.get('error')}")
        else:
            problems += _CHECKS[pkg](answer) if pkg in _CHECKS else []
    said = any(record.install and record.install in p for p in problems)
    launch_problems, notes = _launcher_problems(record, packages, programs, is_this_python, said)
    problems += launch_problems
    return {"usable": not problems, "problems": problems, "notes": notes}


def would_run(environ: Mapping[str, str]) -> str | None:
    """The backend that runs here: UNIDIST_BACKEND's, or the launcher's we are under, else the one ``unidist
    launch`` picks (the first whose launcher program is installed); None when there is none."""
    from unidist.selector import backend_for

    try:
        config, launch = Config.from_env(environ), detect(environ)
        if config.backend is not None or launch.launched:
            return backend_for(config, launch)
    except UnidistError:
        return None
    record = registry.first_launchable()
    return record.name if record is not None else None


def exit_code(verdicts: Mapping[str, Mapping[str, Any]], chosen: str | None) -> int:
    """0: ``chosen`` is usable; 1: another backend with a launcher is; 3: none is, the local one at most."""
    if chosen is not None and verdicts.get(chosen, {}).get("usable"):
        return EXIT_USABLE
    several = [name for name, v in verdicts.items() if v["usable"] and registry.get(name).launcher is not None]
    return EXIT_ANOTHER if several else EXIT_LOCAL_ONLY


def iface_variables(environ: Mapping[str, str], ifaces: list[Interface]) -> dict[str, dict[str, Any]]:
    """What each engine's interface variable (``unidist.net.IFACE_VARS``) says, and a note where it names no
    interface of this host or only loopback (fine on one host; a several-host job cannot connect)."""
    names = {i.name for i in ifaces}
    loops = {i.name for i in ifaces if i.loopback}
    routed = next((i.name for i in ifaces if i.route), None)
    out: dict[str, dict[str, Any]] = {}
    for var, whose in IFACE_VARS.items():
        value = environ.get(var)
        entry: dict[str, Any] = {"value": value, "engine": whose, "note": None}
        out[var] = entry
        if not value or value == "all" or value.startswith("^"):  # unset, or the engine picks among all/the rest
            continue
        items = [v.lstrip("=") for v in value.split(",") if v]
        prefix = var == "NCCL_SOCKET_IFNAME" and not value.startswith("=")  # NCCL matches name prefixes
        devices = {v.split(":")[0] for v in items if not (var == "UCX_NET_DEVICES" and ":" in v)}  # mlx5_0:1: IB
        unknown = sorted(d for d in devices if not any(n == d or (prefix and n.startswith(d)) for n in names))
        if unknown:
            entry["note"] = f"names {', '.join(unknown)}: no such interface here"
        elif devices and devices <= loops:
            entry["note"] = ("loopback only: fine on one host; a several-host job cannot connect (unset it"
                             + (f", or set {var}={routed})" if routed else ")"))
    return out


def device_plan(environ: Mapping[str, str], gpus: int | None) -> dict[str, Any]:
    """The device ``init()`` gives each rank of this host (what ``Manager._pick_device`` decides: ``UNIDIST_DEVICE``
    or ``cuda:{local_rank % GPUs}``), and whether the host's ranks outnumber its GPUs (then the torch backend stages
    CUDA tensors through the host and the deepspeed backend refuses: engines/torch/manager.py).

    Args:
        environ: the launch's environment (its local size, UNIDIST_DEVICE).
        gpus: the GPUs torch sees (None: torch is not usable).
    """
    try:
        config, launch = Config.from_env(environ), detect(environ)
    except UnidistError as err:
        return {"error": str(err)}
    n, want, count = max(launch.local_size, 1), config.device, gpus or 0
    if want == "cpu" or (count == 0 and want != "cuda" and not want.startswith("cuda:")):
        devices = ["cpu"] * n
    elif want.startswith("cuda:"):
        devices = [want] * n
    elif count == 0:
        return {"error": "UNIDIST_DEVICE='cuda' but torch sees no CUDA device; unset it or use 'cpu'"}
    else:
        devices = [f"cuda:{r % count}" for r in range(n)]
    return {"devices": devices, "gpus": count, "shared": devices[0] != "cpu" and n > count}

