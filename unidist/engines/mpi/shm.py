"""MPICH's shared-memory files left by killed jobs, removed before MPI starts.

MPICH names a node's segments after the job (``/dev/shm/mpich_shm_<hash of the PMI job id>_<n>``) and unlinks
them at MPI_Finalize; a job killed instead (scancel, a preemption, a time limit, a crash) leaves them. A job that
gets the same id again finds them: a Slurm job requeued after a preemption restarts as the same job and step
(``SLURM_JOB_ID``.0), and its MPI_Init then read the old job's bytes and failed ("Message truncated ... 8 bytes
received but buffer size is 4096", measured with the mpich wheel under ``srun --mpi=pmi2``). Removed here: such
files older than this process that no process maps. A file a running job uses is mapped by its ranks; one a job
starting now creates is newer than this process, since every rank of a job step is started before any of them
reaches MPI_Init (Python's imports alone take longer).
"""

from __future__ import annotations

import os
import time
from pathlib import Path

SHM = Path("/dev/shm")  # noqa: S108 - where MPICH puts them; only its own names are removed
PREFIXES = ("mpich_shm_", "mpich_vci_")


def _started() -> float:
    """This process's start, in seconds since the epoch (Linux: from /proc; else now, which removes nothing new)."""
    try:
        ticks = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19])
        boot = next(float(line.split()[1]) for line in Path("/proc/stat").read_text().splitlines()
                    if line.startswith("btime "))
        return boot + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError, StopIteration):
        return time.time()


def _mapped() -> set[str]:
    found: set[str] = set()
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                found.update(line.split(maxsplit=5)[5].strip() for line in (proc / "maps").read_text().splitlines()
                             if "/mpich_" in line and len(line.split(maxsplit=5)) == 6)
            except OSError:
                continue
    return found


def remove_stale(shm: Path = SHM) -> list[str]:
    """Remove MPICH's segments that a killed job left; returns their names (for the tests)."""
    try:
        candidates = [p for p in shm.iterdir() if p.name.startswith(PREFIXES)]
    except OSError:
        return []
    if not candidates:
        return []
    started = _started() - 1.0  # clock ticks and mtime granularity
    old = [p for p in candidates if _mtime(p) < started]
    if not old:
        return []
    mapped = _mapped()
    removed = []
    for path in old:
        if str(path) not in mapped and f"{path} (deleted)" not in mapped:
            try:
                path.unlink()
                removed.append(path.name)
            except OSError:  # another user's, or gone already
                pass
    return removed


def _mtime(path: Path) -> float:
    try:
        return path.stat().st_mtime
    except OSError:
        return float("inf")
