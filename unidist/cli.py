"""``unidist info``: the report to paste into a bug. ``unidist launch``: run a script under a real launcher, on
this host or on several (``--hosts``, ``--hostfile``, a Slurm allocation). ``unidist bench <benchmark>``:
``python -m unidist.bench <benchmark>`` under the launcher ``launch`` picks.

None of them imports an engine: versions come from package metadata, so ``info`` never starts MPI.
``info --check`` does import them, in a child process under a time limit (``unidist.doctor``).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import platform
import re
import shlex
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import unidist
from unidist import registry, verify
from unidist.bench import OFFLINE as BENCH_OFFLINE
from unidist.bench import SUBCOMMANDS as BENCHMARKS
from unidist.bench.timeline import add_arguments as timeline_arguments
from unidist.bench.timeline import main as timeline_main
from unidist.config import ENV_VARS, Config
from unidist.errors import HostsError, UnidistError
from unidist.hosts import Host, format_hosts, hostfile_text, parse_hosts, read_hostfile, slurm_hosts
from unidist.launch import LAUNCHERS, Command, detect, family, find_program, programs, script_args
from unidist.net import free_port

__all__ = ["Plan", "hosts_plan", "launch_command", "main"]


def _packages() -> list[str]:
    """numpy, the distributions the backends' records name for the report (the MPI wheel), and every package a
    registered backend requires."""
    records = registry.records()
    return list(dict.fromkeys(["numpy", *(d for rec in records for d in rec.distributions),
                               *(pkg for rec in records for pkg in rec.requires)]))


_EXTRA_VARS = ("MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "LOCAL_WORLD_SIZE", "GROUP_RANK",
               "CUDA_VISIBLE_DEVICES", "SLURM_JOB_ID", "SLURM_STEP_ID")


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def info(environ: Mapping[str, str]) -> dict[str, Any]:
    """Everything ``unidist info`` reports, as data (the CLI prints it, tests read it as JSON)."""
    from unidist.selector import backend_for, select

    report: dict[str, Any] = {
        "unidist": unidist.__version__,
        "python": f"{platform.python_version()} ({sys.executable})",
        "platform": platform.platform(),
        "packages": {pkg: _version(pkg) for pkg in _packages()},
        "programs": {p: find_program(p) or "not found" for p in programs()},
    }
    names = sorted({n for fam in LAUNCHERS for n in (fam.rank, *fam.size, fam.local_rank, fam.local_size,
                                                      fam.node_rank, *fam.marker) if n} | set(_EXTRA_VARS))
    report["backends"] = {}  # filled below: a plugin UNIDIST_BACKEND names is registered when looked up
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
    report["backends"].update({rec.name: "usable" if not rec.missing() else f"needs {', '.join(rec.missing())}"
                               for rec in registry.records()})
    return report


def _print_info(report: dict[str, Any], checked: list[str] | None = None) -> None:
    """``unidist info``'s text; with ``checked`` (``--check``'s lines) those replace what they tell better (the
    packages, launchers and backends, each said once), and the launch and settings follow."""
    if checked is not None:
        print(f"unidist {report['unidist']}   platform {report['platform']}")
        print("\n".join(checked))
    else:
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
    record = registry.first_launchable(find_program)
    if record is not None:
        return record.name
    raise UnidistError("no launcher program (mpiexec, torchrun, ...) is installed; pass --backend, or run the "
                       "script with python")


# what a launcher started over ssh is given (real ssh carries no environment; mpiexec and horovodrun carry
# their own): unidist's settings, thread and import-path variables, and the engines' own (their records'
# env_prefixes: interface, debug, accelerator)
_FORWARD = ("UNIDIST_", "OMP_", "MKL_", "CUDA_VISIBLE_DEVICES", "PYTHONPATH")


def _forwarded() -> tuple[str, ...]:
    """The prefixes of the variables carried over ssh: ``_FORWARD`` and every registered backend's."""
    return tuple(dict.fromkeys([*_FORWARD, *(p for rec in registry.records() for p in rec.env_prefixes)]))


# the {hostfile} of a launcher started per host: the file _remote writes on that host (no argument given on a
# command line can equal this word: it holds a NUL)
_REMOTE_HOSTFILE = "\0hostfile"


@dataclass
class Plan:
    """The processes ``unidist launch`` starts here for a job on several hosts: one launcher command, or one
    ssh per host (``Command.per_host``); ``env``: the variables the launch needs (a backend its launcher does
    not imply)."""

    commands: list[list[str]]
    env: dict[str, str] = field(default_factory=dict)
    stdin: bool = False  # ssh sessions, ended by closing their input (see _remote)

    def lines(self) -> list[str]:
        """The commands as shell lines (what --dry-run prints), each with the variables it needs."""
        prefix = [f"{k}={v}" for k, v in self.env.items()] if len(self.commands) == 1 else []
        return [shlex.join([*prefix, *cmd]) for cmd in self.commands]


