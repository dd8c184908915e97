"""What the timeline costs: the README main job with ``UNIDIST_TIMELINE`` off and on, side by side.

    python -m unidist.bench.timeline_cost --pairs 8 --jobs 3

Three measurements, each printed as a table with the machine's load beside it (the machine is shared: the
ratios are what to read):

- inside one launch (``unidist launch -n 2``, started by this module): the README main job's model and loop
  (examples/train_digits.py: the 64-128-64-10 MLP, Adam, a global batch of 48) trained for ``--steps`` steps
  under a Manager with the timeline off, then one with it on (then on, off: interleaved pairs, so drifting
  load hits both alike); the slowest rank's wall and CPU time per step, the events recorded per step, and
  the time the on Manager's exit takes (writing and merging the trace);
- whole jobs: ``unidist launch -n 2 examples/train_digits.py`` itself, off and on, in ``--jobs`` pairs: wall,
  the CPU time of its processes and the script's own throughput (noisy: start-up dominates);
- one engine call timed through the recording wrapper against the bare call: what recording adds a call.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if __package__ in (None, ""):  # run by path under the launcher: this tree, not the bench directory, first
    sys.path[0] = str(Path(__file__).resolve().parents[2])

from unidist.bench.output import fmt, markdown

if TYPE_CHECKING:
    from unidist.managers.base import Manager

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


def per_call_us(calls: int = 10_000) -> tuple[float, float]:
    """(bare, recorded) microseconds of one ``allreduce`` primitive call that does nothing, through the
    recording engine's wrapper: what recording adds to every engine call, with nothing else in the way. A
    fresh timeline of ``calls`` events a round (the README main job records ~3500 a rank)."""
    import torch

    from unidist.comm.timeline import Recorder, recorded_call
    from unidist.ops import ReduceOp

    def allreduce(send: Any, recv: Any, op: Any) -> None:
        return None

    t = torch.zeros(1000)
    best = [float("inf"), float("inf")]
    for _ in range(9):
        rec = Recorder(os.devnull, 0, 2, calls)
        for i, fn in enumerate((allreduce, recorded_call(allreduce, "allreduce", rec, "world", 2))):
            start = time.perf_counter()
            for _ in range(calls):
                fn(t, t, ReduceOp.SUM)
            best[i] = min(best[i], (time.perf_counter() - start) / calls * 1e6)
    return best[0], best[1]


def _train(mgr: Manager, x: Any, y: Any, steps: int) -> tuple[float, float, int]:
    """The main job's model and loop on ``mgr``: 10 warm-up steps, then ``steps`` timed ones; returns their
    wall and CPU seconds and the events the timeline recorded meanwhile (0 when it is off)."""
    import torch

    from unidist.comm import trace_hooks

    per = 48 // mgr.size
    torch.manual_seed(0)
    model: torch.nn.Module = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 64),
                                                 torch.nn.ReLU(), torch.nn.Linear(64, 10))
    model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=2e-3))
    rec = trace_hooks.recorder()
    before = wall = cpu = 0.0
    for s in range(10 + steps):
        if s == 10:
            before = len(getattr(rec, "events", ()))
            mgr.barrier()
            wall, cpu = time.perf_counter(), time.process_time()
        first = (s * 48) % 1392 + mgr.rank * per
        loss = torch.nn.functional.cross_entropy(model(x[first:first + per]), y[first:first + per])
        mgr.backward(loss)
        opt.step()
        opt.zero_grad()
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    return wall, cpu, int(len(getattr(rec, "events", ())) - before)


def _inside(pairs: int, steps: int, tmp: str) -> None:
    """Under a launcher: the interleaved off/on pairs of Managers, each training the main job's loop."""
    import torch

    import unidist
    from unidist.config import Config

    g = torch.Generator().manual_seed(0)
    x, y = torch.randn(1440, 64, generator=g), torch.randint(0, 10, (1440,), generator=g)
    rows: list[dict[str, Any]] = []
    rank = 0
    for k in range(pairs):
        row: dict[str, Any] = {"pair": k}
        for on in ((False, True) if k % 2 == 0 else (True, False)):
            config = dataclasses.replace(Config.from_env(), timeline=os.path.join(tmp, f"t{k}.json") if on else None)
            side = "on" if on else "off"
            with unidist.init(config=config) as mgr:
                rank = mgr.rank
                wall, cpu, events = _train(mgr, x, y, steps)
                got = mgr.allreduce(torch.tensor([wall, cpu], dtype=torch.float64), "max")
                row[f"{side}_wall_us"] = float(got[0]) / steps * 1e6
                row[f"{side}_cpu_us"] = float(got[1]) / steps * 1e6
                if on:
                    row["events_per_step"] = events / steps
                leaving = time.perf_counter()
            row[f"{side}_exit_ms"] = (time.perf_counter() - leaving) * 1e3
        rows.append(row)
    if rank == 0:
        print(json.dumps(rows), flush=True)


