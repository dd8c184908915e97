"""``unidist info``: the report to paste into a bug. ``unidist launch``: run a script under a real launcher.
``unidist bench <benchmark>``: ``python -m unidist.bench <benchmark>`` under the launcher ``launch`` picks.

None of them imports an engine: versions come from package metadata, so ``info`` never starts MPI.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import shutil
import subprocess
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import unidist
from unidist import registry
from unidist.bench import OFFLINE as BENCH_OFFLINE
from unidist.bench import SUBCOMMANDS as BENCHMARKS
from unidist.config import ENV_VARS, Config
from unidist.errors import UnidistError
from unidist.launch import LAUNCHERS, detect, family, script_args
from unidist.net import free_port

__all__ = ["launch_command", "main"]


def _packages() -> list[str]:
    """numpy, the MPI wheel, and every package a registered backend requires."""
    names = ["numpy", "mpich"]
    for record in registry.records():
        names += [pkg for pkg in record.requires if pkg not in names]
    return names


def _programs() -> list[str]:
    """Every launcher program unidist knows (the launcher families' commands), and Slurm's srun."""
    names = [prog for fam in LAUNCHERS if fam.command is not None for prog in fam.command.programs]
    return [*dict.fromkeys(names), "srun"]

_EXTRA_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_ID")


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def find_program(name: str) -> str | None:
    """Prefer the program installed beside this Python (the venv's mpiexec matches its mpi4py)."""
    beside = Path(sys.executable).parent / name
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    return shutil.which(name)


def info(environ: Mapping[str, str]) -> dict[str, Any]:
    """Everything ``unidist info`` reports, as data (the CLI prints it, tests read it as JSON)."""
    from unidist.selector import backend_for, select

    report: dict[str, Any] = {
        "unidist": unidist.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {pkg: _version(pkg) for pkg in _packages()},
        "programs": {p: find_program(p) or "not found" for p in _programs()},
    }
    names = sorted({n for fam in LAUNCHERS for n in (fam.rank, *fam.size, fam.local_rank, fam.local_size,
                                                      fam.node_rank, *fam.marker) if n} | set(_EXTRA_VARS))
    report["backends"] = {rec.name: "usable" if not rec.missing() else f"needs {', '.join(rec.missing())}"
                          for rec in registry.records()}
    report["launch_variables"] = {n: environ[n] for n in names if n in environ}
    report["unidist_variables"] = {n: environ[n] for n in sorted(environ) if n.startswith("UNIDIST_")}
    try:
        config = Config.from_env(environ)
        launch = detect(environ)
        report["launch"] = dict(launch.__dict__)
        name = backend_for(config, launch)
        report["backend"] = name
        record = registry.get(name)
        if record.missing():
            select(config, launch)  # raises the install hint
        report["manager"] = record.manager_name
    except UnidistError as err:
        report["error"] = f"{type(err).__name__}: {err}"
    return report


def _print_info(report: dict[str, Any]) -> None:
    print(f"unidist {report['unidist']}   python {report['python']}")
    print(f"platform {report['platform']}")
    print("packages:")
    for pkg, ver in report["packages"].items():
        print(f"  {pkg:<10} {ver}")
    print("launchers on PATH:")
    for prog, where in report["programs"].items():
        print(f"  {prog:<10} {where}")
    print("backends (UNIDIST_BACKEND): " + ", ".join(f"{k} ({v})" for k, v in report["backends"].items()))
    launch = report.get("launch")
    if launch:
        print(f"launcher seen: {launch['launcher']}  rank {launch['rank']} of {launch['size']}, local "
              f"{launch['local_rank']} of {launch['local_size']}, node {launch['node_rank']}")
    for title in ("launch_variables", "unidist_variables"):
        if report[title]:
            print(title.replace("_", " ") + ": " + " ".join(f"{k}={v}" for k, v in report[title].items()))
    if "error" in report:
        print(f"init() would fail: {report['error']}")
    else:
        print(f"init() would pick: {report['backend']} ({report['manager']})")
    print("settings: " + ", ".join(ENV_VARS))


def launch_command(backend: str, nprocs: int, script: str, args: Sequence[str]) -> list[str]:
    """The argv that starts ``script`` on ``nprocs`` processes under ``backend``'s launcher (the launcher
    family its record in ``unidist.registry`` names)."""
    try:
        record = registry.get(backend)
    except UnidistError:
        raise UnidistError(f"`unidist launch` knows no backend {backend!r}; use one of "
                           f"{', '.join(registry.names())}") from None
    if record.launcher is None:
        if nprocs != 1:
            raise UnidistError(f"the {backend} backend runs one process; use -n 1 or another --backend")
        return [sys.executable, script, *args]
    fam = family(record.launcher)
    if fam is None or fam.command is None:
        raise UnidistError(f"the {backend} backend names launcher {record.launcher!r}, which has no command line")
    cmd = fam.command
    port = free_port() if any("{port}" in a for a in cmd.args) else None
    return cmd.argv(_need(*cmd.programs, hint=record.install), nprocs, sys.executable, port, [script, *args])


def _need(*names: str, hint: str) -> str:
    for name in names:
        found = find_program(name)
        if found:
            return found
    raise UnidistError(f"no {' or '.join(names)} found on PATH; {hint}")


def _default_backend() -> str:
    """The first backend, in the records' order of preference, whose launcher program is installed."""
    for record in registry.records():
        fam = family(record.launcher) if record.launcher else None
        if fam is not None and fam.command is not None and any(find_program(p) for p in fam.command.programs):
            return record.name
    raise UnidistError("no launcher program (mpiexec, torchrun, ...) is installed; pass --backend, or run the "
                       "script with python")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unidist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, launcher variables and the backend init() would pick")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    p_launch = sub.add_parser("launch", help="run a script on N processes under a real launcher")
    p_launch.add_argument("-n", "--nprocs", type=int, required=True, help="number of processes")
    p_launch.add_argument("--backend", help=f"{', '.join(registry.names())} (default: the first of these whose "
                                            "launcher is installed)")
    p_launch.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p_launch.add_argument("script", help="the Python script to run")
    p_launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p_bench = sub.add_parser("bench", help="python -m unidist.bench <benchmark> on N processes under a real "
                                           "launcher (plot and report run here)")
    p_bench.add_argument("benchmark", choices=BENCHMARKS, help="collectives, gradsync, train, all, ...")
    p_bench.add_argument("-n", "--nprocs", type=int, default=2)
    p_bench.add_argument("--backend", help="as for launch")
    p_bench.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p_bench.epilog = "Options for the benchmark go after --: unidist bench collectives -n 2 -- --compare --sizes 8,2M"
    argv = script_args() if argv is None else list(argv)  # without a launcher's --local_rank=N
    bench_args: list[str] = []
    if argv[:1] == ["bench"] and "--" in argv:  # the benchmark's own options (a REMAINDER would take -n too)
        cut = argv.index("--")
        argv, bench_args = argv[:cut], argv[cut + 1:]
    ns = parser.parse_args(argv)

    if ns.command == "bench":
        if ns.benchmark in BENCH_OFFLINE:
            from unidist.bench.__main__ import main as bench_main

            return bench_main([ns.benchmark, *bench_args])
        # by path, not -m: the deepspeed launcher only starts scripts
        ns.script = str(Path(unidist.__file__).resolve().parent / "bench" / "__main__.py")
        ns.args = [ns.benchmark, *bench_args]
    if ns.command == "info":
        report = info(os.environ)
        if ns.json:
            print(json.dumps(report, indent=2))
        else:
            _print_info(report)
        return 0

    if ns.nprocs < 1:
        parser.error("-n must be at least 1")
    try:
        backend = (ns.backend or _default_backend()).lower()
        cmd = launch_command(backend, ns.nprocs, ns.script, ns.args)
    except UnidistError as err:
        print(f"unidist {ns.command}: {err}", file=sys.stderr)
        return 2
    if ns.dry_run:
        print(" ".join(cmd))
        return 0
    env = dict(os.environ)
    if ns.backend:
        env["UNIDIST_BACKEND"] = backend
    proc = subprocess.Popen(cmd, env=env)
    try:
        code = proc.wait()
    except KeyboardInterrupt:
        code = proc.wait()
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main())
