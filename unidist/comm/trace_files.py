"""The timeline's files: each rank's part, the clocks aligned, and rank 0's merge into one Chrome trace.

Each rank writes ``<path>.rank<r>.json``, a Chrome trace of its own (so the parts a failed job flushed are
readable one by one, and ``unidist timeline merge`` joins them). Times are CLOCK_MONOTONIC, one clock for every
process of a host; ranks on another host (another boot id) are shifted so that the exits of the start barrier
coincide (a barrier's exits are within a network latency of each other, microseconds to a millisecond). At
shutdown every rank writes its part, rank 0 receives the parts it cannot see (another host, no shared
directory) over the communicator and streams the merge into ``path``, one event at a time: pid = rank, one
tid per stream (engine calls, training spans, marks).
"""

from __future__ import annotations

import json
import os
import socket
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Protocol, TextIO

import torch

__all__ = ["STREAMS", "Recorder", "boot_id", "call_args", "collect", "merge", "part_path", "write_part"]

STREAMS = {"comm": 0, "train": 1, "marks": 2}  # tid of each stream, and its name in the trace
_STREAM_NAMES = {0: "engine calls", 1: "training", 2: "marks"}


class Recorder(Protocol):
    """What a part is written from (comm/timeline.py's recorder)."""

    path: str
    rank: int
    size: int
    events: list[tuple[int, int, str, str, str, Any]]
    dropped: int
    align_ns: int
    boot: str
    pid: int


class _Comm(Protocol):
    rank: int
    size: int

    def barrier(self) -> None: ...

    def broadcast_object(self, obj: Any, root: int = 0) -> Any: ...

    def send(self, x: Any, dest: int, tag: int = 0) -> None: ...

    def recv(self, x: Any, source: int, tag: int = 0) -> Any: ...