def _inside_table(pairs: int, steps: int, nprocs: int) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        proc = subprocess.run([sys.executable, "-m", "unidist.cli", "launch", "-n", str(nprocs), __file__,
                               "--inside", tmp, "--pairs", str(pairs), "--steps", str(steps)],
                              capture_output=True, text=True, check=False)
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("[")]
    if proc.returncode != 0 or not lines:
        raise SystemExit(f"timeline_cost: the launch failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = json.loads(lines[-1])
    cols: list[tuple[str, str, Any]] = [("pair", "pair", str), ("off_wall_us", "off wall us/step", fmt(0)),
                                        ("on_wall_us", "on wall us/step", fmt(0)),
                                        ("off_cpu_us", "off CPU us/step", fmt(0)),
                                        ("on_cpu_us", "on CPU us/step", fmt(0)),
                                        ("events_per_step", "events/step", fmt(1)),
                                        ("off_exit_ms", "off exit ms", fmt(1)), ("on_exit_ms", "on exit ms", fmt(1))]
    med = {key: statistics.median(r[key] for r in rows) for key in rows[0] if key != "pair"}
    wall = sorted(r["on_wall_us"] / r["off_wall_us"] for r in rows)
    cpu = sorted(r["on_cpu_us"] / r["off_cpu_us"] for r in rows)
    return (markdown(cols, rows) + f"\n\non/off per pair, median (range): wall {statistics.median(wall):.3f} "
            f"({wall[0]:.2f}-{wall[-1]:.2f}), CPU {statistics.median(cpu):.3f} ({cpu[0]:.2f}-{cpu[-1]:.2f}) over "
            f"{pairs} pairs of {steps} steps; {med['events_per_step']:.1f} events a step and rank; the trace's "
            f"writing at exit {med['on_exit_ms'] - med['off_exit_ms']:.0f} ms")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=8, help="off/on pairs of Managers inside one launch")
    parser.add_argument("--steps", type=int, default=200, help="timed training steps a Manager")
    parser.add_argument("--jobs", type=int, default=3, help="off/on pairs of whole jobs")
    parser.add_argument("-n", "--nprocs", type=int, default=2)
    parser.add_argument("--inside", help=argparse.SUPPRESS)  # set when this module runs under the launcher
    ns = parser.parse_args(argv)
    if ns.inside:
        _inside(ns.pairs, ns.steps, ns.inside)
        return 0
    load_before = os.getloadavg()
    print(f"## Inside one launch ({ns.nprocs} ranks)\n")
    print(_inside_table(ns.pairs, ns.steps, ns.nprocs))
    print(f"machine: {os.cpu_count()} cores, load average {load_before[0]:.2f} before, {os.getloadavg()[0]:.2f} "
          "after")
    bare, recorded = per_call_us()
    print(f"\n## One engine call, measured alone\n\nbare {bare:.3f} us, recorded {recorded:.3f} us: "
          f"+{recorded - bare:.3f} us a call (load average {os.getloadavg()[0]:.2f})")
    if ns.jobs:
        print(f"\n## Whole jobs: unidist launch -n {ns.nprocs} examples/train_digits.py\n")
        _jobs(ns.jobs, ns.nprocs)
    return 0


def _jobs(pairs: int, nprocs: int) -> None:
    load_before, rows, events = os.getloadavg(), [], []
    with tempfile.TemporaryDirectory() as tmp:
        for k in range(pairs):
            order = (False, True) if k % 2 == 0 else (True, False)
            got = {}
            for on in order:
                trace = os.path.join(tmp, f"trace{k}.json") if on else None
                got[on] = _job(trace, nprocs)
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
    print(f"\nmedians over {pairs} pairs: wall on/off {med['on_wall_s'] / med['off_wall_s']:.3f}, "
          f"CPU on/off {med['on_cpu_s'] / med['off_cpu_s']:.3f}, "
          f"training throughput off/on {med['off_samples_per_s'] / med['on_samples_per_s']:.3f}; "
          f"{statistics.median(events):.0f} events a rank")
    print(f"machine: {os.cpu_count()} cores, load average {load_before[0]:.2f} before, {load_after[0]:.2f} after")


if __name__ == "__main__":
    sys.exit(main())
