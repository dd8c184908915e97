"""``collectives``: an OSU-style sweep of unidist's collectives, optionally beside the engine's own calls.

    mpiexec -n 2 python -m unidist.bench collectives --compare --max-size 32M

For each collective and message size: a warm-up, an iteration count calibrated on rank 0 so each column
runs about ``--budget`` seconds per round (large messages get few calls, small ones thousands), then
``--rounds`` interleaved rounds (unidist's call, then with ``--compare`` the raw engine call of
``engines.py``, alternating) and the slowest rank's median per call. Rank 0 first prints (on stderr) about
how long the sweep will take, then a progress line per op and size with the time left.

Sizes follow nccl-tests: ``bytes`` is the buffer of allreduce and broadcast, the whole gathered output of
allgather, the whole input of reduce_scatter and alltoall (each rank sends or keeps 1/n of it). algbw =
bytes / time; busbw = algbw x (allreduce 2(n-1)/n, allgather, reduce_scatter and alltoall (n-1)/n,
broadcast 1), the rate each rank's link moves data at, comparable across collectives and rank counts.
Buffers are float32 zeros (repeated sums must not overflow into infinities).
"""

from __future__ import annotations

import argparse
import re
import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unidist.bench import engines
from unidist.bench.busbw import busbw_factor
from unidist.bench.output import Column, fmt, human_bytes, markdown
from unidist.bench.timing import calibrate, interleaved, slowest, spread

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["add_arguments", "busbw_factor", "default_sizes", "estimate_seconds", "parse_size", "planned", "run",
           "table", "verify"]

_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "KIB": 1 << 10, "M": 1 << 20, "MB": 1 << 20, "MIB": 1 << 20,
          "G": 1 << 30, "GB": 1 << 30, "GIB": 1 << 30}


def parse_size(text: str) -> int:
    """``4``, ``64K``, ``2MiB``, ``128M``: bytes (binary units)."""
    m = re.fullmatch(r"\s*(\d+)\s*([A-Za-z]*)\s*", text)
    if not m or m.group(2).upper() not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size such as 4, 64K or 128M")
    return int(m.group(1)) * _UNITS[m.group(2).upper()]


ISSUE_SIZES = (8, 2 << 20, 32 << 20)  # quoted by issue 13's targets; not powers of 4


def default_sizes(min_size: int, max_size: int) -> list[int]:
    """Powers of 4 from ``min_size`` up, ``max_size`` itself (128 MiB is not a power of 4) and, in range, the
    sizes issue 13's targets quote (8 B, 2 MiB, 32 MiB)."""
    sizes, s = {max_size}, max(4, min_size)
    while s <= max_size:
        sizes.add(s)
        s *= 4
    return sorted(sizes | {s for s in ISSUE_SIZES if min_size <= s <= max_size})


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", help="comma-separated message sizes (4,64K,2M); default: powers of 4 from "
                                        "--min-size to --max-size, and 8, 2M, 32M")
    parser.add_argument("--min-size", type=parse_size, default=4)
    parser.add_argument("--max-size", type=parse_size, default=128 << 20)
    parser.add_argument("--ops", default=",".join(engines.OPS), help=f"comma-separated, of {', '.join(engines.OPS)}")
    parser.add_argument("--compare", action="store_true", help="also time the engine's own call, interleaved")
    parser.add_argument("--budget", type=float, default=0.2, help="seconds per column per round (approx.)")
    parser.add_argument("--plot", help="bandwidth against size, per collective, as a PNG")


