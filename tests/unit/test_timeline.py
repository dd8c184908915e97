"""The timeline's parts without launching: the summary's arithmetic against hand-computed numbers, the merge
of per-rank parts (clocks of other hosts aligned), the event arguments, the hooks when off, the settings."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

from unidist.bench import timeline as summary
from unidist.bench.busbw import busbw_factor
from unidist.cli import main as cli
from unidist.comm import trace_files, trace_hooks
from unidist.comm.timeline import Recorder, describe
from unidist.config import Config
from unidist.errors import ConfigError
from unidist.ops import ReduceOp


def _x(pid: int, name: str, ts: float, dur: float, cat: str = "call", tid: int = 0, **args: Any) -> dict[str, Any]:
    return {"name": name, "cat": cat, "ph": "X", "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def _trace(tmp_path: Path, events: list[dict[str, Any]]) -> Path:
    path = tmp_path / "t.json"
    path.write_text(json.dumps({"traceEvents": events, "otherData": {"dropped": 0}}))
    return path


def test_busbw_factors_are_nccl_tests() -> None:
    assert busbw_factor("allreduce", 4) == 1.5 and busbw_factor("allreduce", 2) == 1.0
    for op in ("allgather", "reduce_scatter", "alltoall"):
        assert busbw_factor(op, 4) == 0.75
    assert busbw_factor("broadcast", 8) == busbw_factor("reduce", 8) == busbw_factor("barrier", 8) == 1.0


def test_kinds_bandwidth_by_hand(tmp_path: Path) -> None:
    events = []
    for pid in (0, 1):  # per rank: two 1 MB allreduces in 0.5 + 1.5 ms, one 3 MB allgather in 1 ms, on 4 ranks
        events += [_x(pid, "allreduce", 0, 500, group="world", n=4, bytes=1_000_000),
                   _x(pid, "allreduce", 600, 1500, group="world", n=4, bytes=1_000_000),
                   _x(pid, "allgather", 3000, 1000, group="world", n=4, bytes=3_000_000),
                   _x(pid, "allreduce launch", 5000, 10, cat="launch", group="world", n=4, bytes=8, id=0)]
    rows = {r["call"]: r for r in summary.run(_trace(tmp_path, events))["kinds"]}
    ar, ag = rows["allreduce"], rows["allgather"]
    assert ar["calls"] == 2 and ar["seconds"] == pytest.approx(0.002) and ar["bytes"] == 2_000_000
    assert ar["algbw_GBps"] == pytest.approx(1.0) and ar["busbw_GBps"] == pytest.approx(1.5)  # x 2(n-1)/n
    assert ag["algbw_GBps"] == pytest.approx(3.0) and ag["busbw_GBps"] == pytest.approx(2.25)  # x (n-1)/n
    assert rows["allreduce launch"]["busbw_GBps"] is None  # a launch's time is not the transfer's


def test_hidden_share_and_slowest_rank(tmp_path: Path) -> None:
    # rank 0: backward 0-100 us; a bucket launched at 50 (its allreduce launch inside), waited 150-170: in flight
    # 50-170 (120 us), of which 50-100 inside backward; rank 1 reaches each barrier 10 us after rank 0
    events = [_x(0, "backward", 0, 100, cat="train", tid=1), _x(0, "bucket launch", 50, 2, cat="train", tid=1),
              _x(0, "allreduce launch", 50, 1, cat="launch", group="world", n=2, bytes=4, id=7),
              _x(0, "allreduce wait", 150, 20, cat="wait", group="world", n=2, bytes=4, id=7),
              _x(0, "allreduce launch", 300, 1, cat="launch", group="world", n=2, bytes=4, id=8),  # no bucket
              _x(0, "allreduce wait", 400, 5, cat="wait", group="world", n=2, bytes=4, id=8)]
    for k in range(3):
        events += [_x(0, "barrier", 1000 * k, 12, group="world", n=2), _x(1, "barrier", 1000 * k + 10, 2,
                                                                           group="world", n=2)]
    got = summary.run(_trace(tmp_path, events))
    hidden = got["hidden"]
    assert hidden["buckets"] == 1 and hidden["in_flight_s"] == pytest.approx(120e-6)
    assert hidden["hidden_share"] == pytest.approx(50 / 120) and hidden["exposed_s"] == pytest.approx(20e-6)
    slow = got["slowest"]
    assert slow[0]["rank"] == 1 and slow[0]["last_arrivals"] == 3 and slow[0]["others_waited_s"] == pytest.approx(30e-6)
    assert slow[1]["last_arrivals"] == 0


def _recorder(path: str, rank: int, boot: str, align_ns: int, starts: list[int], limit: int = 100) -> Recorder:
    rec = Recorder(path, rank, 2, limit)
    rec.boot, rec.align_ns = boot, align_ns
    for s in reversed(starts):  # recorded in the order they end: the part is sorted by start
        rec.add(s, s + 1000, "comm", "call", "barrier", {"group": "world", "n": 2, "bytes": 0})
    return rec


def test_merge_aligns_other_hosts_only(tmp_path: Path) -> None:
    path = str(tmp_path / "trace.json")
    parts = [trace_files.write_part(_recorder(path, 0, "A", 5_000_000, [5_000_000, 9_000_000])),
             # another host whose clock reads 1 s more at the same barrier exit
             trace_files.write_part(_recorder(path, 1, "B", 1_005_000_000, [1_005_000_000, 1_010_000_000]))]
    meta = trace_files.merge(parts, path)
    assert meta["shift_us"] == {"0": 0.0, "1": -1_000_000.0}
    events, _ = summary.load(path)
    assert [(e["pid"], e["ts"]) for e in events] == [(0, 0.0), (0, 4000.0), (1, 0.0), (1, 5000.0)]
    # the same host: no shift, whatever the barrier exits say
    parts[1] = trace_files.write_part(_recorder(path, 1, "A", 5_000_300, [5_000_500]))
    assert trace_files.merge(parts, path)["shift_us"]["1"] == 0.0
    assert [e["ts"] for e in summary.load(path)[0] if e["pid"] == 1] == [0.5]


def test_a_full_recorder_counts_what_it_drops(tmp_path: Path) -> None:
    rec = _recorder(str(tmp_path / "t.json"), 0, "A", 0, list(range(0, 5000, 1000)), limit=3)
    assert len(rec.events) == 3 and rec.dropped == 2
    trace_files.merge([trace_files.write_part(rec)], str(tmp_path / "t.json"))
    assert summary.run(tmp_path / "t.json")["dropped"] == 2


def test_event_arguments_follow_nccl_tests_sizes() -> None:
    send, recv = torch.zeros(4), torch.zeros(8)
    assert describe("allgather", (send, recv, [4, 4]), "world", 2) == {
        "group": "world", "n": 2, "bytes": 32, "dtype": "float32"}
    got = describe("reduce_scatter_async", (recv, send, [4, 4], ReduceOp.SUM), "group 0,1", 2)
    assert got["bytes"] == 32 and got["op"] == "sum" and got["group"] == "group 0,1"
    assert describe("send", (send, 1, 0), "world", 2)["peer"] == 1
    assert describe("grouped_allreduce", ([send, recv], ReduceOp.MAX, True), "world", 2)["bytes"] == 48
    assert describe("barrier", (), "world", 3) == {"group": "world", "n": 3, "bytes": 0}


def test_hooks_do_nothing_when_off() -> None:
    assert not trace_hooks.active and trace_hooks.recorder() is None
    assert trace_hooks.span("backward", bytes=torch.zeros(2)) is trace_hooks.span("step")  # one shared no-op
    trace_hooks.mark("stall", call="allreduce")
    assert trace_hooks.flush() is None


def test_settings() -> None:
    cfg = Config.from_env({"UNIDIST_TIMELINE": "/tmp/x.json", "UNIDIST_TIMELINE_EVENTS": "1000"})
    assert cfg.timeline == "/tmp/x.json" and cfg.timeline_events == 1000
    assert Config.from_env({}).timeline is None and Config.from_env({}).timeline_events == 200_000
    with pytest.raises(ConfigError, match="UNIDIST_TIMELINE_EVENTS"):
        Config.from_env({"UNIDIST_TIMELINE_EVENTS": "0"})


def test_cli_summarizes_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    path = _trace(tmp_path, [_x(0, "allreduce", 0, 100, group="world", n=2, bytes=100),
                             _x(1, "allreduce", 5, 95, group="world", n=2, bytes=100)])
    assert cli(["timeline", "summarize", str(path), "--plot", str(tmp_path / "g.png")]) == 0
    out = capsys.readouterr().out
    assert "| allreduce | world | 2 |" not in out and "| allreduce | world | 1 |" in out  # per-rank means
    assert (tmp_path / "g.png").stat().st_size > 1000


def test_mark_and_flush_keep_a_part(tmp_path: Path) -> None:
    """What the watchdog and the stall inspector call before they end a job: the mark is in this rank's part."""
    rec = Recorder(str(tmp_path / "t.json"), 1, 2, 100)
    trace_hooks.install(rec)
    try:
        with trace_hooks.span("bucket wait", bytes=torch.zeros(4)):
            trace_hooks.mark("stall", call="allreduce", waited=31.5)
        part = trace_hooks.flush()
    finally:
        trace_hooks.uninstall()
    assert part == str(tmp_path / "t.json.rank1.json")
    events = json.loads(Path(part).read_text())["traceEvents"]
    assert [(e["name"], e["ph"], e["pid"]) for e in events] == [("bucket wait", "X", 1), ("stall", "i", 1)]
    assert events[0]["args"] == {"bytes": 16} and events[1]["args"] == {"call": "allreduce", "waited": 31.5}
    assert not trace_hooks.active


def test_cli_merges_parts_a_failed_job_left(tmp_path: Path) -> None:
    path = str(tmp_path / "t.json")
    parts = [trace_files.write_part(_recorder(path, r, "A", 0, [1000 * r + 5000])) for r in (0, 1)]
    assert cli(["timeline", "merge", str(tmp_path / "joined.json"), *parts]) == 0
    events, meta = summary.load(tmp_path / "joined.json")
    assert meta["ranks"] == [0, 1] and [(e["pid"], e["ts"]) for e in events] == [(0, 0.0), (1, 1.0)]