def hosts_plan(backend: str, hosts: list[Host], script: str, args: Sequence[str], environ: Mapping[str, str],
               *, slurm: bool = False, nprocs: int | None = None, cwd: str | None = None) -> Plan:
    """The commands that start ``script`` on ``hosts`` with ``backend``'s launcher's multi-host form (its
    ``LAUNCHERS`` row), or with srun when ``slurm`` (the hosts are the allocation's). Writes the hostfile a
    launcher reads (``Plan.hostfile``)."""
    try:
        record = registry.get(backend)
    except UnidistError:
        raise HostsError(f"`unidist launch` knows no backend {backend!r}; use one of "
                         f"{', '.join(registry.names())}") from None
    several = [r.name for r in registry.records() if r.launcher and (f := family(r.launcher)) is not None
               and f.command is not None and f.command.hosts_args is not None]
    name = "slurm" if slurm else record.launcher
    fam = family(name) if name else None
    if fam is None or fam.command is None or fam.command.hosts_args is None:
        launcher = record.launcher or "plain python"
        raise HostsError(f"the {backend} backend's launcher ({launcher}) cannot start processes on several hosts; "
                         f"use --backend {' or '.join(several)}, or drop --hosts/--hostfile to run here")
    total = sum(h.slots for h in hosts)
    n = total if nprocs is None else nprocs
    if n != total and not slurm:
        raise HostsError(f"-n {n} but the hosts have {total} slots ({format_hosts(hosts)}); leave out -n, or give "
                         "each host the number of processes to start on it")
    cmd = fam.command
    env = {} if registry.for_launcher(fam.name) == backend else {"UNIDIST_BACKEND": backend}
    program = _need(*cmd.programs, hint="inside a Slurm allocation unidist launch starts srun; or pass --hosts" if slurm
                   else record.install)
    template = " ".join(cmd.hosts_args or ())
    ssh = _need("ssh", hint="the launcher starts the far processes over ssh") \
        if cmd.per_host or "{ssh}" in template else ""
    values = {"n": str(n), "python": sys.executable, "hosts": format_hosts(hosts), "first": hosts[0].name,
              "nnodes": str(len(hosts)), "ssh": ssh, "port": str(free_port()) if "{port}" in template else "",
              "run_id": f"unidist-{os.getpid()}-{time.time_ns() % 10**9}",
              "mpi": "--mpi=" + (environ.get("SLURM_MPI_TYPE") or ("pmi2" if record.needs_pmi else "none"))}
    plan = Plan([], env)
    rest = [script, *args]
    if not cmd.per_host:
        plan.commands.append(cmd.hosts_argv(program, values, rest))
        return plan
    where = cwd or os.getcwd()
    carry = {k: v for k, v in environ.items() if k.startswith((*_forwarded(), *cmd.exports))}
    carry |= _env_file(cmd, environ, where) | env
    setvars = ["env", *(f"{k}={v}" for k, v in sorted(carry.items()))] if carry else []
    hostfile = hostfile_text(hosts, cmd.hostfile) if cmd.hostfile else None
    for rank, host in enumerate(hosts):
        here = {**values, "slots": str(host.slots), "node_rank": str(rank), "hostfile": _REMOTE_HOSTFILE}
        plan.commands.append([ssh, host.name, _remote(where, [*setvars, *cmd.hosts_argv(program, here, rest)],
                                                      hostfile)])
    plan.stdin = True
    return plan


