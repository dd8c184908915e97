"""Saying which commit a rerun resumes from, also when the launcher kills every rank before it can speak.

mpiexec (hydra) ends a job whose rank died by SIGKILL to every other rank: no survivor runs a line of Python, so
none can print ``HorovodInternalError`` or name the last commit (horovodrun and the deepspeed launcher stop the
others too). So rank 0 starts a small watcher, this file run as a script (``python -I -S``, the standard library
only: ~15 ms, no torch), in a session of its own, which the launcher's kill does not reach. It holds the read
end of a pipe whose write end only rank 0 holds, and waits. Rank 0 writes ``done`` when the training function
returned, or ``said`` when it printed the failure itself; any other end of rank 0 (killed, aborted, ``os._exit``)
closes the pipe unsaid, and the watcher prints one line: the job, its last commit as ``latest.json`` in the
commit directory records it, and how to resume. It also watches its parent's pid, in case a forked child (a
DataLoader worker) keeps the pipe open.

``latest.json`` (written by store.py after each commit, atomically) is also what ``describe`` reads for rank 0's
own messages, so the watcher and the ranks say the same thing.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["LATEST", "Sentinel", "describe", "read_latest"]

LATEST = "latest.json"  # the newest commit of a job directory: {"commit", "seq", "size", "launcher", "time", "shown"}
_POLL = 0.5  # seconds between looks at the parent's pid while the pipe stays open


def read_latest(directory: Path) -> dict[str, Any] | None:
    """The job's newest commit as recorded (None: none recorded, or the commit it names is gone)."""
    try:
        latest = json.loads((directory / LATEST).read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(latest, dict) or not (directory / str(latest.get("commit", "")) / "manifest.json").is_file():
        return None
    return latest


def _shown(latest: dict[str, Any]) -> str:
    shown = latest.get("shown") or {}
    return " (" + ", ".join(f"{k} {v}" for k, v in shown.items()) + ")" if shown else ""


def describe(directory: Path, hint: str = "", now: float | None = None) -> str:
    """``the last commit is DIR/commit-000000007 (epoch 2, batch 0), written 4 s ago by 2 ranks: <hint>``, or that
    none was written yet (then no hint: there is nothing to resume)."""
    latest = read_latest(directory)
    if latest is None:
        return f"no commit was written yet ({directory}): a rerun starts from the beginning"
    age = (time.time() if now is None else now) - float(latest.get("time", 0.0))
    return (f"the last commit is {directory / str(latest['commit'])}{_shown(latest)}, written {_age(age)} ago by "
            f"{latest.get('size', '?')} rank(s)" + (f": {hint}" if hint else ""))


def _age(seconds: float) -> str:
    seconds = max(0.0, seconds)
    for unit, size in (("d", 86400.0), ("h", 3600.0), ("min", 60.0)):
        if seconds >= 2 * size:
            return f"{seconds / size:.0f} {unit}"
    return f"{seconds:.0f} s"


class Sentinel:
    """Rank 0's end of the watcher: start it, then tell it how the training function ended.

    Args:
        directory: the job's commit directory (where ``latest.json`` is).
        job: the job's name, as messages show it.
        hint: what to do to resume (said after the commit), e.g. "run the same command again".
    """

    def __init__(self, directory: Path, job: str, hint: str) -> None:
        self._fd: int | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        read, write = os.pipe()
        try:
            argv = [sys.executable, "-I", "-S", str(Path(__file__).resolve()), str(read), str(os.getpid()),
                    str(directory), job, hint]
            self._proc = subprocess.Popen(argv, pass_fds=(read,), stdin=subprocess.DEVNULL, start_new_session=True)
        except OSError:  # no interpreter to start (embedded Python): rank 0's own messages still speak
            os.close(write)
        else:
            self._fd = write
        finally:
            os.close(read)

    @property
    def watching(self) -> bool:
        """Whether the watcher started."""
        return self._fd is not None

    def settle(self, word: str) -> None:
        """``done`` (the function returned) or ``said`` (rank 0 printed the failure): the watcher ends quietly."""
        if self._fd is None:
            return
        try:
            os.write(self._fd, word.encode())
        except OSError:
            pass
        finally:
            os.close(self._fd)
            self._fd = None
        if self._proc is not None:  # it ends at once: reap it (no zombie, no ResourceWarning)
            try:
                self._proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                self._proc.kill()
            self._proc = None


def _wait(fd: int, parent: int) -> str:
    """What rank 0 wrote before its end of the pipe closed or it died ('' when nothing)."""
    said = b""
    while True:
        ready, _, _ = select.select([fd], [], [], _POLL)
        if ready:
            chunk = os.read(fd, 64)
            said += chunk
            if not chunk or said in (b"done", b"said"):  # a word is one write: forked children may keep the pipe open
                return said.decode(errors="replace")
        elif os.getppid() != parent:  # rank 0 is gone though a forked child still holds the pipe
            return said.decode(errors="replace")


def main(argv: list[str]) -> int:
    fd, parent, directory, job, hint = int(argv[0]), int(argv[1]), Path(argv[2]), argv[3], argv[4]
    if _wait(fd, parent) in ("done", "said"):
        return 0
    time.sleep(0.1)  # a commit rank 0 was renaming into place as it died is complete or gone by now
    print(f"hvd.elastic: job {job!r} ended before its training function returned (rank 0's process is gone: a lost "
          f"rank or the launcher ended it); {describe(directory, hint)}", file=sys.stderr, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
