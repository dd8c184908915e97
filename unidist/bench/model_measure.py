"""``model --measure``: the measurements the cost model is fitted to and checked against.

    python -m unidist.bench model --measure --out-dir benchmarks/model --runs mpi,torch --ranks 2,3,4

Each run is one launch of ``python -m unidist.bench all --benches collectives --compare`` on ``n`` ranks,
spelled exactly as ``report`` spells its launches (same launcher rows, same ``--bin`` directories, same
environment: this tree on ``PYTHONPATH``, ``OMP_NUM_THREADS`` = cores / ranks), writing
``<out-dir>/<run>-<n>.json``. Why a sample of sizes (``SIZES``) and a short budget: the model needs a few
points per regime (latency-bound, in cache, out of cache) at 2, 3 and 4 ranks, and the whole set must take
minutes on a shared 2-core machine, not the half hour of a full ``report``. First, ``gamma.json``: the
reduction cost per byte, a local add timed here (``local_gamma``; per size the fastest of this and earlier
measurements on this host), which the collectives cannot separate from the copy cost. Runs go one after the other;
a failed one is reported, the others still written. Nothing here imports torch (``report`` does, lazily,
to list the runs).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["GAMMA_SIZES", "SIZES", "fastest", "gamma_params", "local_gamma", "measure", "run_name"]

SIZES = "8,1K,16K,64K,256K,1M,4M,16M"
DEFAULTS = ["--sizes", SIZES, "--budget", "0.1", "--rounds", "5", "--warmup", "2"]
GAMMA_SIZES = (16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 32 << 20, 64 << 20)


def local_gamma(sizes: tuple[int, ...] = GAMMA_SIZES, rounds: int = 7) -> list[dict[str, Any]]:
    """The reduction cost gamma, measured: seconds of an in-place float32 ``a.add_(b)`` of ``n`` bytes (the
    local step of every sum reduction), the fastest of ``rounds`` rounds of calls lasting ~20 ms each, one
    row per size (``{"bench": "gamma", "bytes", "seconds"}``). One thread, as each rank of a 2-core run has.
    Why the fastest, where the collectives report medians: gamma is a property of the machine, and on a
    shared machine a neighbour only ever adds time to a local loop (medians moved 2x under load)."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        rows = []
        for n in sizes:
            a, b = torch.ones(n // 4), torch.ones(n // 4)
            a.add_(b)
            start = time.perf_counter()
            a.add_(b)
            iters = max(1, int(0.02 / max(time.perf_counter() - start, 1e-7)))
            samples = []
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(iters):
                    a.add_(b)
                samples.append((time.perf_counter() - start) / iters)
            rows.append({"bench": "gamma", "bytes": n, "seconds": min(samples)})
        return rows
    finally:
        torch.set_num_threads(threads)


def fastest(rows: list[dict[str, Any]], previous: Path) -> list[dict[str, Any]]:
    """``rows`` with each size's time replaced by the fastest of them and of ``previous`` (a gamma.json
    written on this host; other hosts' are ignored): gamma is the machine's, and a neighbour only adds time,
    so repeated measurements on a busy machine converge on it."""
    try:
        doc = json.loads(previous.read_text())
    except (OSError, ValueError):
        return rows
    if doc.get("meta", {}).get("host") != platform.node():
        return rows
    best = {int(r["bytes"]): float(r["seconds"]) for r in doc.get("rows", [])}
    return [{**r, "seconds": min(float(r["seconds"]), best.get(int(r["bytes"]), math.inf))} for r in rows]


def gamma_params(rows: list[dict[str, Any]]) -> tuple[float, float, float]:
    """(gamma, gamma_mem, split bytes) from ``local_gamma`` rows: the step between a cache and a memory cost
    per byte that fits the rows best (relative error; one level, split infinity, if that fits best), with
    two sizes at least on each side of a split (one noisy point must not set a level)."""
    pts = sorted((float(r["bytes"]), float(r["seconds"]) / float(r["bytes"])) for r in rows)
    if not pts:
        raise InvalidArgumentError("no gamma rows: run `model --measure`, or give a gamma.json it wrote")
    best = (math.inf, 0.0, 0.0, math.inf)
    for split in [*(n for n, _ in pts[1:-2]), math.inf]:
        low = [g for n, g in pts if n <= split] or [pts[0][1]]
        high = [g for n, g in pts if n > split] or low
        lo, hi = statistics.median(low), statistics.median(high)
        resid = sum(((lo if n <= split else hi) / g - 1) ** 2 for n, g in pts)
        if resid < best[0] - 1e-12:
            best = (resid, lo, hi, split)
    return best[1], best[2], best[3]


def run_name(run: str, ranks: int) -> str:
    """The JSON file's stem: ``mpi-3``."""
    return f"{run}-{ranks}"


def _ranks(text: str) -> list[int]:
    try:
        ranks = [int(r) for r in text.split(",") if r.strip()]
    except ValueError:
        ranks = []
    if not ranks or min(ranks) < 2:
        raise InvalidArgumentError(f"--ranks {text!r}: give rank counts of 2 or more, comma-separated (2,3,4)")
    return ranks


def _running() -> int:
    """Processes running or runnable right now, this one included (/proc/loadavg's 4th field; 0 elsewhere)."""
    try:
        return int(Path("/proc/loadavg").read_text().split()[3].split("/")[0])
    except (OSError, IndexError, ValueError):
        return 0


def wait_quiet(limit: float, samples: int = 10) -> bool:
    """Wait up to ``limit`` seconds for a quiet machine: ``samples`` successive looks, 0.2 s apart, that see
    no runnable process but this one. Why: on a shared machine a neighbour's job moves a 5-round median by
    2-3x, and the 1-minute load average lags the truth by a minute. Returns whether it got quiet."""
    deadline, quiet = time.monotonic() + limit, 0
    while quiet < samples:
        quiet = quiet + 1 if _running() <= 1 else 0
        if quiet < samples and time.monotonic() > deadline:
            return False
        time.sleep(0.2)
    return True


def measure(args: argparse.Namespace) -> list[Path]:
    """Launch every chosen run at every rank count; returns the JSON files written (failed runs left out).

    ``args``: ``out_dir`` (JSON and logs go there), ``runs`` (names from ``report.runs()``, comma-separated),
    ``ranks`` (``"2,3,4"``), ``bin`` (``ENGINE=DIR`` specs as ``report --bin``), ``timeout`` (seconds per
    launch), ``wait_quiet`` (seconds to wait for a quiet machine before each launch) and ``bench_args``
    (options after ``--``, appended after the defaults so they win). Each launch's load (1-minute average
    before and after, and whether the machine was quiet when it started) goes to ``measure.json``.
    """
    from unidist.bench import report

    known = {r.name: r for r in report.runs()}
    chosen = [r.strip() for r in args.runs.split(",") if r.strip()]
    unknown = [r for r in chosen if r not in known]
    if unknown:
        raise InvalidArgumentError(f"--runs: unknown {', '.join(unknown)}; use some of {', '.join(known)}")
    bins = report.bins(args.bin)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    gamma = args.out_dir / "gamma.json"
    quiet, before = wait_quiet(args.wait_quiet), os.getloadavg()[0]
    rows = fastest(local_gamma(), gamma)
    gamma.write_text(json.dumps({"meta": {"bench": "gamma", "host": platform.node(), "load_before": before,
                                          "quiet_at_start": quiet}, "rows": rows}, indent=1) + "\n")
    print(f"== gamma (load {before:.2f}, {'quiet' if quiet else 'NOT quiet'}): {gamma}", flush=True)
    written: list[Path] = [gamma]
    failed: list[str] = []
    log_rows: list[dict[str, Any]] = []
    for n in _ranks(args.ranks):
        for name in chosen:
            run = known[name]
            out = (args.out_dir / f"{run_name(name, n)}.json").resolve()
            rest = ["--benches", "collectives", "--compare", *DEFAULTS, *args.bench_args, "--json", str(out)]
            argv = report.command(run, bins.get(run.backend, Path(sys.executable).parent), n, rest)
            quiet = wait_quiet(args.wait_quiet)
            before = os.getloadavg()[0]
            print(f"== {run_name(name, n)} (load {before:.2f}, {'quiet' if quiet else 'NOT quiet'}): "
                  f"{' '.join(argv)}", flush=True)
            start = time.perf_counter()
            log_path = args.out_dir / f"{run_name(name, n)}.log"
            with open(log_path, "w") as log:
                try:
                    code = subprocess.run(argv, env=report.run_env(run, n), stdout=log, stderr=subprocess.STDOUT,
                                          timeout=args.timeout, check=False).returncode
                except subprocess.TimeoutExpired:
                    code = -1
            took = time.perf_counter() - start
            after = os.getloadavg()[0]
            print(f"   exit {code} after {took:.0f} s, load {after:.2f} (log: {log_path})", flush=True)
            log_rows.append({"bench": "measure", "run": run_name(name, n), "ranks": n, "exit": code,
                             "seconds": took, "load_before": before, "load_after": after, "quiet_at_start": quiet,
                             "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
            if code == 0 and out.exists():
                written.append(out)
            else:
                failed.append(run_name(name, n))
    log = args.out_dir / "measure.json"  # other runs measured into this directory before keep their rows
    kept = json.loads(log.read_text())["rows"] if log.exists() else []
    mine = {r["run"] for r in log_rows}
    rows = [r for r in kept if r.get("run") not in mine] + log_rows
    log.write_text(json.dumps({"meta": {"bench": "measure"}, "rows": rows}, indent=1) + "\n")
    written.append(log)
    if failed:
        print(f"FAILED: {', '.join(failed)} (see their logs in {args.out_dir})", flush=True)
    return written