def _env_file(cmd: Command, environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The variables of the launcher's own environment file (``Command.env_file``: DeepSpeed's ``.deepspeed_env``,
    or the name DS_ENV_FILE gives), read where its runner reads it: the home directory, then ``cwd`` (which wins).
    Its runner exports them to every node; started per host, the launcher would not read it on the far hosts (and
    ``--no_ssh`` reads it nowhere), so unidist carries them. A line it cannot pass on is a HostsError before
    anything starts."""
    if cmd.env_file is None:
        return {}
    variable, default = cmd.env_file
    name = environ.get(variable, default)
    found: dict[str, str] = {}
    for folder in (environ.get("HOME") or str(Path.home()), cwd):
        path = Path(folder) / name
        if name and path.is_file():
            found |= _read_env_file(path)
    return found


def _read_env_file(path: Path) -> dict[str, str]:
    """``NAME=value`` lines (blank lines and ``#`` comments skipped), values as written: DeepSpeed's pdsh runner
    hands them to a remote shell, which expands ``$VAR``; over ssh they are passed as they are, so a value that
    needs a shell is refused rather than passed on unexpanded."""
    out: dict[str, str] = {}
    for number, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        key, sep, value = (part.strip() for part in line.partition("="))
        where = f"{path} line {number} ({line!r})"
        if not sep or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", key):
            raise HostsError(f"{where}: not a NAME=value line; write one variable per line, e.g. NCCL_DEBUG=INFO")
        if re.search(r"[$`\\]", value):
            raise HostsError(f"{where}: unidist launch passes the value as written, and only DeepSpeed's pdsh runner "
                             "has a shell expand it; write the value out in full (no $, ` or \\)")
        out[key] = value
    return out


def _remote(cwd: str, argv: list[str], hostfile: str | None = None) -> str:
    """The shell line run over ssh: ``argv`` in ``cwd``, in a process group of its own (``setsid``) that gets
    SIGTERM when ssh's input closes (the launcher ended the job, or died): the launcher stops its workers itself
    (torchrun starts them in sessions of their own, which a killed ssh session would leave running), and a
    launcher that does not forward SIGTERM (DeepSpeed's runner leaves its per-node launcher and ranks running)
    has them stopped with it. With ``hostfile`` (its text) the line first writes it to a new file in the host's
    temporary directory, which ``argv``'s _REMOTE_HOSTFILE words name, and removes it on exit."""
    words = " ".join('"$hostfile"' if word == _REMOTE_HOSTFILE else shlex.quote(word) for word in argv)
    setup = ""
    if hostfile is not None:
        lines = shlex.join(hostfile.splitlines())
        setup = (f"hostfile=$(mktemp) || exit 1; trap 'rm -f \"$hostfile\"' EXIT; "
                 f"printf '%s\\n' {lines} > \"$hostfile\" || exit 1; ")
    # (sh gives a background list /dev/null as input: the watcher reads ssh's input through fd 3)
    return (f"cd {shlex.quote(cwd)} || exit 1; {setup}exec 3<&0; setsid -w {words} 3<&- & pid=$!; "
            "{ cat <&3 >/dev/null; kill -TERM -$pid || kill -TERM $pid; } >/dev/null 2>&1 & wait $pid")


def _run_all(commands: list[list[str]], env: Mapping[str, str], stdin: bool = False) -> int:
    """Start every command; the first to fail ends the others and its exit code is the job's; 0 when all
    succeed. With ``stdin`` the commands are ssh sessions (``_remote``) ended by closing their input (SIGTERM
    after 20 s); otherwise by SIGTERM."""
    procs = [subprocess.Popen(cmd, env=env, stdin=subprocess.PIPE if stdin else None) for cmd in commands]
    running = list(procs)
    code = 0
    try:
        while running:
            for proc in list(running):
                if proc.poll() is None:
                    continue
                running.remove(proc)
                if proc.returncode:
                    code = proc.returncode
                    break
            if code:
                break
            time.sleep(0.05)
    except KeyboardInterrupt:  # the terminal sent SIGINT to the launchers too: give them time to end
        code = -2
    for proc in procs:
        if proc.stdin:
            proc.stdin.close()
        elif proc.poll() is None and code != -2:
            proc.terminate()
    interrupted = code == -2
    for proc in running:
        try:
            rc = proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            proc.terminate()
            try:
                rc = proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                rc = proc.wait()
        if interrupted and rc and code == -2:  # interrupted: the launcher's own code, as it reported it
            code = rc
    return code if code >= 0 else 128 - code


def _hosts(ns: argparse.Namespace, environ: Mapping[str, str]) -> tuple[list[Host] | None, bool]:
    """The hosts the options name, else the Slurm allocation's (second item True), else None: this host."""
    if ns.hosts and ns.hostfile:
        raise HostsError("--hosts and --hostfile both given; name the hosts one way")
    if ns.hosts:
        return parse_hosts(ns.hosts), False
    if ns.hostfile:
        return read_hostfile(ns.hostfile), False
    found = slurm_hosts(environ)
    return found, found is not None


def _add_launch_options(p: argparse.ArgumentParser, n_default: int | None) -> None:
    p.add_argument("-n", "--nprocs", type=int, default=n_default,
                   help="number of processes (with hosts: their total slots, the default)")
    p.add_argument("--backend", help=f"{', '.join(registry.names())} (default: the first of these whose "
                                     "launcher is installed)")
    p.add_argument("--hosts", help="start on these hosts, e.g. h1:2,h2:2 (host:processes)")
    p.add_argument("--hostfile", help="start on the hosts of this file (host:n, host slots=n, or host; # comments)")
    p.add_argument("--dry-run", action="store_true", help="print the command(s) instead of running them")


def _checkpoint_arguments(parser: argparse.ArgumentParser) -> None:
    """``unidist checkpoint``'s subcommands (run by unidist.checkpoint.tool, imported only then: it needs torch)."""
    sub = parser.add_subparsers(dest="action", required=True)
    p_inspect = sub.add_parser("inspect", help="format, writer, world size, stage, tensors and sizes, and every "
                                               "check that needs no model (exit 1 if one fails)")
    p_inspect.add_argument("checkpoint", help="a checkpoint directory (one with manifest.json)")
    p_inspect.add_argument("--tensors", action="store_true", help="list every model tensor with its digest")
    p_inspect.add_argument("--part", type=int, help="with several data-parallel parts: which one")
    p_export = sub.add_parser("export", help="the model's full state dict, under the model's own names, to one "
                                             ".safetensors or .pt file")
    p_export.add_argument("checkpoint", help="a checkpoint directory (one with manifest.json)")
    p_export.add_argument("out", help="the file to write: NAME.safetensors or NAME.pt")
    p_export.add_argument("--part", type=int, help="with several data-parallel parts: which one")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="unidist", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    p_info = sub.add_parser("info", help="versions, launcher variables and the backend init() would pick")
    p_info.add_argument("--json", action="store_true", help="machine-readable output")
    p_info.add_argument("--check", action="store_true",
                        help="import every engine and ask every launcher: what is usable here, and how to install "
                             "the rest (exit 0: the backend that runs here works; 1: only another one; 3: none)")
    p_launch = sub.add_parser("launch", help="run a script on N processes under a real launcher, on this host "
                                             "or on several (--hosts, --hostfile, a Slurm allocation)")
    _add_launch_options(p_launch, None)
    p_launch.add_argument("script", help="the Python script to run")
    p_launch.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p_bench = sub.add_parser("bench", help="python -m unidist.bench <benchmark> on N processes under a real "
                                           "launcher (plot and report run here)")
    p_bench.add_argument("benchmark", choices=BENCHMARKS, help="collectives, gradsync, train, all, ...")
    _add_launch_options(p_bench, None)
    p_bench.epilog = "Options for the benchmark go after --: unidist bench collectives -n 2 -- --compare --sizes 8,2M"
    p_timeline = sub.add_parser("timeline", help="read a trace UNIDIST_TIMELINE wrote: summarize (and --plot) "
                                                 "it, or merge the per-rank parts a failed job left")
    timeline_arguments(p_timeline)
    p_verify = sub.add_parser("verify", help="run a script under every usable launcher (or --launch ...) and check "
                                             "that each trains as one process does, step by step")
    verify.add_arguments(p_verify)
    p_checkpoint = sub.add_parser("checkpoint", help="inspect a checkpoint, or export its model to one "
                                                     ".safetensors or .pt file")
    _checkpoint_arguments(p_checkpoint)
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
    if ns.command == "timeline":
        return timeline_main(ns)
    if ns.command == "verify":
        return verify.main(ns, launch_command)
    if ns.command == "checkpoint":
        from unidist.checkpoint import tool

        return tool.main(ns)
    if ns.command == "info":
        report = info(os.environ)
        code = 0
        if ns.check:
            from unidist import doctor

            report["check"] = doctor.check(os.environ)
            code = report["check"]["exit_code"]
        if ns.json:
            print(json.dumps(report, indent=2))
        elif ns.check:
            from unidist.doctor import render

            _print_info(report, render.lines(report["check"]))
        else:
            _print_info(report)
        return code

    try:
        hosts, slurm = _hosts(ns, os.environ)
        if hosts is None and ns.nprocs is None and ns.command == "bench":
            ns.nprocs = 2
        if (ns.nprocs is not None and ns.nprocs < 1) or (hosts is None and ns.nprocs is None):
            parser.error("-n must be at least 1" if ns.nprocs is not None else "-n is required without --hosts, "
                         "--hostfile or a Slurm allocation")
        backend = (ns.backend or _default_backend()).lower()
        if hosts is None:
            plan = Plan([launch_command(backend, ns.nprocs, ns.script, ns.args)])
        else:
            plan = hosts_plan(backend, hosts, ns.script, ns.args, os.environ, slurm=slurm, nprocs=ns.nprocs)
    except UnidistError as err:
        print(f"unidist {ns.command}: {err}", file=sys.stderr)
        return 2
    if ns.dry_run:
        print("\n".join(plan.lines()))
        return 0
    env = dict(os.environ)
    if ns.backend:
        env["UNIDIST_BACKEND"] = backend
    env.update(plan.env)
    return _run_all(plan.commands, env, plan.stdin)


if __name__ == "__main__":
    sys.exit(main())
