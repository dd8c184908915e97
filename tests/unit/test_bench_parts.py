"""The benchmarks' pure parts, without launching: sizes, nccl-tests' factors, the model plans, argv handling,
the JSON format and the RESULTS.md rendering. The launches are in tests/multiproc/test_bench.py."""

from __future__ import annotations

import copy
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from unidist.bench import SUBCOMMANDS, drift
from unidist.bench.collectives import busbw_factor, default_sizes, parse_size
from unidist.bench.output import human_bytes, markdown, write_json
from unidist.bench.real_models import ShapeModel, gpt2_shapes, resnet, resnet50_shapes
from unidist.bench.report import BEGIN, END, render, targets, write_results


def test_sizes_and_units() -> None:
    sizes = default_sizes(4, 128 << 20)
    assert sizes[0] == 4 and sizes[-1] == 128 << 20
    assert {8, 2 << 20, 32 << 20, 64 << 10} <= set(sizes) and sizes == sorted(set(sizes))
    assert default_sizes(4, 4096) == [4, 8, 16, 64, 256, 1024, 4096]
    assert [parse_size(s) for s in ("4", "64K", "2MiB", "128M", "1g")] == [4, 65536, 2 << 20, 128 << 20, 1 << 30]
    with pytest.raises(Exception, match="not a size"):
        parse_size("2 parsecs")
    assert human_bytes(8) == "8 B" and human_bytes(2 << 20) == "2 MiB" and human_bytes(1536) == "1.5 KiB"


def test_busbw_factors_are_nccl_tests() -> None:
    assert busbw_factor("allreduce", 2) == 1.0 and busbw_factor("allreduce", 4) == 1.5
    for op in ("allgather", "reduce_scatter", "alltoall"):
        assert busbw_factor(op, 4) == 0.75
    assert busbw_factor("broadcast", 8) == 1.0


def test_model_plans_match_the_real_models() -> None:
    r50, gpt2 = resnet50_shapes(), gpt2_shapes()
    assert (len(r50), sum(math.prod(s) for _, s in r50)) == (161, 25_557_032)  # torchvision resnet50
    assert (len(gpt2), sum(math.prod(s) for _, s in gpt2)) == (148, 124_439_808)  # GPT-2 small
    assert dict(gpt2)["h.0.attn.c_attn.weight"] == (768, 2304) and dict(r50)["fc.weight"] == (1000, 2048)
    small = resnet50_shapes(0.05)
    assert len(small) == 161 and sum(math.prod(s) for _, s in small) < 100_000
    assert sum(p.numel() for p in resnet().parameters()) == 11_689_512  # torchvision resnet18


def test_shape_model_backward_fills_every_gradient() -> None:
    model = ShapeModel(gpt2_shapes(0.02))
    model(3.0).backward()
    assert all(p.grad is not None and bool((p.grad == 3.0).all()) for p in model.parameters())


def test_subcommands_listed_in_help() -> None:
    out = subprocess.run([sys.executable, "-m", "unidist.bench", "--help"], capture_output=True, text=True,
                         check=True).stdout
    assert all(name in out for name in SUBCOMMANDS)


def _doc(backend: str, launcher: str, ratio: float) -> dict[str, Any]:
    rows: list[dict[str, Any]] = [
        {"bench": "collectives", "op": "allreduce", "bytes": b, "time_us": 10.0 * ratio, "raw_time_us": 10.0,
         "ratio": ratio, "busbw_GBps": 1.0, "raw_busbw_GBps": 1.0 / ratio, "rounds": 3, "iters": 5}
        for b in (8, 64 << 10, 32 << 20, 128 << 20)]
    rows += [{"bench": "gradsync", "model": "resnet50", "method": m, "what": m, "unit_ms": 5.0, "sync_ms": 4.0,
              "ratio": r} for m, r in (("raw_per_tensor", 1.0), ("fused", 0.5))]
    rows.append({"bench": "train", "impl": "ddp" if backend == "torch" else "unidist", "samples_per_s": 100.0 / ratio,
                 "step_ms": 1.0})
    meta = {"backend": backend, "launcher": launcher, "ranks": 2, "date": "d", "torch": "t"}
    return {"meta": meta, "rows": [{**r, "backend": backend, "launcher": launcher, "ranks": 2} for r in rows]}