def _sizes(args: argparse.Namespace) -> list[int]:
    if args.sizes:
        return [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    return default_sizes(args.min_size, args.max_size)


def _calls(mgr: Manager, op: str, nbytes: int) -> tuple[torch.Tensor, Callable[[], Any], int]:
    """The buffer the raw call takes, unidist's call, and the bytes in nccl-tests' sense."""
    n = mgr.size
    count = max(1, nbytes // 4)
    if op in ("allgather", "reduce_scatter", "alltoall"):
        count = max(n, count // n * n)  # whole chunks per rank
    x = torch.zeros(count)
    if op == "allreduce":
        return x, lambda: mgr.allreduce_(x), 4 * count
    if op == "broadcast":
        return x, lambda: mgr.broadcast_(x, 0), 4 * count
    # the output buffers are reused, as the raw calls' are (``out=``: a fresh large buffer page-faults each call)
    if op == "allgather":
        part, gathered = torch.zeros(count // n), torch.zeros(count)
        return part, lambda: mgr.allgather(part, out=gathered), 4 * count
    if op == "reduce_scatter":
        mine = torch.zeros(count // n)
        return x, lambda: mgr.reduce_scatter(x, out=mine), 4 * count
    if op == "alltoall":
        got = torch.zeros(count)
        return x, lambda: mgr.alltoall(x, out=got), 4 * count
    raise SystemExit(f"collectives: unknown op {op!r}; use {', '.join(engines.OPS)}")


def verify(mgr: Manager, op: str, x: torch.Tensor, call: Callable[[], Any]) -> None:
    """One call on rank-valued input, checked, before timing: a fast path that returns wrong data must not
    produce a fine-looking row. The input is zeroed again afterwards."""
    n, r = mgr.size, mgr.rank
    x.fill_(r + 1)
    out = call().clone()  # allreduce_ and broadcast_ return x itself, zeroed below
    ranks = torch.arange(1, n + 1, dtype=x.dtype).repeat_interleave(x.numel() // n if op == "alltoall" else 1)
    expected = {"allreduce": torch.full_like(x, n * (n + 1) / 2), "broadcast": torch.ones_like(x),
                "allgather": torch.arange(1, n + 1, dtype=x.dtype).repeat_interleave(x.numel()),
                "reduce_scatter": torch.full((x.numel() // n,), n * (n + 1) / 2), "alltoall": ranks}[op]
    x.zero_()
    if out.shape != expected.shape or not torch.equal(out, expected):
        raise SystemExit(f"collectives: {op} of {4 * x.numel()} bytes on rank {r} returned wrong values "
                         f"({out.reshape(-1)[:8].tolist()}... expected {expected[:8].tolist()}...): not timing it")


def planned(mgr: Manager, ops: list[str], sizes: list[int]) -> list[tuple[str, int]]:
    """The (op, size) cells to time: a size whose buffer comes out the same as an earlier one's for that op
    (4 B of allgather on 2 ranks is one float per rank, 8 B, as 8 B is) is timed once, under its real size."""
    cells, seen = [], set()
    for op in ops:
        for nbytes in sizes:
            n = mgr.size
            count = max(1, nbytes // 4)
            if op in ("allgather", "reduce_scatter", "alltoall"):
                count = max(n, count // n * n)
            if (op, count) not in seen:
                seen.add((op, count))
                cells.append((op, nbytes))
    return cells


def estimate_seconds(cells: int, columns: int, args: argparse.Namespace) -> float:
    """About how long the sweep takes: each cell's columns run ``--budget`` seconds a round, ``--rounds``
    rounds, plus the warm-up and calibration (about one round's worth; more where one call outlasts the
    budget, which only the largest sizes do)."""
    return float(cells * columns * args.budget * (args.rounds + 1))


def _minutes(seconds: float) -> str:
    return f"{seconds:.0f} s" if seconds < 90 else f"{seconds / 60:.1f} min"


def run(mgr: Manager, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per collective and size: unidist's time and bandwidths and, with --compare, the raw call's
    and the ratio unidist / raw. Rank 0 says first how long the sweep should take, then a progress line per
    cell on stderr (stdout keeps the tables)."""
    ops = [op.strip() for op in args.ops.split(",") if op.strip()]
    raw_table = engines.collective_table(mgr) if args.compare else {}
    cells = planned(mgr, ops, _sizes(args))
    columns = 1 + bool(raw_table)
    total = estimate_seconds(len(cells), columns, args)
    say = _progress(mgr)
    say(f"collectives: {len(cells)} cells ({len(ops)} ops x sizes), {columns} column(s), {args.rounds} rounds of "
        f"~{args.budget:g} s each: about {_minutes(total)} (--sizes, --max-size, --ops, --rounds, --budget make it "
        f"shorter)")
    started = time.perf_counter()
    rows = []
    for i, (op, nbytes) in enumerate(cells, 1):
        x, unidist_call, actual = _calls(mgr, op, nbytes)
        verify(mgr, op, x, unidist_call)
        timed = {"unidist": unidist_call}
        if op in raw_table:
            timed["raw"] = raw_table[op](x)
        iters = calibrate(mgr, list(timed.values()), budget=args.budget, warmup=args.warmup,
                          max_iters=20000)
        samples = interleaved(mgr, timed, iters=iters, rounds=args.rounds)
        med, noise = slowest(mgr, samples), spread(mgr, samples)
        factor = busbw_factor(op, mgr.size)
        row: dict[str, Any] = {"bench": "collectives", "op": op, "bytes": actual, "dtype": "float32",
                               "iters": iters, "rounds": args.rounds, "spread": noise["unidist"]}
        for name, seconds in med.items():
            prefix = "" if name == "unidist" else "raw_"
            algbw = actual / seconds / 1e9
            row.update({f"{prefix}time_us": seconds * 1e6, f"{prefix}algbw_GBps": algbw,
                        f"{prefix}busbw_GBps": algbw * factor})
        if "raw" in med:
            row["ratio"] = med["unidist"] / med["raw"]
        rows.append(row)
        elapsed = time.perf_counter() - started
        left = elapsed / i * (len(cells) - i)
        say(f"collectives: [{i}/{len(cells)}] {op} {human_bytes(actual)}: {iters} calls x {args.rounds} rounds, "
            f"{_minutes(elapsed)} so far, about {_minutes(left)} left")
    return rows


def _progress(mgr: Manager) -> Callable[[str], None]:
    def say(line: str) -> None:
        if mgr.rank == 0:
            print(line, file=sys.stderr, flush=True)
    return say


def table(rows: list[dict[str, Any]], run_meta: dict[str, Any]) -> str:
    compare = any("raw_time_us" in r for r in rows)
    cols: list[Column] = [("op", "op", str), ("bytes", "size", human_bytes), ("iters", "iters", str),
                          ("time_us", "unidist us", fmt(2)), ("algbw_GBps", "algbw GB/s", fmt(3)),
                          ("busbw_GBps", "busbw GB/s", fmt(3))]
    if compare:
        cols += [("raw_time_us", "raw us", fmt(2)), ("raw_busbw_GBps", "raw busbw GB/s", fmt(3)),
                 ("ratio", "unidist/raw", fmt(2))]
    engine = engines.engine_name(run_meta["backend"])
    head = (f"collectives: backend={run_meta['backend']} launcher={run_meta['launcher']} ranks={run_meta['ranks']}"
            f", float32 sum, slowest rank's median of {rows[0]['rounds'] if rows else 0} interleaved rounds"
            + (f"; raw = {engine}" if compare else ""))
    return head + "\n\n" + markdown(cols, rows)
