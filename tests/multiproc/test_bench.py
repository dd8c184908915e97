"""Smoke tests of the benchmarks (`python -m unidist.bench`, `unidist bench`, benchmarks/regenerate.sh) under
real launchers. Not timing tests: tiny sizes, and every row must be there with positive numbers.

Each benchmark command of the docs (docs/benchmarks.md) runs as written with smoke options appended (the last
value of an option wins), so the docs' spelling is what is tested; `all` covers the three benchmarks in one
launch per launcher. Launches per tox env: py 2 (the docs' collectives, regenerate.sh --quick --runs mpi),
torch 2, deepspeed 1, horovod 2; and ``bench startup`` on each backend (two short launches each).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import sys
from pathlib import Path
from typing import Any

import pytest
from docsource import commands, runnable
from helpers import BIN, ROOT, deepspeed, mpiexec, require, run, torchrun

# the docs' <!-- run: bench --> blocks (docs/benchmarks.md), each command once
COMMANDS = list(dict.fromkeys(cmd for block in runnable("bench") for cmd in commands(block)))
SCRIPT = str(ROOT / "unidist" / "bench" / "__main__.py")

SMOKE = {
    "collectives": ["--sizes", "8,4K", "--rounds", "2", "--warmup", "1", "--budget", "0.01"],
    "gradsync": ["--scale", "0.05", "--iters", "1", "--rounds", "2", "--warmup", "1"],
    "train": ["--scale", "0.05", "--steps", "1", "--rounds", "2", "--warmup", "1", "--batch", "4",
              "--image-size", "32"],
}
SMOKE["all"] = ["--compare", *SMOKE["collectives"], "--scale", "0.05", "--iters", "1", "--steps", "1", "--batch", "4",
                "--image-size", "32"]
SMOKE["step"] = ["--layers", "1", "--width", "32", "--heads", "2", "--vocab", "128", "--seq", "16", "--batch", "2",
                 "--steps", "1", "--rounds", "2", "--warmup", "1"]
OPS = ("allreduce", "allgather", "broadcast", "reduce_scatter", "alltoall")


def _rows(path: Path) -> list[dict[str, Any]]:
    doc = json.loads(path.read_text())
    assert {"backend", "launcher", "ranks", "torch", "argv"} <= set(doc["meta"]), doc["meta"]
    return list(doc["rows"])


def check_collectives(rows: list[dict[str, Any]], backend: str, compare: bool) -> None:
    mine = [r for r in rows if r["bench"] == "collectives"]
    assert {(r["op"], r["bytes"]) for r in mine} == {(op, b) for op in OPS for b in (8, 4096)}, mine
    for r in mine:
        assert r["backend"] == backend and r["ranks"] == 2, r
        assert r["iters"] >= 1 and r["time_us"] > 0 and r["algbw_GBps"] > 0 and r["busbw_GBps"] > 0, r
        if compare:
            assert r["raw_time_us"] > 0 and r["raw_busbw_GBps"] > 0 and r["ratio"] > 0, r


def check_gradsync(rows: list[dict[str, Any]], methods: set[str]) -> None:
    mine = [r for r in rows if r["bench"] == "gradsync"]
    assert {(r["model"], r["tensors"]) for r in mine} == {("resnet50", 161), ("gpt2", 148)}, mine
    for model in ("resnet50", "gpt2"):
        assert {r["method"] for r in mine if r["model"] == model} == methods, mine
    assert all(r["unit_ms"] > 0 for r in mine), mine


def check_train(rows: list[dict[str, Any]], impls: set[str]) -> None:
    mine = [r for r in rows if r["bench"] == "train"]
    assert {r["impl"] for r in mine} == impls, mine
    assert all(r["samples_per_s"] > 0 and r["step_ms"] > 0 for r in mine), mine


def _table_cells(stdout: str, first: str) -> list[list[str]]:
    """Cells of the markdown rows starting with ``first`` (horovodrun prefixes each line with [rank])."""
    return [[c.strip() for c in line.split("|")[1:-1]] for line in stdout.splitlines()
            if re.search(rf"\| {re.escape(first)} \|", line)]


# ------------------------------------------------------------------------ the docs' commands
def _marks(cmd: str) -> list[pytest.MarkDecorator]:
    for word, mark in (("--backend torch", pytest.mark.torch), ("--backend horovod", pytest.mark.horovod),
                       ("--backend mpi", pytest.mark.mpi), ("regenerate.sh", pytest.mark.mpi)):
        if word in cmd:
            return [mark]
    return []


def _fake_results(where: Path) -> None:
    """Two runs' JSON files for the docs' plot command (no launch needed to test the plot)."""
    for backend, scale in (("mpi", 1.0), ("torch", 0.01)):
        rows = [{"bench": "collectives", "backend": backend, "launcher": "x", "ranks": 2, "op": op, "bytes": b,
                 "time_us": b / scale / 1e3, "busbw_GBps": scale, "raw_busbw_GBps": scale / 2}
                for op in OPS for b in (8, 4096, 1 << 20)]
        (where / f"{backend}.json").write_text(json.dumps({"meta": {"backend": backend, "launcher": "x"},
                                                           "rows": rows}))


def test_readme_bench_block_found() -> None:
    assert len(COMMANDS) >= 5 and any("regenerate.sh" in c for c in COMMANDS)


@pytest.mark.parametrize("cmd", [pytest.param(c, marks=_marks(c), id=c[:50]) for c in COMMANDS])
def test_readme_bench_command(cmd: str, tmp_path: Path) -> None:
    tokens = shlex.split(cmd)
    if "--backend mpi" in cmd or "regenerate.sh" in cmd:
        require("mpi4py")
    if "--backend horovod" in cmd:
        require("horovod")
    tokens = [sys.executable if t == "python" else str(BIN / "unidist") if t == "unidist" else t for t in tokens]
    env: dict[str, str] = {}
    if tokens[0] == "bash":  # regenerate.sh: the whole pipeline, tiny, one launcher, into tmp_path
        tokens[1] = str(ROOT / tokens[1])
        tokens += ["--quick", "--runs", "mpi", "--out-dir", str(tmp_path)]
        env["BENCH_BIN"] = str(BIN)
    elif "plot" in tokens:
        pytest.importorskip("matplotlib")
        _fake_results(tmp_path)
    else:
        bench = tokens[2]
        tokens += ([] if "--" in tokens else ["--"]) + SMOKE[bench]
        if bench == "step":
            tokens += ["--json", str(tmp_path / "step.json")]
    proc = run(tokens, env=env, cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.describe()
    if tokens[0] == "bash":
        rows = _rows(tmp_path / "results" / "mpi.json")
        check_collectives(rows, "mpi", compare=True)
        check_gradsync(rows, {"backward", "per_tensor", "raw_per_tensor", "fused"})
        check_train(rows, {"unidist"})
        text = (tmp_path / "RESULTS.md").read_text()
        assert "### Gradient sync" in text and "| mpi (mpich) | allreduce |" in text, text
        assert (tmp_path / "collectives.png").stat().st_size > 10_000
    elif "plot" in tokens:
        assert (tmp_path / "bandwidth.png").stat().st_size > 10_000, proc.describe()
    elif tokens[2] == "collectives":
        backend = tokens[tokens.index("--backend") + 1]
        check_collectives(_rows(tmp_path / tokens[tokens.index("--json") + 1]), backend, compare="--compare" in tokens)
        assert len(_table_cells(proc.stdout, "allreduce")) == 2, proc.stdout
        if "--plot" in tokens:
            assert (tmp_path / tokens[tokens.index("--plot") + 1]).stat().st_size > 10_000
    elif tokens[2] == "gradsync":
        cells = _table_cells(proc.stdout, "resnet50")
        assert [c[3] for c in cells] == ["backward only (no communication)", "mgr.allreduce_(grad, 'mean') per tensor",
                                         "torch.distributed allreduce per tensor",
                                         "prepare: unidist DistributedOptimizer", "torch DDP reducer (gloo)"], cells
        assert all(float(c[4]) > 0 for c in cells), cells
    elif tokens[2] == "train":
        cells = _table_cells(proc.stdout, "unidist") + _table_cells(proc.stdout, "horovod")
        assert len(cells) == 2 and all(float(c[4]) > 0 for c in cells), proc.stdout
    elif tokens[2] == "step":  # beside DDP and FSDP2 (the torch backend; deepspeed's columns: test_step_under_...)
        assert "| unidist-z3 |" in proc.stdout and "machine:" in proc.stdout, proc.stdout
        check_step(tmp_path / "step.json", "torch", 2, ["plain", "ddp", "fsdp2", *STAGES])


# ------------------------------------------------------------------------ `all` under the other launchers
@pytest.mark.torch
def test_all_under_torchrun(tmp_path: Path) -> None:
    """Collectives beside torch.distributed, gradsync with torch DDP's reducer, train beside DDP."""
    out = tmp_path / "torch.json"
    proc = run(torchrun(2, SCRIPT, "all", *SMOKE["all"], "--json", str(out)), timeout=600)
    assert proc.returncode == 0, proc.describe()
    rows = _rows(out)
    check_collectives(rows, "torch", compare=True)
    check_gradsync(rows, {"backward", "per_tensor", "raw_per_tensor", "fused", "ddp"})
    check_train(rows, {"unidist", "ddp"})


