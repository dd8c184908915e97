"""What the timeline costs: the README main job with ``UNIDIST_TIMELINE`` off and on, side by side.

    python -m unidist.bench.timeline_cost --pairs 5

Runs ``unidist launch -n 2 examples/train_digits.py`` (the README's main job) in interleaved pairs (off then
on, on then off, alternating, so drifting load hits both alike) and prints per pair the job's wall time, the
CPU time of its processes and the script's own training throughput, then the medians and on/off ratios. The
per-call cost comes from the on runs' traces (their engine calls and spans) and, exactly, from a loop timing
one primitive call through the recording engine against the bare call. The machine's load average is
printed beside the table: the machine is shared, and the ratios are what to read.
"""

from __future__ import annotations

import argparse
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from unidist.bench.output import fmt, markdown

__all__ = ["main", "per_call_us"]

ROOT = Path(__file__).resolve().parents[2]


def _job(trace: str | None, nprocs: int) -> dict[str, Any]:
    env = dict(os.environ)
    env.pop("UNIDIST_TIMELINE", None)
    if trace:
        env["UNIDIST_TIMELINE"] = trace
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "unidist.cli", "launch", "-n", str(nprocs),
                           str(ROOT / "examples" / "train_digits.py")], env=env, capture_output=True, text=True,
                          check=False)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise SystemExit(f"timeline_cost: the job failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rate = re.search(r"(\d+) samples/s", proc.stdout)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall_s": wall, "cpu_s": cpu, "samples_per_s": float(rate.group(1)) if rate else float("nan")}


def _events(trace: str) -> int:
    from unidist.bench.timeline import load

    events, _ = load(trace)
    return sum(1 for e in events if e["pid"] == 0)


def per_call_us(calls: int = 100_000) -> tuple[float, float]:
    """(bare, recorded) microseconds of one ``allreduce`` primitive call that does nothing, through the
    recording engine's wrapper: what recording adds to every engine call, with nothing else in the way."""
    import torch

    from unidist.comm.timeline import Recorder, recorded_call
    from unidist.ops import ReduceOp

    def allreduce(send: Any, recv: Any, op: Any) -> None:
        return None

    rec = Recorder(os.devnull, 0, 2, calls * 4)
    wrapped = recorded_call(allreduce, "allreduce", rec, "world", 2)
    t = torch.zeros(1000)
    best = [float("inf"), float("inf")]
    for _ in range(5):
        for i, fn in enumerate((allreduce, wrapped)):
            rec.events.clear()
            start = time.perf_counter()
            for _ in range(calls):
                fn(t, t, ReduceOp.SUM)
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best[0], best[1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("-n", "--nprocs", type=int, default=2)
    ns = parser.parse_args(argv)
    load_before, rows, events = os.getloadavg(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(ns.pairs):
            order = (False, True) if k % 2 == 0 else (True, False)
            got = {}
            for on in order:
                trace = os.path.join(tmp, f"trace{k}.json") if on else None
                got[on] = _job(trace, ns.nprocs)
                if trace:
                    events.append(_events(trace))
            rows.append({"pair": k, **{f"off_{m}": got[False][m] for m in got[False]},
                         **{f"on_{m}": got[True][m] for m in got[True]}})
    load_after = os.getloadavg()
    cols: list[tuple[str, str, Any]] = [("pair", "pair", str)]
    for m, digits in (("wall_s", 2), ("cpu_s", 2), ("samples_per_s", 0)):
        cols += [(f"off_{m}", f"off {m}", fmt(digits)), (f"on_{m}", f"on {m}", fmt(digits))]
    print(markdown(cols, rows))
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "pair"}
    print(f"\nmedians over {ns.pairs} pairs: wall on/off {med['on_wall_s'] / med['off_wall_s']:.3f}, "
          f"CPU on/off {med['on_cpu_s'] / med['off_cpu_s']:.3f}, "
          f"training throughput off/on {med['off_samples_per_s'] / med['on_samples_per_s']:.3f}")
    per_event = (med["on_cpu_s"] - med["off_cpu_s"]) / (ns.nprocs * statistics.median(events)) * 1e6
    bare, recorded = per_call_us()
    print(f"recorded events per rank: {statistics.median(events):.0f}; CPU difference per event "
          f"{per_event:.1f} us (noisy: a difference of two whole jobs)")
    print(f"one engine call, measured alone: bare {bare:.3f} us, recorded {recorded:.3f} us: "
          f"+{recorded - bare:.3f} us a call")
    print(f"machine: {os.cpu_count()} cores, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")
    return 0


if __name__ == "__main__":
    sys.exit(main())
