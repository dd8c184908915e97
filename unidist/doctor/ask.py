"""Asking, each question under a time limit: the probe child about the packages, every launcher program
about itself (``--version`` or ``--help``: the option its ``unidist.launch`` row says it answers), this host
about its CPUs.

A hung import must not hang ``unidist info --check``: each probe step has ``limit`` seconds (of the child's
own time, see ``_Clock``) from the previous answer; a step that passes it is killed, its package is blocked
in the next child (see ``unidist.doctor.probe``) and the remaining steps go on there, so one hang costs one
limit. A crash (a segfault in an engine's library) ends the child the same way, said so with its exit status
and last words. The launcher programs are asked at the same time, in threads (each one is a process of its
own).
"""

from __future__ import annotations

import json
import os
import select
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from unidist.launch import LAUNCHERS, find_program, programs

__all__ = ["ask_packages", "ask_program", "ask_programs", "cpus", "shebang"]


class _Clock:
    """The seconds a process has had since ``restart``: wall time minus the time its main thread waited for a
    CPU (the run-queue wait of ``/proc/<pid>/schedstat``), so a limit means the same on a machine loaded by
    others as on an idle one (measured: a bare ``import torch`` takes ~10 s of wall time at load 11 on 2 cores,
    and three at once passed 20 s), while a hang (sleeping, or spinning) still runs out of it. Falls back to
    wall time where the kernel keeps no schedstat; never more than ``_WALL_CAP`` limits of wall time."""

    def __init__(self, pid: int) -> None:
        self.path = Path(f"/proc/{pid}/schedstat")
        self.restart()

    def _waited(self) -> float:
        try:
            return int(self.path.read_text().split()[1]) / 1e9
        except (OSError, ValueError, IndexError):
            return 0.0

    def restart(self) -> None:
        self.start, self.wait0 = time.monotonic(), self._waited()

    def out(self, limit: float) -> bool:
        wall = time.monotonic() - self.start
        return wall - max(0.0, self._waited() - self.wait0) > limit or wall > _WALL_CAP * limit


_WALL_CAP = 10


def _readline(fd: int, buf: bytearray, clock: _Clock, limit: float) -> bytes | None:
    """The next line from ``fd`` before ``clock`` runs past ``limit``; None when it does first, EOFError when
    the writer is gone (the child ended)."""
    clock.restart()
    while b"\n" not in buf:
        if clock.out(limit):
            return None
        if not select.select([fd], [], [], 0.2)[0]:
            continue
        chunk = os.read(fd, 65536)
        if not chunk:
            raise EOFError
        buf += chunk
    line, _, rest = bytes(buf).partition(b"\n")
    buf[:] = rest
    return line


def _tail(path: str, lines: int = 3) -> str:
    text = Path(path).read_text(errors="replace").strip().splitlines()
    return " | ".join(text[-lines:])


def ask_packages(packages: Sequence[str], environ: Mapping[str, str], limit: float = 20.0) -> dict[str, Any]:
    """Each package's answer from the probe child (``unidist.doctor.probe``), in one child while none hangs
    or crashes; a step that does gets ``{"ok": False, "error": ...}`` and its package is blocked after."""
    answers: dict[str, Any] = {}
    todo, blocked = list(packages), list[str]()
    while todo:
        with tempfile.NamedTemporaryFile(prefix="unidist-probe-", suffix=".err") as err:
            cmd = [sys.executable, "-m", "unidist.doctor.probe", "--block", ",".join(blocked), *todo]
            read, write = os.pipe()
            proc = subprocess.Popen(cmd, stdout=write, stderr=err, stdin=subprocess.DEVNULL, env=dict(environ))
            os.close(write)
            buf, clock = bytearray(), _Clock(proc.pid)
            hung = False
            try:
                while todo:
                    try:
                        line = _readline(read, buf, clock, limit)
                    except EOFError:
                        break
                    if line is None:
                        hung = True
                        break
                    try:
                        answer = json.loads(line)
                    except ValueError:  # not an answer: a library that wrote to the answers' descriptor
                        continue
                    package = answer.pop("package")
                    answers[package] = answer
                    todo.remove(package)
            finally:
                os.close(read)
                if hung:
                    proc.kill()
                code = proc.wait()
            if todo:  # the first step left unanswered hung or crashed: blocked from here on
                package = todo.pop(0)
                blocked.append(package)
                if hung:
                    error = f"importing it hung: no answer in {limit:g} s (stopped; not imported again)"
                else:
                    how = f"signal {-code}" if code < 0 else f"exit code {code}"
                    error = f"importing it crashed the process ({how}): {_tail(err.name) or 'no output'}"
                answers[package] = {"ok": False, "absent": False, "error": error}
    return answers