@pytest.mark.deepspeed
@pytest.mark.skipif(os.environ.get("FULL_MATRIX") != "1", reason="every benchmark under the deepspeed launcher "
                    "(passed 2026-11-29) runs with FULL_MATRIX=1; CI keeps the step benchmark there")
def test_all_under_deepspeed(tmp_path: Path) -> None:
    """By script path (the deepspeed launcher appends --local_rank=N), deepspeed.comm as the raw engine, the
    DeepSpeed engine as the fused method (prepare's default, and both reducers side by side), DDP on DeepSpeed's
    process group."""
    require("deepspeed")
    out = tmp_path / "ds.json"
    proc = run(deepspeed(2, SCRIPT, "all", *SMOKE["all"], "--json", str(out)), env={"DS_ACCELERATOR": "cpu"},
               timeout=600)
    assert proc.returncode == 0, proc.describe()
    rows = _rows(out)
    check_collectives(rows, "deepspeed", compare=True)
    check_gradsync(rows, {"backward", "per_tensor", "raw_per_tensor", "fused", "fused_engine", "fused_unidist", "ddp"})
    check_train(rows, {"unidist", "ddp"})


@pytest.mark.horovod
def test_all_horovod_under_mpiexec(tmp_path: Path) -> None:
    """Horovod over MPI: hvd.* as the raw engine, hvd.DistributedOptimizer as fused (prepare's default, beside
    reducer='engine' and reducer='unidist') and native trainer."""
    require("horovod")
    out = tmp_path / "hvd.json"
    proc = run(mpiexec(2, "-m", "unidist.bench", "all", *SMOKE["all"], "--json", str(out)),
               env={"UNIDIST_BACKEND": "horovod"}, timeout=600)
    assert proc.returncode == 0, proc.describe()
    rows = _rows(out)
    check_collectives(rows, "horovod", compare=True)
    check_gradsync(rows, {"backward", "per_tensor", "raw_per_tensor", "fused", "fused_engine", "fused_unidist"})
    check_train(rows, {"unidist", "horovod"})


