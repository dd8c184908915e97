"""The launches ``unidist verify`` runs a script under, and running them.

By default: one process (the reference), then every backend with a launcher that ``unidist info --check`` finds
usable here, at 2 ranks, started as ``unidist launch`` starts it (the command each backend's record names, with
the environment its main launch needs, e.g. ``DS_ACCELERATOR=cpu`` on a CPU-only machine). ``--launch "mpiexec -n
4"`` names launches instead: a launcher command line (leading ``NAME=value`` words are its environment) that the
script and its arguments are appended to, with ``python`` before them where that launcher starts a program (as
``mpiexec``), without where it starts scripts itself (``torchrun``, ``deepspeed``, ``unidist launch --hosts ...``
on several hosts or a Slurm allocation).
"""

from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from unidist import registry
from unidist.errors import InvalidArgumentError
from unidist.launch import LAUNCHERS, find_program

__all__ = ["Launch", "Outcome", "default_launches", "parse_launch", "run"]

LaunchCommand = Callable[[str, int, str, Sequence[str]], list[str]]  # cli.launch_command


@dataclass
class Launch:
    """One way to run the script: a label, the argv, and the variables it needs beyond this environment."""

    label: str
    argv: list[str]
    env: dict[str, str] = field(default_factory=dict)

    def variant(self, label: str, **env: str) -> Launch:
        """The same launch under another label, with more variables (a rounding or locate re-run)."""
        return Launch(label, list(self.argv), {**self.env, **env})


@dataclass
class Outcome:
    """What a launch did: its exit code, the fingerprint it left (if any), its output's tail, its time."""

    launch: Launch
    returncode: int
    fingerprint: Path
    tail: str
    seconds: float


def _label(text: str) -> str:
    return re.sub(r"[^\w.-]+", "-", text).strip("-")


def default_launches(script: str, args: Sequence[str], usable: Sequence[str], launch_command: LaunchCommand,
                     gpu: bool, ranks: int = 2) -> list[Launch]:
    """One process first, then each usable backend's main launch at ``ranks`` ranks.

    Args:
        script, args: the script and its arguments.
        usable: the backends with a launcher that ``unidist info --check`` found usable, in preference order.
        launch_command: ``unidist launch``'s command builder (backend, ranks, script, args) -> argv.
        gpu: whether this machine has a GPU (a launch's CPU-only variables are dropped there).
        ranks: processes per launch.
    """
    out = [Launch("python", [sys.executable, script, *args])]
    for name in usable:
        rec = registry.get(name)
        if not rec.launches or rec.launcher is None:
            continue
        env = {k: v for k, v in rec.launches[0].environment(gpu).items() if k != "UNIDIST_BACKEND"}
        env["UNIDIST_BACKEND"] = name
        out.append(Launch(f"{name}-{ranks}", launch_command(name, ranks, script, list(args)), env))
    return out


def parse_launch(text: str, script: str, args: Sequence[str]) -> Launch:
    """A ``--launch`` value as a Launch: ``"UNIDIST_BACKEND=horovod mpiexec -n 2"``."""
    words = shlex.split(text)
    env = {}
    while words and re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*=.*", words[0]):
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    given = set(env)  # the user's variables name the launch ("PLANT=lr mpiexec -n 2": mpiexec-2-PLANT-lr)
    if not words:
        raise InvalidArgumentError(f"--launch {text!r} names no launcher program; e.g. --launch 'mpiexec -n 4'")
    program = os.path.basename(words[0])
    fam = next((f for f in LAUNCHERS if f.command is not None and program in f.command.programs), None)
    # `unidist launch ...` (several hosts, a Slurm allocation) and torchrun/deepspeed start scripts themselves
    starts_python = program != "unidist" and (fam is None or fam.command is None
                                              or any("{python}" in a for a in fam.command.args))
    if fam is not None:  # the variables this launcher's backend needs here (DeepSpeed's accelerator on a CPU)
        for rec in registry.records():
            if rec.launcher == fam.name and rec.launches:
                env = {**rec.launches[0].cpu_env, **env}
                break
    rest = [sys.executable, script, *args] if starts_python else [script, *args]
    words[0] = find_program(words[0]) or words[0]  # beside this interpreter (a venv not on PATH) or on PATH
    count = re.search(r"(?:^|\s)(?:-n|-np|--nproc_per_node|--nproc-per-node|--num_gpus|--ntasks)[ =](\d+)", text)
    label = program + (f"-{count.group(1)}" if count else "")
    if "UNIDIST_BACKEND" in env:
        label = f"{env['UNIDIST_BACKEND']}-under-{label}"
    label += "".join(f"-{k}-{v}" for k, v in env.items() if k != "UNIDIST_BACKEND" and k in given)
    return Launch(_label(label), [*words, *rest], env)


def run(launch: Launch, fingerprint: Path, environ: Mapping[str, str], timeout: float, cwd: Path | None = None
        ) -> Outcome:
    """Run one launch with ``UNIDIST_FINGERPRINT`` pointing at ``fingerprint`` (an absolute path), in ``cwd``
    (its own working directory: workdirs.py); never raises for its failure."""
    env = {**environ, **launch.env, "UNIDIST_FINGERPRINT": str(fingerprint.absolute())}
    if fingerprint.exists():
        fingerprint.unlink()
    start = time.monotonic()
    try:  # its own session, so a launcher's children go with it when it is stopped
        proc = subprocess.Popen(launch.argv, env=env, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, start_new_session=True, cwd=cwd)
    except OSError as err:
        return Outcome(launch, 127, fingerprint, f"could not start {launch.argv[0]}: {err}", 0.0)
    try:
        text, _ = proc.communicate(timeout=timeout)
        code = proc.returncode
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        text, _ = proc.communicate()
        code, text = 124, f"{text or ''}\n(stopped after {timeout:.0f} s: raise --timeout if it needs longer)"
    tail = "\n".join(str(text).splitlines()[-20:])
    return Outcome(launch, code, fingerprint, tail, time.monotonic() - start)
