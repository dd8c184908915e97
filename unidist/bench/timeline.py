"""``unidist timeline summarize PATH``: what a timeline (``UNIDIST_TIMELINE``) says about a run's communication.

Per call kind (name and group): calls, time and bytes per rank, algbw = bytes / time and busbw = algbw x
nccl-tests' factor for the call's ranks (bench/busbw.py); async launches and waits get no bandwidth (a wait
lasts as long as the rank arrived early). Per rank: time in communication, how often it was the last to
arrive at a world collective and the wait that cost the others (the slowest ranks first). And the share of
gradient communication hidden behind backward: each bucket's allreduce (or ZeRO reduce-scatter) is in
flight from its launch until its wait returns; the share is the part of those intervals that lies inside
``backward`` (``exposed`` is the time ranks then spent blocked in their waits). ``--plot out.png`` draws a
per-rank Gantt chart (bench/gantt.py). ``unidist timeline merge OUT PARTS...`` joins the per-rank parts a
failed job left behind.
"""

from __future__ import annotations

import argparse
import bisect
import json
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unidist.bench.busbw import busbw_factor
from unidist.bench.output import fmt, human_bytes, markdown

__all__ = ["add_arguments", "hidden_share", "kinds", "load", "main", "run", "slowest_ranks", "steps_window"]

_POINT = ("send", "recv")


def load(path: str | Path) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A trace's events (metadata events left out) and its ``otherData``."""
    with open(path) as f:
        doc = json.load(f)
    return [e for e in doc["traceEvents"] if e.get("ph") != "M"], doc.get("otherData", {})


def _ranks(events: Sequence[dict[str, Any]]) -> list[int]:
    return sorted({e["pid"] for e in events})


