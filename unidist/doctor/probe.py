"""The child process of ``unidist info --check``: imports each engine for real, one step per package, and
answers one JSON line per step.

It runs as ``python -m unidist.doctor.probe [--block a,b] package...``. Importing an engine is the only way to
know it works (a package can be installed and still fail: a wheel built against another torch, a missing
libmpi), and an import can crash the process or hang, so it happens here and never in ``unidist info``
itself. The parent (``unidist.doctor.ask``) gives every step a time limit; a package that hung or crashed is
``--block``-ed in the next child, so the steps that would import it again fail at once instead of costing
another timeout. Engines print on import (DeepSpeed logs to stdout), so the answers go to a copy of the
original stdout and everything else to stderr.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TextIO

__all__ = ["STEPS", "main"]


class _Blocked(importlib.abc.MetaPathFinder):
    """Refuses to import the packages an earlier child hung or crashed in."""

    def __init__(self, packages: set[str]) -> None:
        self.packages = packages

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: object = None
                  ) -> importlib.machinery.ModuleSpec | None:
        top = fullname.partition(".")[0]
        if top in self.packages:
            raise ImportError(f"{top} not imported: importing it hung or crashed in an earlier step")
        return None


def _version(module: Any) -> str | None:
    return str(getattr(module, "__version__", None) or "") or None


def _mpi4py() -> dict[str, Any]:
    import mpi4py

    mpi4py.rc.initialize = False  # the library's version and file, without starting MPI
    mpi4py.rc.finalize = False
    from mpi4py import MPI

    libs = [line.split()[-1] for line in Path("/proc/self/maps").read_text().splitlines()
            if "/libmpi" in line] if Path("/proc/self/maps").exists() else []
    lib = MPI.Get_library_version().strip()
    return {"version": mpi4py.__version__, "library_version": lib,
            "mpi_standard": "{}.{}".format(*MPI.Get_version()), "config": dict(mpi4py.get_config()),
            "library": libs[0] if libs else None, "module": MPI.__file__, "cuda_aware": _cuda_aware(MPI, lib)}


def _cuda_aware(MPI: Any, lib: str) -> bool | None:
    """Whether the MPI library moves CUDA memory itself (None: cannot tell without starting MPI). MPICH aborts on
    MPIX_Query_cuda_support before MPI_Init, but names its configure options (``--with-cuda``) in its version
    string; Open MPI answers the query before MPI_Init."""
    from unidist.engines.mpi.manager import query_cuda_support

    if MPI.Is_initialized() or lib.startswith("Open MPI"):
        return query_cuda_support(MPI)
    if lib.startswith("MPICH"):
        return "--with-cuda" in lib
    return None


def _torch() -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    available = dist.is_available()
    backends = [name for name in ("gloo", "nccl", "mpi", "ucc", "xccl")
                if available and getattr(dist, f"is_{name}_available", lambda: False)()]
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    out: dict[str, Any] = {"version": torch.__version__, "distributed": available, "backends": backends,
                           "cuda": torch.version.cuda, "gpus": gpus}
    if gpus:
        out["gpu_names"] = [torch.cuda.get_device_name(i) for i in range(gpus)]
        driver = getattr(torch._C, "_cuda_getDriverVersion", None)  # e.g. 13000: CUDA 13.0's driver API
        if driver is not None:
            version = int(driver())
            out["driver_cuda"] = f"{version // 1000}.{version % 1000 // 10}"
        if "nccl" in backends:
            out["nccl"] = ".".join(str(v) for v in torch.cuda.nccl.version())  # type: ignore[no-untyped-call]
    return out


def _horovod() -> dict[str, Any]:
    import horovod
    import horovod.torch as hvd

    root = Path(horovod.__file__).parent
    frameworks = [fw for fw in ("torch", "tensorflow", "mxnet") if any((root / fw).glob("mpi_lib*"))]
    built = {name: bool(getattr(hvd, f"{name}_built", lambda: False)())
             for name in ("mpi", "gloo", "nccl", "ddl", "ccl", "cuda", "rocm")}
    return {"version": _version(horovod), "frameworks": frameworks,
            "controllers": [c for c in ("mpi", "gloo") if built[c]],
            "ops": [o for o in ("nccl", "ddl", "ccl", "cuda", "rocm") if built[o]]}


def _deepspeed() -> dict[str, Any]:
    import deepspeed
    from deepspeed.accelerator import get_accelerator

    acc = get_accelerator()
    return {"version": _version(deepspeed), "accelerator": acc.device_name(),
            "devices": acc.device_count()}


STEPS: dict[str, Callable[[], dict[str, Any]]] = {
    "mpi4py": _mpi4py, "torch": _torch, "horovod": _horovod, "deepspeed": _deepspeed,
}
"""What each package's step reports; any other package (a plugin backend's) is imported and its version read."""


def _step(package: str) -> dict[str, Any]:
    try:
        if package in STEPS:
            return {"ok": True, **STEPS[package]()}
        return {"ok": True, "version": _version(importlib.import_module(package))}
    except ModuleNotFoundError as err:
        absent = err.name == package
        return {"ok": False, "absent": absent, "error": "not installed" if absent else f"{type(err).__name__}: {err}"}
    except BaseException as err:  # whatever the import raises (SystemExit included) is the answer
        return {"ok": False, "absent": False, "error": f"{type(err).__name__}: {err}"}


def main(argv: Sequence[str]) -> int:
    args = list(argv)
    blocked: set[str] = set()
    if args[:1] == ["--block"]:
        blocked = {b for b in args[1].split(",") if b}
        args = args[2:]
    sys.meta_path.insert(0, _Blocked(blocked))
    out: TextIO = os.fdopen(os.dup(1), "w")
    os.dup2(2, 1)  # whatever the engines print goes to stderr
    for package in args:
        print(json.dumps({"package": package, **_step(package)}, default=str), file=out, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
