"""ZeRO stages 0-3 under the real launchers (tests/workers/zero.py): training equals one process on the full
batch and equals stage 0; consolidated state dicts; the memory each stage saves, per rank.

DeepSpeed runs its own engine's ZeRO (with group=, unidist's); every other backend runs unidist's.
"""

from __future__ import annotations

import json
import re
import sys
from typing import Any

import pytest
from helpers import BIN, LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run, solo_launches
from workers.zero import VARIANTS

WORKER = str(WORKERS / "zero.py")
# every backend's main launch, and its 3-rank one where it has one (uneven shards)
ZERO_LAUNCHES = [*solo_launches(), *main_launches(2), *(k for k, v in LAUNCHES.items() if v.size == 3 and not v.env)]
# float32 SGD momentum / Adam against one process; the fp16 wire rounds every gradient
PARAM_TOL = {"sgd": 1e-5, "adam": 1e-4, "adam_clip_k2_steplr": 1e-4, "fp16": 1e-3, "group": 1e-5, "adam_offload": 1e-4}
STATE_TOL = {"sgd": 1e-5, "adam": 1e-4, "adam_clip_k2_steplr": 1e-4, "fp16": 5e-3, "group": 1e-5, "adam_offload": 1e-4}
SLACK = 1024  # bytes: padding of each unit to N equal chunks, and one step counter per unit
Zero = tuple[Launch, Run, dict[int, dict[str, Any]]]


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in ZERO_LAUNCHES])
def zero(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Zero:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(request.param)
    proc = run(launch.command(WORKER, "--out", str(out)), env=launch.env, timeout=900)
    return launch, proc, results(out, launch.size)  # type: ignore[return-value]


def test_launch(zero: Zero) -> None:
    launch, proc, res = zero
    assert proc.returncode == 0, proc.describe()
    assert sorted(res) == list(range(launch.size)), proc.describe()
    assert res[0]["_meta"]["backend"] == launch.backend
    assert res[0]["_meta"]["numel"] > 40_000


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_equals_one_process_and_stage0(zero: Zero, variant: str, stage: int) -> None:
    launch, proc, res = zero
    assert sorted(res) == list(range(launch.size)), proc.describe()
    for rank in range(launch.size):
        got = res[rank][f"{variant}/stage{stage}"]
        assert "error" not in got, f"rank {rank}: {got.get('error')}"
        assert got["first_norm"] > 5, got  # gradient norms far above 1: an engine clipping at 1 would show
        assert got["diff"] <= PARAM_TOL[variant], (rank, got)
        assert got["vs_stage0"] <= PARAM_TOL[variant], (rank, got)
        assert got["spread"] == 0.0, (rank, got)  # ranks agree bitwise
        assert got["seen_vs_full"] == 0.0, (rank, got)  # full_state_dict == gathered parameters
        assert got["opt_diff"] <= STATE_TOL[variant], (rank, got)  # full_optimizer_state_dict, step counts too
        if VARIANTS[variant].base:  # offload: the same optimizer on the same numbers, only elsewhere
            assert got["vs_base"] == 0.0, (rank, got)
        # the host path ran (rehearsed on these CPU ranks) wherever unidist shards; DeepSpeed's CPU run is the no-op
        assert got["offloaded"] == (VARIANTS[variant].offload and stage > 0 and launch.backend != "deepspeed"), got


def test_stage3_prefetches_where_collectives_overlap(zero: Zero) -> None:
    """ZeRO-3 starts the next unit's gather while a unit computes (the previous one's in backward) where collectives
    move while the process computes (gloo, Horovod, the plug-in backend: ``mgr.overlaps``), and every prefetch is
    used; MPI (moved only inside a wait) and one rank start none."""
    launch, _, res = zero
    if launch.backend == "deepspeed":
        pytest.skip("DeepSpeed's ZeRO-3 prefetches with its own machinery")
    for rank in range(launch.size):
        started, used = res[rank]["adam/stage3"]["prefetch"]
        if launch.size > 1 and res[rank]["_meta"]["overlaps"]:
            assert started > 0 and used == started, (rank, started, used)
        else:
            assert started == 0, (rank, started)


def test_memory_per_stage(zero: Zero) -> None:
    """Adam over Psi fp32 parameters on N ranks: stage 1 keeps 1/N of the optimizer state, stage 2 also of
    the gradients, stage 3 also of the parameters (Rajbhandari et al. 2020). DeepSpeed also keeps an fp32
    master copy of its partition (4 Psi/N, counted as optimizer state) and, at stages 1-2, the partition's
    gradients twice (its averaged_gradients beside the master's .grad)."""
    launch, _, res = zero
    n = launch.size
    if n == 1:
        pytest.skip("one rank: nothing to shard")
    psi = res[0]["_meta"]["numel"]
    ds = launch.backend == "deepspeed"
    for rank in range(n):
        mem = {s: res[rank][f"adam/stage{s}"]["mem"] for s in range(4)}
        opt0 = mem[0]["optimizer_bytes"]
        assert opt0 >= 8 * psi, mem[0]  # exp_avg and exp_avg_sq in full
        master = 4 * psi / n if ds else 0
        for s in (1, 2, 3):
            assert mem[s]["optimizer_bytes"] <= opt0 / n + master + SLACK, (s, mem[s])
        grad_copies = 2 if ds else 1
        for s in (2, 3):
            assert mem[s]["grad_bytes"] <= grad_copies * 4 * psi / n + SLACK, (s, mem[s])
        assert mem[3]["param_bytes"] <= 4 * psi / n + SLACK, mem[3]
        assert mem[0]["param_bytes"] >= 4 * psi, mem[0]
        print(f"rank {rank} of {n} ({launch.backend}): " + json.dumps(mem))


# every backend through `unidist launch`, at its main launch's size
EXAMPLE_LAUNCHES = {v.backend: v for v in {**solo_launches(), **main_launches(2)}.values()}


# the example's flag on every backend at stage 3 (parameters sharded too), every stage on mpi: the stages' math
# on every engine is test_launch's (above); this is the example's wiring (10 launches fewer: ~100 s of CI)
EXAMPLE_CASES = [(b, s) for b in EXAMPLE_LAUNCHES for s in ((1, 2, 3) if b == "mpi" else (3,))]


@pytest.mark.parametrize(("backend", "stage"), [pytest.param(b, s, marks=MARKS[b]) for b, s in EXAMPLE_CASES])
def test_example_trains_with_zero(backend: str, stage: int) -> None:
    """examples/train_digits.py --zero-stage k through `unidist launch` on every backend: it learns, and the
    ranks end with the same whole model."""
    launch = EXAMPLE_LAUNCHES[backend]
    require(*launch.engines)
    n = launch.size
    proc = run([str(BIN / "unidist"), "launch", "-n", str(n), "--backend", backend, "examples/train_digits.py",
                "--epochs", "2", "--zero-stage", str(stage)], timeout=300)
    assert proc.returncode == 0, proc.describe()
    m = re.search(r"backend=(\w+) ranks=(\d) final test accuracy ([\d.]+) .* max parameter difference across "
                  r"ranks (\S+) \| rank 0 holds (\d+) parameter", proc.stdout)
    assert m, proc.describe()
    assert (m.group(1), int(m.group(2))) == (backend, n)
    assert float(m.group(3)) >= 0.85, m.group(0)  # 2 epochs; 0.94 measured
    assert float(m.group(4)) == 0.0, m.group(0)


@pytest.mark.mpi
def test_bench_zero_smoke() -> None:
    """`python -m unidist.bench.zero` (README) prints one row per stage; tiny sizes: a smoke test, not a timing."""
    require("mpi4py")
    proc = run([str(BIN / "mpiexec"), "-n", "2", sys.executable, "-m", "unidist.bench.zero", "--width", "64",
                "--layers", "2", "--steps", "1", "--rounds", "1"], timeout=300)
    assert proc.returncode == 0, proc.describe()
    rows = [line for line in proc.stdout.splitlines() if re.match(r"\| [0-3] \|", line)]
    assert len(rows) == 4, proc.describe()