def kinds(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per (call name, group): per-rank means of count, seconds and bytes, and the bandwidths."""
    acc: dict[tuple[str, str], dict[str, Any]] = {}
    nranks = max(1, len(_ranks(events)))
    for e in events:
        if e.get("cat") not in ("call", "launch", "wait", "region"):
            continue
        args = e.get("args", {})
        key = (e["name"], args.get("group", "-"))
        row = acc.setdefault(key, {"call": e["name"], "group": key[1], "cat": e["cat"], "n": args.get("n", 0),
                                   "calls": 0, "us": 0.0, "bytes": 0})
        row["calls"] += 1
        row["us"] += e["dur"]
        row["bytes"] += args.get("bytes", 0)
    rows = []
    for row in sorted(acc.values(), key=lambda r: -r["us"]):
        seconds = row["us"] / 1e6
        algbw = row["bytes"] / seconds / 1e9 if row["cat"] == "call" and seconds > 0 and row["bytes"] else None
        rows.append({"call": row["call"], "group": row["group"], "calls": row["calls"] / nranks,
                     "seconds": seconds / nranks, "bytes": row["bytes"] / nranks, "algbw_GBps": algbw,
                     "busbw_GBps": None if algbw is None else algbw * busbw_factor(row["call"], row["n"])})
    return rows


def _top_level(spans: list[tuple[float, float]]) -> float:
    """Total length of spans sorted by start, nested ones counted once."""
    total, reach = 0.0, float("-inf")
    for start, end in spans:
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def slowest_ranks(events: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Per rank: communication seconds, the run's span, times last to arrive at a world collective and the
    seconds the others waited for it then (max start - median start); the rank costing most first. The
    collectives are matched by their order on each rank (every rank makes the same calls in the same order;
    when the sequences disagree, nothing is matched)."""
    ranks = _ranks(events)
    comm: dict[int, list[tuple[float, float]]] = defaultdict(list)
    seqs: dict[int, list[tuple[str, float]]] = defaultdict(list)
    first: dict[int, float] = {}
    last: dict[int, float] = {}
    for e in events:
        r = e["pid"]
        first[r] = min(first.get(r, e["ts"]), e["ts"])
        last[r] = max(last.get(r, e["ts"]), e["ts"] + e.get("dur", 0.0))
        if e.get("cat") in ("call", "launch", "wait", "region"):
            comm[r].append((e["ts"], e["ts"] + e["dur"]))
        if e.get("cat") == "call" and e["args"].get("group") == "world" and e["name"] not in _POINT:
            seqs[r].append((e["name"], e["ts"]))
    lasts, lag = dict.fromkeys(ranks, 0), dict.fromkeys(ranks, 0.0)
    names = {tuple(n for n, _ in seqs[r]) for r in ranks}
    if len(ranks) > 1 and len(names) == 1:
        for k in range(len(seqs[ranks[0]])):
            starts = sorted((seqs[r][k][1], r) for r in ranks)
            late = starts[-1][1]
            lasts[late] += 1
            lag[late] += (starts[-1][0] - starts[(len(starts) - 1) // 2][0]) / 1e6
    rows = [{"rank": r, "comm_s": _top_level(sorted(comm[r])) / 1e6, "span_s": (last[r] - first[r]) / 1e6,
             "last_arrivals": lasts[r], "others_waited_s": lag[r]} for r in ranks]
    return sorted(rows, key=lambda row: -row["others_waited_s"])


def _overlap(a: float, b: float, spans: list[tuple[float, float]], starts: list[float]) -> float:
    i, total = bisect.bisect_right(starts, b), 0.0
    while i > 0:
        i -= 1
        s, e = spans[i]
        if e <= a:
            break  # backward spans do not overlap each other: earlier ones end earlier
        total += max(0.0, min(b, e) - max(a, s))
    return total


def hidden_share(events: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """Gradient communication (the async launches inside ``bucket launch`` spans, each in flight until its
    wait returns): total in-flight seconds, the part inside ``backward``, their ratio, and the seconds spent
    blocked in those waits. None when the run launched no buckets (DeepSpeed, Horovod: their own exchanges)."""
    by_rank: dict[int, list[dict[str, Any]]] = defaultdict(list)
    for e in events:
        by_rank[e["pid"]].append(e)
    flight = inside = blocked = 0.0
    buckets = 0
    for evs in by_rank.values():
        backward = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] == "backward")
        launches = sorted((e["ts"], e["ts"] + e["dur"]) for e in evs if e["name"] == "bucket launch")
        starts, lstarts = [s for s, _ in backward], [s for s, _ in launches]
        waits = {e["args"]["id"]: e for e in evs if e.get("cat") == "wait" and "id" in e.get("args", {})}
        for e in evs:
            if e.get("cat") != "launch" or e["args"].get("id") not in waits:
                continue
            i = bisect.bisect_right(lstarts, e["ts"]) - 1
            if i < 0 or launches[i][1] < e["ts"] + e["dur"]:
                continue  # not a gradient bucket's launch
            wait = waits[e["args"]["id"]]
            a, b = e["ts"], wait["ts"] + wait["dur"]
            buckets += 1
            flight += b - a
            inside += _overlap(a, b, backward, starts)
            blocked += wait["dur"]
    if not buckets:
        return None
    return {"buckets": buckets, "in_flight_s": flight / 1e6, "hidden_s": inside / 1e6, "exposed_s": blocked / 1e6,
            "hidden_share": inside / flight if flight > 0 else 0.0}


def steps_window(events: Sequence[dict[str, Any]], first: int, end: int) -> tuple[float, float] | None:
    """The time window (ms) of rank 0's training steps ``first`` to ``end - 1``: from the start of its
    ``first``-th backward to the end of its ``end - 1``-th step (None when it recorded no such steps)."""
    backward = sorted(e["ts"] for e in events if e["pid"] == 0 and e["name"] == "backward")
    steps = sorted(e["ts"] + e["dur"] for e in events if e["pid"] == 0 and e["name"] == "step")
    if not 0 <= first < end <= min(len(backward), len(steps)):
        return None
    a, b = backward[first], steps[end - 1]
    margin = 0.03 * (b - a)
    return ((a - margin) / 1000, (b + margin) / 1000)


def run(path: str | Path) -> dict[str, Any]:
    """The summary of the trace at ``path`` (what ``summarize`` prints)."""
    events, meta = load(path)
    return {"ranks": _ranks(events), "dropped": meta.get("dropped", 0), "kinds": kinds(events),
            "slowest": slowest_ranks(events), "hidden": hidden_share(events)}


def _print(summary: dict[str, Any], path: str) -> None:
    print(f"# {path}: {len(summary['ranks'])} ranks"
          + (f" ({summary['dropped']} events dropped: raise UNIDIST_TIMELINE_EVENTS)" if summary["dropped"] else ""))
    print("\nPer call kind (per-rank means; busbw = algbw x nccl-tests' factor):\n")
    print(markdown([("call", "call", str), ("group", "group", str), ("calls", "calls", fmt(0)),
                    ("seconds", "time s", fmt(4)), ("bytes", "bytes", human_bytes),
                    ("algbw_GBps", "algbw GB/s", fmt(3)), ("busbw_GBps", "busbw GB/s", fmt(3))], summary["kinds"]))
    print("\nRanks, the one the others waited for most first:\n")
    print(markdown([("rank", "rank", str), ("comm_s", "in communication s", fmt(4)), ("span_s", "traced s", fmt(3)),
                    ("last_arrivals", "last to arrive", str), ("others_waited_s", "others waited s", fmt(4))],
                   summary["slowest"]))
    hidden = summary["hidden"]
    if hidden is None:
        print("\nGradient communication hidden behind backward: n/a (no bucket in flight during backward: the "
              "engine's own exchange, or buckets reduced one after another at the step on an engine that moves "
              "collectives only inside a wait, as MPI)")
    else:
        print(f"\nGradient communication hidden behind backward: {100 * hidden['hidden_share']:.1f}% of "
              f"{hidden['in_flight_s']:.4f} s in flight ({hidden['buckets']} bucket launches, all ranks); ranks "
              f"blocked {hidden['exposed_s']:.4f} s in their waits")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="action", required=True)
    p_sum = sub.add_parser("summarize", help="per call kind: count, time, bytes, algbw, busbw; slowest ranks; "
                                             "gradient communication hidden behind backward")
    p_sum.add_argument("path", help="the trace UNIDIST_TIMELINE wrote")
    p_sum.add_argument("--plot", help="also draw a per-rank Gantt chart to this PNG")
    p_sum.add_argument("--window", help="the plot's time window in ms, START:END (default: the whole run)")
    p_sum.add_argument("--steps", help="the plot's window as training steps A:B of rank 0 (from its A-th backward to "
                                       "the end of its (B-1)-th step, counting from 0)")
    p_sum.add_argument("--json", action="store_true", help="print the summary as JSON")
    p_merge = sub.add_parser("merge", help="join per-rank parts (<path>.rank<r>.json) into one trace")
    p_merge.add_argument("out")
    p_merge.add_argument("parts", nargs="+")


def main(ns: argparse.Namespace) -> int:
    if ns.action == "merge":
        from unidist.comm.trace_files import merge

        meta = merge(ns.parts, ns.out)
        print(f"{ns.out}: ranks {meta['ranks']}")
        return 0
    summary = run(ns.path)
    if ns.json:
        print(json.dumps(summary, indent=2))
    else:
        _print(summary, ns.path)
    if ns.plot:
        from unidist.bench.gantt import plot

        events = load(ns.path)[0]
        window = tuple(float(x) for x in ns.window.split(":")) if ns.window else None
        if ns.steps:
            window = steps_window(events, *(int(x) for x in ns.steps.split(":")))
        plot(events, ns.plot, window=window)  # type: ignore[arg-type]
        print(f"\nwrote {ns.plot}")
    return 0