# ------------------------------------------------------------------------ bench step (GPT-2, every column)
STEP_SMOKE = SMOKE["step"]
STAGES = [f"unidist-z{s}" for s in range(4)]


def check_step(path: Path, backend: str, ranks: int, columns: list[str]) -> None:
    doc = json.loads(path.read_text())
    assert doc["machine"].startswith("machine:"), doc["machine"]
    rows = {r["column"]: r for r in doc["rows"]}
    assert list(rows) == columns, list(rows)
    for name, r in rows.items():
        assert r["step_ms"] > 0 and r["peak_mb"] >= 0, r
        if name.startswith("unidist-z"):  # each stage beside plain, and beside the engines' own paths run here
            stage = name[-1]
            bases = ["plain", *(["ddp"] if stage == "0" and "ddp" in rows else []),
                     *(["fsdp2"] if stage == "3" and "fsdp2" in rows else []),
                     *(["ds"] if f"ds-z{stage}" in rows else [])]
            for base in bases:
                want = rows[name]["step_ms"] / rows[f"ds-z{stage}" if base == "ds" else base]["step_ms"]
                assert r[f"vs_{base}"] == pytest.approx(want), (name, base, r)
                assert f"mem_vs_{base}" in r, r


def test_step_one_process_through_the_cli(tmp_path: Path) -> None:
    """`unidist bench step` (its own launch: the mpi backend at 2 ranks) and by `python -m` at one process (the
    docs' command runs it under torchrun beside DDP and FSDP2: test_readme_bench_command)."""
    out = tmp_path / "cli.json"
    proc = run([str(BIN / "unidist"), "bench", "step", "--", *STEP_SMOKE, "--json", str(out)], timeout=600)
    assert proc.returncode == 0, proc.describe()
    assert "| unidist-z3 |" in proc.stdout and "machine:" in proc.stdout, proc.stdout
    check_step(out, "mpi", 2, ["plain", *STAGES])
    solo = tmp_path / "solo.json"
    proc = run([sys.executable, "-m", "unidist.bench.step", *STEP_SMOKE, "--json", str(solo)], timeout=600)
    assert proc.returncode == 0, proc.describe()
    check_step(solo, "local", 1, ["plain", *STAGES])


