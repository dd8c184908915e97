"""What ``unidist.init()`` costs a rank beside the engine's own start, on every backend.

    python -m unidist.bench.startup --rounds 5                     # every backend's main launch, 2 ranks
    python -m unidist.bench.startup --backends mpi --against OLD   # and unidist from another checkout OLD

A training script imports torch whatever starts it; what it pays to start its engine comes after. Each run is one
launch of this file as a script (``--child``) under the backend's launcher (the launches ``bench report`` runs;
the local backend: plain python), whose ranks first import torch, then measure one way of starting:

- ``raw``: the engine as its own users start it (its record's ``raw.start``: mpi4py's import, ``init_process_group``
  under torchrun, ``deepspeed.init_distributed()``, ``hvd.init()``; nothing on the local backend);
- ``unidist``: ``import unidist; unidist.init().start()`` from this tree (``--against DIR``: also from DIR's).

Per rank: the wall time of that start (each ends with every rank up: a barrier), the resident memory it added
(``/proc/self/statm``) and the modules it imported: the training layer (``unidist.train``), torch's compiler
(``torch._dynamo``, sympy) and transformers must not be among unidist's. The trees' bytecode is compiled first, as
an installed copy's is. The slowest rank counts; the ways alternate within each round, so drifting load hits each
alike, and the table gives medians over ``--rounds``.
"""

from __future__ import annotations

import argparse
import compileall
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run by path under a launcher: nothing of unidist imported before the measurement
    sys.path[0] = str(Path(__file__).resolve().parents[2])

__all__ = ["HEAVY", "main"]

ROOT = Path(__file__).resolve().parents[2]
# modules a start must not import: the training layer and what it brings (torch's compiler, sympy, Hugging Face)
HEAVY = ("unidist.train", "unidist.checkpoint", "torch._dynamo", "sympy", "transformers")


def _rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def child(way: str, tree: str | None, out: Path) -> None:
    """One rank: torch imported first (every training script does), then one way of starting, measured."""
    import torch  # noqa: F401 - the script's own import, outside the measurement

    if tree:
        sys.path.insert(0, tree)
    begin = None
    if way == "raw":  # the record's call, looked up outside the measurement (unidist's table, not its start)
        from unidist import registry

        begin = registry.get(os.environ["UNIDIST_BENCH_BACKEND"]).raw.start
    # a full collection first, in both ways: torch's million objects make a full collection cost tens of ms, and one
    # falling inside the window by chance (a few thousand more objects allocated) would be charged to that way
    gc.collect()
    before, rss, start = set(sys.modules), _rss_mb(), time.perf_counter()
    if way == "raw":
        end = begin() if begin is not None else (lambda: None)
    else:
        import unidist

        mgr = unidist.init()
        mgr.start()
        mgr.barrier()
        end = mgr.shutdown
    took, added = time.perf_counter() - start, _rss_mb() - rss
    imported = sorted(set(sys.modules) - before)
    heavy = [m for m in imported if m.startswith(HEAVY)]
    (out / f"{way}.{os.getpid()}.json").write_text(json.dumps({"s": took, "mb": added, "modules": len(imported),
                                                               "heavy": heavy}))
    end()


def _launch(backend: str, n: int, way: str, tree: str | None, out: Path, timeout: float) -> dict[str, Any]:
    from unidist import registry
    from unidist.bench.report import Run, run_env
    from unidist.cli import launch_command

    record = registry.get(backend)
    launch = record.launches[0]
    import torch

    run = Run(backend, launch.launcher, backend, launch.environment(torch.cuda.is_available()))
    args = ["--child", way, "--out", str(out)] + (["--tree", tree] if tree else [])
    argv = launch_command(backend, n, str(Path(__file__).resolve()), args)
    env = {**run_env(run, n), "UNIDIST_BACKEND": backend, "UNIDIST_BENCH_BACKEND": backend}
    for old in out.glob(f"{way}.*.json"):
        old.unlink()
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    ranks = [json.loads(p.read_text()) for p in sorted(out.glob(f"{way}.*.json"))]
    if proc.returncode != 0 or len(ranks) != n:
        raise SystemExit(f"startup: {' '.join(argv)} (exit {proc.returncode}, {len(ranks)} of {n} ranks "
                         f"reported):\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    return {"s": max(r["s"] for r in ranks), "mb": max(r["mb"] for r in ranks),
            "modules": max(r["modules"] for r in ranks), "heavy": sorted({m for r in ranks for m in r["heavy"]})}