def test_targets_and_results_file(tmp_path: Path) -> None:
    docs = [_doc("mpi", "mpich", 0.25), _doc("torch", "torchrun", 1.0)]
    goals = {g["target"]: (g["measured"], g["met"]) for g in targets(docs)}
    assert goals["mpi allreduce 32 MiB: raw MPICH time / unidist >= 3x"] == ("4.00x", "yes")
    assert goals["mpi allreduce 8 B: unidist / raw mpi4py <= 1.3 (watchdog on)"] == ("0.25 (2.50 vs 10.00 us)", "yes")
    assert goals["mpi (mpich): ResNet-50 gradient sync (prepare's default) / raw per-tensor <= 0.7"] == ("0.50", "yes")
    assert goals["train: unidist on mpi >= 1.5x torch DDP (gloo, torchrun) samples/s"] == ("4.00x", "yes")
    md = tmp_path / "RESULTS.md"
    md.write_text(f"# kept\n\n{BEGIN}\nold\n{END}\n\ntail kept\n")
    pytest.importorskip("matplotlib")
    write_results(tmp_path, docs)
    text = md.read_text()
    assert text.startswith("# kept\n") and text.endswith("tail kept\n") and "old" not in text
    assert "| mpi (mpich) | allreduce |" in text and "### Gradient sync" in text
    assert (tmp_path / "collectives.png").stat().st_size > 10_000


def test_json_rows_carry_the_run(tmp_path: Path) -> None:
    path = tmp_path / "x" / "r.json"
    write_json(path, {"backend": "mpi", "launcher": "mpich", "ranks": 2, "extra": 1}, [{"bench": "train"}])
    doc = json.loads(path.read_text())
    assert doc["rows"] == [{"backend": "mpi", "launcher": "mpich", "ranks": 2, "bench": "train"}]
    assert markdown([("a", "A", str)], [{"a": 1}, {}]) == "| A |\n|---|\n| 1 |\n| - |"


def test_runs_table_says_when_the_machine_was_not_recorded() -> None:
    old = _doc("mpi", "mpich", 1.0)
    new = _doc("torch", "torchrun", 1.0)
    new["meta"]["machine"] = {"cpu_model": "Test CPU 9000", "cpus": 4, "cpus_usable": 2, "thp": "madvise",
                              "copy_GBps": 12.34, "copy_huge_share": 1.0}
    text = render([old, new])
    runs = text.split("### Runs")[1].split("###")[0]
    assert "| CPU | cores | THP | memory GB/s |" in runs
    assert "| not recorded | - | not recorded | not recorded |" in runs  # written before meta["machine"]
    assert "| Test CPU 9000 | 4 (2 usable) | madvise | 12.3 (100% huge pages) |" in runs


def test_drift_flags_a_moved_figure_and_not_an_unchanged_one() -> None:
    old = {"mpi": _doc("mpi", "mpich", 1.0)}
    new = {"mpi": copy.deepcopy(old["mpi"])}
    new["mpi"]["meta"]["date"] = "later"
    rows = new["mpi"]["rows"]
    rows[0]["time_us"] *= 1.5  # allreduce 8 B: slower by far more than the noise
    rows[1]["time_us"] *= 1.05  # allreduce 64 KiB: within the 10% noise
    rows[2]["time_us"] *= 1.5
    rows[2]["spread"] = 0.6  # 32 MiB: its own rounds disagree by more than it moved
    rows[3]["time_us"] /= 2  # 128 MiB: faster
    entries = drift.compare(old, new)
    moved = {(e["what"], e["size"]): e["moved"] for e in entries}
    assert moved[("allreduce", "8 B")] == "slower" and moved[("allreduce", "64 KiB")] == ""
    assert moved[("allreduce", "32 MiB")] == "" and moved[("allreduce", "128 MiB")] == "faster"
    assert moved[("fused", "resnet50")] == "" and len(entries) == 4 + 2 + 1  # gradsync and train rows match too
    text = drift.render(entries, old, new)
    assert "| mpi | 7 | 1 | 1 | 1 | not recorded -> not recorded | not recorded |" in text
    flagged = [line for line in text.splitlines() if line.endswith(("| slower |", "| faster |"))]
    assert len(flagged) == 2 and "| 128 MiB |" in flagged[0] and "| 0.50 |" in flagged[0]  # largest move first
    assert "| 8 B |" in flagged[1] and "| 1.50 |" in flagged[1]
    assert drift.compare(old, copy.deepcopy(old)) == []  # an unchanged file did not run again


def test_report_against_another_result_set_offline(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """`report --render-only --against DIR`: compares two result sets without running (no collectives rows
    here, so no plot and no matplotlib)."""
    from unidist.bench.__main__ import main

    def doc(step_ms: float) -> dict[str, Any]:
        d = _doc("mpi", "mpich", 1.0)
        d["rows"] = [{**r, "step_ms": step_ms} for r in d["rows"] if r["bench"] == "train"]
        return d

    for where, step_ms in (("other", 1.0), ("here/results", 2.0)):
        (tmp_path / where).mkdir(parents=True)
        (tmp_path / where / "mpi.json").write_text(json.dumps(doc(step_ms)))
    assert main(["report", "--render-only", "--out-dir", str(tmp_path / "here"), "--against",
                 str(tmp_path / "other")]) == 0
    out = capsys.readouterr().out
    assert "### Moved beyond noise" in out
    assert "| mpi | train | unidist | - | step_ms | 1 | 2 | 2.00 | - | slower |" in out
    assert "| not recorded | - | not recorded | not recorded |" in (tmp_path / "here" / "RESULTS.md").read_text()