@pytest.mark.deepspeed
def test_step_under_deepspeed(tmp_path: Path) -> None:
    """Beside raw deepspeed.initialize with the config unidist generates, at every stage."""
    require("deepspeed")
    out = tmp_path / "ds.json"
    proc = run(deepspeed(2, SCRIPT, "step", *STEP_SMOKE, "--json", str(out)), env={"DS_ACCELERATOR": "cpu"},
               timeout=600)
    assert proc.returncode == 0, proc.describe()
    check_step(out, "deepspeed", 2, ["plain", "ddp", "fsdp2", *(f"ds-z{s}" for s in range(4)), *STAGES])


# ------------------------------------------------------------------------ bench startup (init beside the engine's)
@pytest.mark.parametrize("backend", [
    pytest.param("local", marks=pytest.mark.local), pytest.param("mpi", marks=pytest.mark.mpi),
    pytest.param("torch", marks=pytest.mark.torch), pytest.param("deepspeed", marks=pytest.mark.deepspeed),
    pytest.param("horovod", marks=pytest.mark.horovod)])
def test_startup_imports_no_training_layer(backend: str, tmp_path: Path) -> None:
    """``python -m unidist.bench.startup`` on the backend's main launch: the engine's own start and unidist's, each
    measured, and unidist's start imported none of the training layer, torch's compiler, sympy or transformers (the
    command exits 1 if it did)."""
    if backend in ("deepspeed", "horovod"):
        require(backend)
    out = tmp_path / "startup.json"
    proc = run([sys.executable, "-m", "unidist.bench.startup", "--backends", backend, "--rounds", "1",
                "--json", str(out)], env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.describe()
    assert f"| {backend} |" in proc.stdout and proc.stdout.startswith("machine:"), proc.stdout
    (row,) = json.loads(out.read_text())["rows"]
    assert row["backend"] == backend and row["unidist_heavy"] == [] and row["unidist_s"] > 0, row
    assert row["raw_s"] > 0 if backend != "local" else row["raw_s"] >= 0, row


# ------------------------------------------------------------------------ ds_scripts (beside DeepSpeed's own)
@pytest.mark.deepspeed
# the pipeline kind here; records.sh ds_scripts runs both kinds (their launch code is one)
@pytest.mark.parametrize("kind", ["pipeline"])
def test_ds_scripts_time_deepspeed_and_the_compat_layer(kind: str) -> None:
    """``python benchmarks/ds_scripts.py``, a tiny shape: DeepSpeed's engine under its launcher, then the compat
    layer under mpiexec (torchrun too in the records), each row with its ratio to DeepSpeed's."""
    require("deepspeed")
    proc = run([sys.executable, str(ROOT / "benchmarks" / "ds_scripts.py"), "--kind", kind, "--rounds", "1",
                "--steps", "1", "--warmup", "0", "--blocks", "2", "--width", "16", "--micro", "2",
                "--backends", "mpi"],
               env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.describe()
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[1].strip() for r in rows[1:]] == ["deepspeed", "mpich"], proc.stdout
    assert rows[1][3].strip() == "1.00" and all(float(r[2]) > 0 for r in rows[1:]), proc.stdout


# ------------------------------------------------------------------------ partitioned_build (zero.Init's memory)
@pytest.mark.deepspeed
@pytest.mark.skipif(os.environ.get("FULL_MATRIX") != "1", reason="FULL_MATRIX=1 (records.sh build runs it in full)")
def test_partitioned_build_table() -> None:
    """``python benchmarks/partitioned_build.py``, a tiny GPT-2: built whole, by unidist's zero.Init and by
    DeepSpeed's, each row a peak and a time (records.sh build measures GPT-2 medium)."""
    require("deepspeed", "transformers", "mpi4py")
    proc = run([sys.executable, str(ROOT / "benchmarks" / "partitioned_build.py"), "--ranks", "2", "--layers", "2",
                "--width", "128"], env={"DS_ACCELERATOR": "cpu"}, timeout=600)
    assert proc.returncode == 0, proc.describe()
    rows = [line.split("|")[1:-1] for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r[0].strip() for r in rows[1:]] == ["whole", "unidist", "deepspeed"], proc.stdout
    assert all(float(r[3]) > 0 for r in rows[1:]), proc.stdout
