"""Tensor and pipeline parallelism under the real launchers (issue 14): mpiexec 2 and 4, torchrun 4,
horovodrun 2, deepspeed 2; the hybrid example under mpiexec 4 and torchrun 4.

One launch per launcher runs every case of tests/workers/parallel.py (each against the dense model trained
in-process on the whole batch); the cases are then asserted one by one.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import MARKS, ROOT, WORKERS, Launch, Run, main_launches, mpiexec, require, run

WORKER = str(WORKERS / "parallel.py")
# every backend's main launch at 2 ranks; 4-rank pipelines (and pairs of groups) on mpi and torch, sampled for time
RUNS = {**main_launches(2), **{k: v for k, v in main_launches(4).items() if v.backend in ("mpi", "torch")}}
CASES_2 = ["tp_world_parallel_io", "tp_world_gathered", "pipeline_2_gpipe", "pipeline_2_1f1b", "pipeline_2_gpipe_big",
           "pipeline_2_1f1b_big", "pipeline_2_1f1b_m2", "pipeline_2_tuple"]
CASES_4 = ["tp_world_parallel_io", "tp_world_gathered", "pipeline_4_gpipe", "pipeline_4_1f1b", "pipeline_4_gpipe_big",
           "pipeline_4_1f1b_big", "pipeline_4_1f1b_m2", "pipeline_4_tuple", "tp_pairs", "pipeline_pairs_gpipe",
           "pipeline_pairs_1f1b"]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[v.backend]) for k, v in RUNS.items()])
def launched(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
             ) -> tuple[Launch, Run, dict[int, dict[str, Any]]]:
    launch = RUNS[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launch.command(WORKER, "--out", str(out)), env=launch.env, timeout=600)
    reports = {r: json.loads((out / f"rank{r}.json").read_text()) for r in range(launch.size)
               if (out / f"rank{r}.json").exists()}
    return launch, proc, reports


@pytest.mark.parametrize("case", sorted(set(CASES_2) | set(CASES_4)))
def test_case(launched: tuple[Launch, Run, dict[int, dict[str, Any]]], case: str) -> None:
    launch, proc, reports = launched
    if case not in (CASES_4 if launch.size == 4 else CASES_2):
        pytest.skip(f"not a case at {launch.size} ranks")
    assert proc.returncode == 0 and len(reports) == launch.size, proc.describe()
    for rank, report in reports.items():
        assert report["backend"] == launch.backend
        got = report[case]
        assert got["result"] == "ok", f"rank {rank}: {got['result']}\n{got.get('trace', '')}"


def test_one_f_one_b_holds_fewer_activations(launched: tuple[Launch, Run, dict[int, dict[str, Any]]]) -> None:
    """GPipe keeps every micro-batch's activations (4) on every stage; 1F1B at most stages - stage index."""
    launch, proc, reports = launched
    assert proc.returncode == 0, proc.describe()
    s = launch.size
    gpipe = [reports[r][f"pipeline_{s}_gpipe"]["peak_activations"] for r in range(s)]
    one_f = [reports[r][f"pipeline_{s}_1f1b"]["peak_activations"] for r in range(s)]
    assert gpipe == [4] * s
    assert one_f == [min(s - r, 4) for r in range(s)], one_f
    assert sum(one_f) < sum(gpipe)


@pytest.mark.parametrize("name", [pytest.param("mpiexec-4", marks=pytest.mark.mpi),
                                  pytest.param("torchrun-4", marks=pytest.mark.torch)])
def test_hybrid_example_equals_single_process_training(name: str) -> None:
    """examples/hybrid_mlp.py (README): 2-way tensor x 2-way data parallel follows the dense model (1e-5)."""
    launch = RUNS[name]
    require(*launch.engines)
    proc = run(launch.command(str(ROOT / "examples" / "hybrid_mlp.py")), timeout=300)
    assert proc.returncode == 0, proc.describe()
    last = [line for line in proc.stdout.splitlines() if line.startswith("max |hybrid - dense|")]
    assert last and float(last[-1].rsplit(":", 1)[1]) <= 1e-5, proc.describe()


@pytest.mark.mpi
def test_parallel_bench_smoke() -> None:
    """`mpiexec -n 4 python -m unidist.bench.parallel` (README) prints both schedules' rows and the TP line;
    not a timing test: the peaks it prints are checked, the times only for being there."""
    require("mpi4py")
    proc = run(mpiexec(4, "-m", "unidist.bench.parallel", "--microbatches", "4", "--width", "32", "--batch", "16",
                       "--steps", "1"), timeout=300)
    assert proc.returncode == 0, proc.describe()
    rows = [line.split("|") for line in proc.stdout.splitlines() if line.startswith(("| gpipe", "| 1f1b"))]
    peaks = {r[1].strip(): r[7].strip() for r in rows}
    assert peaks == {"gpipe": "4 / 4 / 4 / 4", "1f1b": "4 / 3 / 2 / 1"}, proc.stdout
    assert "tensor parallel MLP" in proc.stdout, proc.stdout
