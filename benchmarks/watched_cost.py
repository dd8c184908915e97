"""What the always-on watched regions cost per call, and what the stall inspector adds (issue 24).

    python benchmarks/watched_cost.py --trees /path/to/main .        # the wrapper, two source trees
    python benchmarks/watched_cost.py --mpi --pairs 7                # 8 B allreduce, inspector on vs off

``--trees``: for each tree (PYTHONPATH) in turn, interleaved ``--runs`` times, a child process times an
engine's primitive bare and through ``watch`` (the watchdog's wrapper) on a two-rank stand-in engine whose
calls return at once, and prints the wrapped-minus-bare medians in ns: what a watched region costs, tree
against tree, on the same machine at the same moment.

``--mpi``: pairs of ``mpiexec -n 2 python -m unidist.bench collectives --sizes 8 --ops allreduce`` with
``UNIDIST_STALL_WARNING=0`` and ``=60``, alternating, and the median per call of each setting. Per call, both
run the same code; only the watchdog thread's heartbeat differs (it carries the position).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

CHILD = r"""
import statistics, time, torch
from unidist.comm import watchdog
from unidist.comm.engine import SoloEngine
from unidist.ops import ReduceOp

class Pair(SoloEngine):
    def __init__(self):
        super().__init__()
        self.size = 2
    def allreduce(self, send, recv, op):
        return None

bare = Pair()
wrapped = watchdog.watch(Pair())
t = torch.ones(2)
n = 20000

def per_call(fn, *args):
    start = time.perf_counter_ns()
    for _ in range(n):
        fn(*args)
    return (time.perf_counter_ns() - start) / n

out = {"allreduce": [], "barrier": []}
for _ in range(15):
    args = (t, t, ReduceOp.SUM)
    out["allreduce"].append(per_call(wrapped.allreduce, *args) - per_call(bare.allreduce, *args))
    out["barrier"].append(per_call(wrapped.barrier) - per_call(bare.barrier))
print(json.dumps({k: statistics.median(v) for k, v in out.items()}))
"""


def trees(paths: list[str], runs: int) -> None:
    got: dict[str, dict[str, list[float]]] = {p: {"allreduce": [], "barrier": []} for p in paths}
    for _ in range(runs):
        for path in paths:
            env = {**os.environ, "PYTHONPATH": os.path.abspath(path), "OMP_NUM_THREADS": "1"}
            line = subprocess.run([sys.executable, "-c", "import json\n" + CHILD], env=env, check=True,
                                  capture_output=True, text=True).stdout.strip().splitlines()[-1]
            for k, v in json.loads(line).items():
                got[path][k].append(v)
    print(_machine())
    print(f"watched region, wrapped minus bare call, ns: median (min-max) of {runs} runs of 15 rounds\n")
    print("| tree | allreduce | barrier |\n|---|---|---|")
    for path, rows in got.items():
        cells = [f"{statistics.median(v):.0f} ({min(v):.0f}-{max(v):.0f})" for v in rows.values()]
        print(f"| {path} | {' | '.join(cells)} |")


def mpi(pairs: int) -> None:
    times: dict[str, list[float]] = {"0": [], "60": []}
    for _ in range(pairs):
        for setting in times:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                env = {**os.environ, "UNIDIST_STALL_WARNING": setting, "OMP_NUM_THREADS": "1"}
                argv = [shutil.which("mpiexec") or "mpiexec", "-n", "2", sys.executable, "-m", "unidist.bench",
                        "collectives", "--sizes", "8", "--ops", "allreduce", "--rounds", "15", "--json", f.name]
                subprocess.run(argv, env=env, check=True, capture_output=True)
                rows = json.load(open(f.name))["rows"]
                times[setting].append(next(r for r in rows if r["op"] == "allreduce")["time_us"])
    print(_machine())
    print(f"8 B allreduce under mpiexec -n 2, us per call: median (min-max) of {pairs} interleaved runs\n")
    print("| UNIDIST_STALL_WARNING | us per call |\n|---|---|")
    for setting, v in times.items():
        print(f"| {setting} | {statistics.median(v):.2f} ({min(v):.2f}-{max(v):.2f}) |")
    print(f"\non minus off: {statistics.median(times['60']) - statistics.median(times['0']):+.2f} us")


def _machine() -> str:
    load = os.getloadavg()[0]
    return (f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, {os.cpu_count()} cores, load {load:.1f}, "
            f"Python {sys.version.split()[0]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trees", nargs="+", help="source trees to compare (their unidist is imported)")
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--mpi", action="store_true", help="8 B allreduce with the inspector on and off")
    parser.add_argument("--pairs", type=int, default=7)
    args = parser.parse_args()
    if args.trees:
        trees(args.trees, args.runs)
    if args.mpi:
        mpi(args.pairs)


if __name__ == "__main__":
    main()