def boot_id() -> str:
    """This host's kernel boot id: processes with the same one share CLOCK_MONOTONIC."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return socket.gethostname()


def part_path(path: str, rank: int) -> str:
    return f"{path}.rank{rank}.json"


def call_args(t: tuple[Any, ...]) -> dict[str, Any]:
    """An engine call's arguments from the tuple the recording engine keeps (comm/timeline.py's _FAST),
    the dtype and op objects it holds named."""
    group, n, nbytes, dtype, op, key, peer, ident = t
    out: dict[str, Any] = {"group": group, "n": n, "bytes": nbytes}
    if dtype is not None:
        out["dtype"] = str(dtype).removeprefix("torch.")
    if op is not None:
        out["op"] = op.value
    if key:
        out[key] = peer
    if ident >= 0:
        out["id"] = ident
    return out


def _event(e: tuple[int, int, str, str, str, Any], rank: int, shift_us: float) -> dict[str, Any]:
    start, end, stream, cat, name, args = e
    if not isinstance(args, dict):
        args = call_args(args)
    out: dict[str, Any] = {"name": name, "cat": cat, "ph": "X", "ts": start / 1000 + shift_us,
                           "dur": (end - start) / 1000, "pid": rank, "tid": STREAMS[stream], "args": args}
    if cat == "mark":
        out["ph"], out["s"] = "i", "t"
        del out["dur"]
    return out


def write_part(rec: Recorder) -> str:
    """Write ``rec``'s events so far, sorted by start (parents before their children), as this rank's part."""
    events = sorted(rec.events, key=lambda e: (e[0], -e[1]))
    path = part_path(rec.path, rec.rank)
    meta = {"unidist_timeline": 1, "rank": rec.rank, "size": rec.size, "boot": rec.boot,
            "host": socket.gethostname(), "pid": rec.pid, "align_us": rec.align_ns / 1000, "dropped": rec.dropped}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    with open(path + ".tmp", "w") as f:
        _stream(f, (_event(e, rec.rank, 0.0) for e in events), meta)
    os.replace(path + ".tmp", path)
    return path


def _stream(f: TextIO, events: Iterable[dict[str, Any]], meta: dict[str, Any]) -> None:
    f.write('{"traceEvents": [\n')
    first = True
    for e in events:
        f.write(("" if first else ",\n") + json.dumps(e, separators=(",", ":")))
        first = False
    f.write('\n], "displayTimeUnit": "ms", "otherData": ' + json.dumps(meta) + "}\n")


def collect(comm: _Comm, rec: Recorder) -> str | None:
    """At shutdown, on every rank together: write the parts, bring those rank 0 cannot read to it (over
    ``comm``), and merge them into ``rec.path`` on rank 0 (returned there; None elsewhere)."""
    mine = write_part(rec)
    comm.barrier()
    missing = [r for r in range(comm.size) if not os.path.exists(part_path(rec.path, r))] if comm.rank == 0 else []
    missing = comm.broadcast_object(missing)
    for r in missing:  # another host's part, sent as bytes
        if comm.rank == r:
            data = torch.frombuffer(bytearray(Path(mine).read_bytes()), dtype=torch.uint8)
            comm.send(torch.tensor([data.numel()], dtype=torch.int64), 0)
            comm.send(data, 0)
            os.remove(mine)  # rank 0 has it now
        elif comm.rank == 0:
            n = torch.zeros(1, dtype=torch.int64)
            comm.recv(n, r)
            buf = torch.empty(int(n.item()), dtype=torch.uint8)
            comm.recv(buf, r)
            Path(part_path(rec.path, r)).write_bytes(buf.numpy().tobytes())
    if comm.rank != 0:
        return None
    parts = [part_path(rec.path, r) for r in range(comm.size)]
    merge(parts, rec.path)
    for p in parts:
        os.remove(p)
    return rec.path


def merge(parts: Sequence[str], out: str) -> dict[str, Any]:
    """Join per-rank parts into one trace at ``out``; returns its metadata. The first part's rank sets the
    clock: parts from another boot are shifted so their start-barrier exits coincide with its, and times
    start at 0."""
    metas = [_meta(p) for p in parts]
    ref = metas[0]
    shifts = [0.0 if m["boot"] == ref["boot"] else ref["align_us"] - m["align_us"] for m in metas]
    origin = min((_first_ts(p) + s for p, s in zip(parts, shifts, strict=True)), default=0.0)
    origin = 0.0 if origin == float("inf") else origin  # no events at all
    meta = {"unidist_timeline": 1, "ranks": [m["rank"] for m in metas], "size": ref["size"],
            "hosts": [m["host"] for m in metas], "dropped": sum(m["dropped"] for m in metas),
            "shift_us": dict(zip((str(m["rank"]) for m in metas), shifts, strict=True))}

    def events() -> Iterable[dict[str, Any]]:
        for p, m, s in zip(parts, metas, shifts, strict=True):
            r = m["rank"]
            yield {"name": "process_name", "ph": "M", "pid": r, "args": {"name": f"rank {r} ({m['host']})"}}
            yield {"name": "process_sort_index", "ph": "M", "pid": r, "args": {"sort_index": r}}
            for tid, name in _STREAM_NAMES.items():
                yield {"name": "thread_name", "ph": "M", "pid": r, "tid": tid, "args": {"name": name}}
            with open(p) as f:
                for e in json.load(f)["traceEvents"]:
                    if "ts" in e:
                        e["ts"] = round(e["ts"] + s - origin, 3)
                    yield e
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    with open(out + ".tmp", "w") as f:
        _stream(f, events(), meta)
    os.replace(out + ".tmp", out)
    return meta


def _meta(part: str) -> dict[str, Any]:
    """A part's metadata, read from its tail (written last)."""
    with open(part, "rb") as f:
        f.seek(max(0, os.path.getsize(part) - 4096))
        tail = f.read().decode(errors="replace")
    return dict(json.loads(tail[tail.rindex('"otherData": ') + len('"otherData": '):].rstrip().removesuffix("}")))


def _first_ts(part: str) -> float:
    with open(part) as f:
        f.readline()
        line = f.readline().rstrip(",\n")
    return float(json.loads(line)["ts"]) if line.startswith("{") else float("inf")