def measure(backends: list[str], n: int, rounds: int, against: str | None, timeout: float) -> list[dict[str, Any]]:
    """Rows of the table: per backend, the medians of each way over the rounds (ways interleaved per round)."""
    ways = [("raw", None), ("unidist", str(ROOT))] + ([("before", against)] if against else [])
    for _, tree in ways:  # bytecode written first, as an installed copy has it (PYTHONDONTWRITEBYTECODE would
        if tree:  # otherwise make every rank compile the package again, about 0.1 s)
            compileall.compile_dir(str(Path(tree) / "unidist"), quiet=1)
    rows = []
    with tempfile.TemporaryDirectory(prefix="unidist-startup-") as tmp:
        for backend in backends:
            ranks = 1 if backend == "local" else n
            got: dict[str, list[dict[str, Any]]] = {w: [] for w, _ in ways}
            for _ in range(rounds):
                for way, tree in ways:
                    child_way = "raw" if way == "raw" else "unidist"
                    got[way].append(_launch(backend, ranks, child_way, tree, Path(tmp), timeout))
            row: dict[str, Any] = {"backend": backend, "ranks": ranks}
            for way, _ in ways:
                row[f"{way}_s"] = statistics.median(r["s"] for r in got[way])
                row[f"{way}_mb"] = statistics.median(r["mb"] for r in got[way])
                row[f"{way}_heavy"] = sorted({m for r in got[way] for m in r["heavy"]})
            rows.append(row)
            print(f"  {backend}: " + ", ".join(f"{w} {row[f'{w}_s']:.3f} s {row[f'{w}_mb']:.0f} MB" for w, _ in ways),
                  file=sys.stderr, flush=True)
    return rows


def table(rows: list[dict[str, Any]], against: bool) -> str:
    from unidist.bench.output import Column, fmt, markdown

    cols: list[Column] = [("backend", "backend", str), ("ranks", "ranks", str),
                          ("raw_s", "engine's own s", fmt(3)), ("unidist_s", "unidist s", fmt(3)),
                          ("more_s", "unidist - engine s", fmt(3)), ("raw_mb", "engine's own MB", fmt(1)),
                          ("unidist_mb", "unidist MB", fmt(1)), ("more_mb", "unidist - engine MB", fmt(1))]
    if against:
        cols += [("before_s", "before s", fmt(3)), ("before_mb", "before MB", fmt(1))]
    cols.append(("heavy", "heavy modules unidist imported", str))
    shown = [{**r, "more_s": r["unidist_s"] - r["raw_s"], "more_mb": r["unidist_mb"] - r["raw_mb"],
              "heavy": ", ".join(r["unidist_heavy"]) or "none"} for r in rows]
    return markdown(cols, shown)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m unidist.bench.startup", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backends", default="local,mpi,torch,deepspeed,horovod", help="comma-separated")
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--against", metavar="DIR", help="also start unidist from this checkout (a before column)")
    p.add_argument("--timeout", type=float, default=300, help="seconds per launch")
    p.add_argument("--json", type=Path, help="write the rows here")
    p.add_argument("--child", choices=("raw", "unidist"), help=argparse.SUPPRESS)
    p.add_argument("--tree", help=argparse.SUPPRESS)
    p.add_argument("--out", type=Path, help=argparse.SUPPRESS)
    args, _ = p.parse_known_args(argv)  # the deepspeed launcher appends --local_rank=N to the child
    if args.child:
        child(args.child, args.tree, args.out)
        return 0
    from unidist import registry
    from unidist.bench.machine import line

    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    for b in backends:
        if b != "local" and registry.get(b).raw.start is None:
            raise SystemExit(f"startup: the {b} backend's record has no raw.start to compare with")
    rows = measure(backends, args.nprocs, args.rounds, args.against, args.timeout)
    print(line())
    print(f"bench startup: {args.rounds} rounds, medians, slowest rank; torch imported before each start\n")
    print(table(rows, args.against is not None))
    if args.json:
        args.json.write_text(json.dumps({"rows": rows}, indent=1))
    bad = [r["backend"] for r in rows if r["unidist_heavy"]]
    if bad:
        print(f"\nunidist's start imported {', '.join(HEAVY)} modules on: {', '.join(bad)}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
