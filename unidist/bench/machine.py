"""The machine a benchmark ran on, recorded beside its figures: CPU, cores, memory, THP, kernel, versions, and
a measured memory bandwidth.

Why: the same command gave a fused gradient sync at 0.30 of raw per-tensor allreduce on one 2-core machine and
0.90 on another of the same kind (issue 25). Figures without the machine cannot be told apart from a
regression; with it, two result sets can be compared knowing whether the machines differ, and in what.

The bandwidth is a STREAM-style "copy" (``dst[:] = src``) of a 256 MiB buffer with ``numpy.copyto``: one
thread (numpy copies on the calling thread, so OMP_NUM_THREADS does not change it), far larger than any
cache, both buffers touched before timing so that page faults are not counted. It is reported as STREAM and
nccl-tests count a copy: 2 x bytes / time (each byte read once and written once; the write-allocate read a
CPU may add is not counted), the best of the copies that fit in about 0.3 s (STREAM reports the best too:
on a shared machine a neighbour only ever slows a copy down).

It is measured once per run, on rank 0 only. Ranks of one run share the host's memory controller, so a copy
on every rank at once would measure each rank's share of the bus under contention, not the machine; one
after the other would cost ranks x 0.3 s for the same number again. The min over ranks would only differ on
several hosts, where rank 0's host is what this records (``host`` in the run's metadata says which).
"""

from __future__ import annotations

import importlib.metadata
import os
import platform
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["COPY_BYTES", "copy_bandwidth", "line", "machine", "version", "versions"]

COPY_BYTES = 256 << 20
THP_FILE = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def version(pkg: str) -> str:
    """The installed distribution's version, or ``not installed`` (a missing engine is a fact to record)."""
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Python, unidist, numpy and every engine package the registry knows (what the figures depend on)."""
    import unidist

    out = {"python": platform.python_version(), "unidist": unidist.__version__, "numpy": version("numpy")}
    out.update({pkg: version(pkg) for record in unidist.registry.records() for pkg in record.requires})
    return out


def cpu_model() -> str:
    """``model name`` of /proc/cpuinfo (Linux); the platform's processor string elsewhere."""
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            key, sep, value = text.partition(":")
            if sep and key.strip() in ("model name", "Model", "cpu model"):
                return " ".join(value.split())
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def thp_mode(path: Path = THP_FILE) -> str:
    """The bracketed word of ``transparent_hugepage/enabled`` (always, madvise, never); ``absent`` when the
    kernel has no such file (not Linux, or THP not built in)."""
    try:
        text = path.read_text()
    except OSError:
        return "absent"
    start, end = text.find("["), text.find("]")
    return text[start + 1:end] if 0 <= start < end else text.strip() or "absent"