def shebang(path: str) -> str | None:
    """The Python a launcher script runs (its ``#!`` line, ``env`` resolved on PATH); None for a binary or a
    script of another language (Intel's mpirun is a shell script)."""
    try:
        with open(path, "rb") as f:
            first = f.readline(512)
    except OSError:
        return None
    words = first[2:].decode(errors="replace").split() if first.startswith(b"#!") else []
    if len(words) > 1 and Path(words[0]).name == "env":
        words = [shutil.which(words[1]) or words[1]]
    return words[0] if words and Path(words[0]).name.startswith("python") else None


def this_python(interpreter: str) -> bool:
    """Whether ``interpreter`` is the Python running unidist: beside it (the same venv's bin), or the same file
    when unidist runs outside a venv (every venv's python links to the base one)."""
    mine = Path(sys.executable)
    theirs = Path(interpreter)
    if theirs.parent == mine.parent or str(theirs) == str(mine):
        return True
    return sys.prefix == sys.base_prefix and theirs.resolve() == mine.resolve()


def _answers(program: str) -> str:
    return next((fam.command.answers for fam in LAUNCHERS if fam.command is not None and program in
                 fam.command.programs), "--version")


def ask_program(name: str, limit: float = 20.0) -> dict[str, Any]:
    """Where launcher ``name`` is, whether it answers its ``--version``/``--help`` within ``limit``, what it
    says first, and the Python it runs if it is a script."""
    path = find_program(name)
    if path is None:
        return {"found": False}
    answer: dict[str, Any] = {"found": True, "path": path, "python": shebang(path)}
    for option in dict.fromkeys([_answers(name), "--version", "--help"]):
        with tempfile.TemporaryFile() as out:
            try:
                proc = subprocess.Popen([path, option], stdout=out, stderr=subprocess.STDOUT,
                                        stdin=subprocess.DEVNULL)
            except OSError as err:
                answer.update(answered=False, error=f"`{name} {option}` did not start: {err}")
                return answer
            clock = _Clock(proc.pid)
            while proc.poll() is None and not clock.out(limit):
                time.sleep(0.05)
            if proc.poll() is None:
                proc.kill()
                proc.wait()
                answer.update(answered=False, error=f"`{name} {option}` gave no answer in {limit:g} s")
                return answer
            out.seek(0)
            text = out.read().decode(errors="replace").strip()
        if proc.returncode == 0 and text:
            answer.update(answered=True, option=option, output=text[:2000])
            return answer
        answer.update(answered=False, error=f"`{name} {option}` exited {proc.returncode}: "
                      f"{' | '.join(text.splitlines()[-2:]) or 'no output'}")
    return answer


def ask_programs(limit: float = 20.0) -> dict[str, Any]:
    """Every launcher program's answer (``ask_program``), asked at once."""
    names = programs()
    answers: dict[str, Any] = {}
    threads = [threading.Thread(target=lambda n=name: answers.__setitem__(n, ask_program(n, limit)), daemon=True)
               for name in names]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {name: answers[name] for name in names}


def cpus() -> dict[str, int | None]:
    """The CPUs of this host and those this process may run on (a cgroup or ``taskset`` can give fewer)."""
    usable = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
    return {"cpus": os.cpu_count(), "usable": usable}