def _meminfo(key: str) -> int | None:
    """A /proc/meminfo entry in bytes (None where there is none)."""
    try:
        for text in Path("/proc/meminfo").read_text().splitlines():
            name, _, value = text.partition(":")
            if name == key:
                return int(value.split()[0]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def memory_bytes() -> int | None:
    """Total physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return _meminfo("MemTotal")


def usable_cpus() -> int | None:
    """The CPUs this process may run on (a launcher's or container's pinning shows here, not in cpu_count)."""
    getaffinity = getattr(os, "sched_getaffinity", None)
    return len(getaffinity(0)) if getaffinity is not None else os.cpu_count()


def _anon_huge() -> int | None:
    """Bytes of this process's anonymous memory in transparent huge pages (/proc/self/smaps_rollup)."""
    try:
        for text in Path("/proc/self/smaps_rollup").read_text().splitlines():
            if text.startswith("AnonHugePages:"):
                return int(text.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def copy_bandwidth(nbytes: int = COPY_BYTES, seconds: float = 0.3) -> dict[str, Any]:
    """STREAM "copy" in GB/s (2 x bytes / time, best of the copies that fit in ``seconds``, at least two) and
    how it was taken; also ``first_touch_GBps``, bytes per second of filling fresh memory, which is mostly
    page faults: what a fresh gradient buffer costs each step (issue 25), and what makes this measurement
    take seconds, not 0.3 s, on a VM whose host backs guest memory on first touch (2 s per 256 MiB seen). The
    buffer shrinks to a quarter of the available memory if that is less (a full machine must not start
    swapping to describe itself). ``copy_huge_share`` is the part of the two buffers the kernel backed with
    transparent huge pages (recorded, not assumed: whether a copy gets them depends on the memory's
    fragmentation at the time). On the shared 2-core VM this was written on, the figure ranged from 8 to
    23 GB/s between runs minutes apart, with and without huge pages: one run's figure says what that run
    had, not what the machine always gives."""
    import numpy as np

    available = _meminfo("MemAvailable")
    if available is not None:
        while nbytes > (16 << 20) and 4 * nbytes > available:
            nbytes //= 2
    huge_before = _anon_huge()
    start = time.perf_counter()
    src = np.ones(nbytes, dtype=np.uint8)  # fresh pages: the time is mostly the kernel's page faults
    touch = time.perf_counter() - start
    dst = np.empty_like(src)
    np.copyto(dst, src)  # touches dst: its page faults are not part of the copy figure
    huge_after = _anon_huge()
    huge = (None if huge_before is None or huge_after is None
            else max(0.0, min(1.0, (huge_after - huge_before) / (2 * nbytes))))
    best, copies, deadline = float("inf"), 0, time.perf_counter() + seconds
    while copies < 2 or time.perf_counter() < deadline:
        start = time.perf_counter()
        np.copyto(dst, src)
        best = min(best, time.perf_counter() - start)
        copies += 1
    del src, dst
    return {"copy_GBps": 2 * nbytes / best / 1e9, "copy_bytes": nbytes, "copy_copies": copies,
            "copy_how": "numpy.copyto, 1 thread, best of copies; GB/s = 2 x bytes / time (STREAM copy)",
            "first_touch_GBps": nbytes / touch / 1e9, "copy_huge_share": huge}


def machine(*, bandwidth: bool = True, copy_bytes: int = COPY_BYTES) -> dict[str, Any]:
    """What the figures depend on besides the code: CPU model, logical and usable CPUs, total memory, THP
    mode, kernel, versions and (``bandwidth``: 0.3 s plus the buffers' first touch) the measured copy
    bandwidth; ``copy_GBps`` is None when not measured (ranks other than 0)."""
    total = memory_bytes()
    out: dict[str, Any] = {
        "cpu_model": cpu_model(), "cpus": os.cpu_count(), "cpus_usable": usable_cpus(),
        "memory_GiB": round(total / 2**30, 1) if total else None, "thp": thp_mode(),
        "kernel": f"{platform.system()} {platform.release()}", "machine": platform.machine(),
        "copy_GBps": None, "versions": versions()}
    if bandwidth:
        try:
            out.update(copy_bandwidth(copy_bytes))
        except (ImportError, MemoryError) as exc:  # a description without the figure beats no run
            out["copy_how"] = f"not measured: {type(exc).__name__}: {exc}"
    return out


def human(nbytes: int | None) -> str:
    """``256 MiB``."""
    return "? MiB" if nbytes is None else f"{nbytes / 2**20:g} MiB"


def line(info: dict[str, Any] | None = None) -> str:
    """``machine: ...``, the one-line header printed beside a benchmark's tables (measures if not given)."""
    m = machine() if info is None else info
    cpus = f"{m.get('cpus')} CPUs" + (f" ({m['cpus_usable']} usable)" if m.get("cpus_usable") != m.get("cpus")
                                      else "")
    bw = "copy bandwidth not measured"
    if m.get("copy_GBps"):
        bw = f"copy {m['copy_GBps']:.1f} GB/s (numpy, 1 thread, {human(m.get('copy_bytes'))}, 2 x bytes / time)"
        if m.get("copy_huge_share") is not None:
            bw += f", {m['copy_huge_share']:.0%} in huge pages"
        if m.get("first_touch_GBps"):
            bw += f", first touch {m['first_touch_GBps']:.2f} GB/s"
    vers = ", ".join(f"{k} {v}" for k, v in m.get("versions", {}).items() if v != "not installed")
    return (f"machine: {m.get('cpu_model')}; {cpus}; {m.get('memory_GiB')} GiB; THP {m.get('thp')}; "
            f"{m.get('kernel')}; {bw}; {vers}")


if __name__ == "__main__":  # python -m unidist.bench.machine: this machine's line
    print(line())
    sys.exit(0)
