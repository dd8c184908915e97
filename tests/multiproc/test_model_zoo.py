"""The model zoo (tests/zoo/) on every backend under its real launcher: N ranks on B/N rows train like one process.

tests/workers/model_zoo.py runs each (model, ZeRO stage, precision) cell with ``mgr.prepare`` and compares with one
plain-torch process computed on every rank (tests/zoo/reference.py). Every cell runs on the local, mpi and torch
backends (8-15 s a launch); DeepSpeed and Horovod (60-80 s for every cell) run tests/zoo/matrix.py's sample: every
model at ZeRO-3 in float32 and one more rotating cell. The whole matrix everywhere:

    ZOO_MATRIX=all python -m pytest tests/multiproc/test_model_zoo.py -m "local or mpi"     # and -m torch, ...

With ``ZOO_TABLE=FILE`` the tests append what they measured (JSON lines) for ``python -m unidist.bench.record --table
FILE``: benchmarks/records/model_zoo.md, which docs/models.md shows (benchmarks/records.sh regenerates it).

What only the engine decides is asserted as the engine does it, so a change shows: DeepSpeed's ZeRO gives a parameter
no rank used a zero gradient (it then moves by weight decay and momentum), where unidist, torch's DDP and one process
leave it None; Horovod's optimizer takes a sparse embedding's gradients, unidist's buckets and shards refuse them.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, main_launches, require, results, run, solo_launches
from zoo import matrix
from zoo.models import HAS_TRANSFORMERS, ZOO

from unidist.precisions import MODES

WORKER = str(WORKERS / "model_zoo.py")
ZOO_LAUNCHES = [k for k in [*solo_launches(), *main_launches(2)] if LAUNCHES[k].backend in matrix.BACKENDS]
EVERY_CELL = ("local", "mpi", "torch")  # cheap enough to run the whole matrix in CI
Zoo = tuple[Launch, Run, dict[int, dict[str, Any]]]


def _needs_transformers() -> None:
    """The Hugging Face models need transformers (the ``models`` extra); CI installs it, so a missing one fails
    there instead of skipping (REQUIRE_ENGINES)."""
    require("transformers")


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in ZOO_LAUNCHES])
def zoo(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Zoo:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    _needs_transformers()
    out = tmp_path_factory.mktemp(f"zoo-{request.param}")
    cells = "all" if matrix.full() or launch.backend in EVERY_CELL else "sample"
    proc = run(launch.command(WORKER, "--out", str(out), "--cells", cells, "--outputs"), env=launch.env, timeout=900)
    return launch, proc, results(out, launch.size)  # type: ignore[return-value]


def _cells(zoo: Zoo, model: str | None = None) -> list[tuple[str, dict[str, Any]]]:
    launch, proc, res = zoo
    assert proc.returncode == 0, proc.describe()
    assert sorted(res) == list(range(launch.size)), proc.describe()
    return [(f"rank {r} {k}", v) for r, report in res.items() for k, v in report.items()
            if not k.startswith("_") and (model is None or k.split("/")[0] == model)]


def test_every_cell_ran(zoo: Zoo) -> None:
    launch, _, res = zoo
    errors = [(where, cell["error"]) for where, cell in _cells(zoo) if "error" in cell]
    assert not errors, errors
    meta = res[0]["_meta"]
    assert meta["backend"] == launch.backend and meta["size"] == launch.size
    assert set(meta["models"]) == set(ZOO) if HAS_TRANSFORMERS else True
    assert {m for m, _, _ in meta["cells"]} == set(meta["models"])  # every model, on every backend


def _table(table: str, row: str, column: str, cell: str) -> None:
    """One measured cell for the record (``ZOO_TABLE``; nothing without it)."""
    path = os.environ.get("ZOO_TABLE")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps({"table": table, "row": row, "column": column, "cell": cell}) + "\n")


def _refused_here(model: str, backend: str, stage: int, precision: str) -> bool:
    """Where prepare must refuse the model: the sparse embedding everywhere but Horovod's own optimizer (stage 0,
    no master copies: those run on unidist's reducer)."""
    own = backend == "horovod" and stage == 0 and not MODES[precision].keeps_masters
    return ZOO[model].refused is not None and not own


def _engine_zero_fills(model: str, backend: str, stage: int) -> bool:
    """DeepSpeed's ZeRO gives unused parameters a zero gradient (see the module docstring)."""
    return bool(ZOO[model].never_used) and backend == "deepspeed" and stage > 0


@pytest.mark.parametrize("model", list(ZOO))
def test_trains_like_one_process(zoo: Zoo, model: str) -> None:
    """Per cell: the weights and buffers of one process (max |w - w_one_process|, float32 and bf16-mixed against
    tests/zoo/reference.py), identical on every rank, the output's type kept and its floats float32, frozen parameters
    unchanged with no optimizer state, unused ones unchanged, tied ones one tensor, and a checkpoint that loads into
    another stage to the same weights, still tied, and exports (``unidist checkpoint export``) to a safetensors file
    holding exactly those weights."""
    launch, _, _ = zoo
    if ZOO[model].transformers:
        _needs_transformers()
    cells = _cells(zoo, model)
    assert cells, f"{model} ran no cell on {launch.backend}"
    worst: dict[str, float] = {}
    for where, cell in cells:
        column = "ZeRO-{} {}".format(*where.split(" ")[-1].split("/")[1:])
        worst[column] = max(worst.get(column, 0.0), cell.get("diff", 0.0))
        if "refused" in cell:
            worst[column] = -1.0
    for column, diff in worst.items():
        mark = "*" if _engine_zero_fills(model, launch.backend, int(column.split()[0][-1])) else ""
        ranks = f"{launch.size} rank" + ("s" if launch.size > 1 else "")
        _table(f"{launch.backend} ({ranks}): max |w - w_one_process| after {matrix.STEPS} steps", model,
               column, "refused" if diff < 0 else ("0" if diff == 0 else f"{diff:.1e}{mark}"))
    for where, cell in cells:
        _, stage, precision = where.split(" ")[-1].split("/")
        if _refused_here(model, launch.backend, int(stage), precision):
            want = f"{ZOO[model].refused}: prepare(): emb is Embedding(sparse=True)"
            assert cell.get("refused", "").startswith(want), (where, cell)
            continue
        assert "refused" not in cell and "error" not in cell, (where, cell)
        assert cell["spread"] == 0.0, (where, cell)  # parameters and buffers identical on every rank
        assert cell["ints_equal"], (where, cell)  # BatchNorm's counters
        assert cell["out_type"] == cell["ref_type"], (where, cell)  # ModelOutput stays ModelOutput
        assert cell["out_floats"] == ["torch.float32"], (where, cell)  # outputs come back as float32
        assert cell["frozen_moved"] == 0.0 and cell["frozen_state"] == 0, (where, cell)
        assert cell["tied"], (where, cell)
        if _engine_zero_fills(model, launch.backend, int(stage)):
            # DeepSpeed's own rule (docs/models.md); a bfloat16 model's weights round the small move away (its
            # master copy holds it)
            assert cell["never_moved"] > 0.0 or MODES[precision].params != "float32", (where, cell)
            continue
        assert cell["never_moved"] == 0.0, (where, cell)
        assert cell["diff"] <= matrix.tolerance(launch.backend, int(stage), precision), (where, cell)
        if "roundtrip" in cell:
            rt = cell["roundtrip"]
            assert rt["diff"] == 0.0 and rt["tied"], (where, rt)
            assert rt["export"] == [0.0, True], (where, rt)  # `unidist checkpoint export`, read by safetensors
    # the LoRA model's frozen weights were there to check (and no other model has any)
    assert any(cell.get("frozen") for _, cell in cells) == (model == "lora"), model


def test_outputs_keep_their_type_in_every_precision(zoo: Zoo) -> None:
    """One forward per precision mode at stages 0 and 3: GPT-2's ModelOutput and a frozen dataclass holding a
    namedtuple and a dict come back as themselves, floats as float32, integer tensors untouched; only what the
    engine cannot run is refused (DeepSpeed: bf16-true under its ZeRO)."""
    launch, _, res = zoo
    for rank, report in res.items():
        got = {k: v for k, v in report.items() if k.startswith("outputs/")}
        assert len(got) == (16 if HAS_TRANSFORMERS else 8), (rank, sorted(got))
        for key, r in got.items():
            _, model, stage, precision = key.split("/")
            if launch.backend == "deepspeed" and precision == "bf16-true" and stage != "0":
                assert "not available on the deepspeed backend at ZeRO stage" in r["refused"], (key, r)
                continue
            assert "refused" not in r, (rank, key, r)
            want = "Frozen" if model == "nested" else "CausalLMOutputWithCrossAttentions"
            assert r["type"] == want and r["floats"] == ["torch.float32"], (rank, key, r)
            if model == "nested":
                assert r["inner"] == "Pair" and r["ints"] == ["torch.int64"], (rank, key, r)


def test_zero3_keeps_a_fraction_of_the_parameters_whole(zoo: Zoo) -> None:
    """unidist's ZeRO-3 (not DeepSpeed's, which the engine measures itself): the most parameter bytes whole at once
    during a step, after the first, against the model's (what stage 0 holds whole all the time). Gathering wherever a
    parameter is read must not cost the sharding. A block (each layer of a ModuleList) is one unit, held whole for its
    forward, as FSDP2 wraps blocks: these configs have 2 layers, so one block and the tied embedding are about half
    the model (measured 0.41-0.71 on the transformers at 2 ranks; 0.09-0.24 with a unit per module, which paid a
    collective per LayerNorm); a model of L blocks holds about 1/L of them."""
    launch, _, res = zoo
    if launch.backend == "deepspeed":
        pytest.skip("DeepSpeed's ZeRO-3 gathers with its own machinery")
    rows = []
    for key, cell in res[0].items():
        if key.endswith("/3/32") and "gathered_peak" in cell:
            rows.append((key.split("/")[0], cell["gathered_first"], cell["gathered_peak"], cell["param_total"]))
    assert rows, "no ZeRO-3 cell measured"
    for model, first, peak, total in rows:
        print(f"{launch.backend} {model}: first step {first / total:.3f}, then {peak / total:.3f} of {total} bytes")
        _table("ZeRO-3: the most parameter bytes whole at once in a step (after the first), of the model's (stage 0 "
               "holds them all)", model, f"{launch.backend}-{launch.size}", f"{peak / total:.2f}")
        if model in ("gpt2", "bert", "t5", "llama", "torch_encoder", "torch_transformer") and launch.size > 1:
            assert peak <= 0.75 * total, (model, peak, total)
        assert peak <= total + 64 * launch.size, (model, peak, total)  # never more than the whole model (+ padding)


# a checkpoint moves across backends, world sizes and stages: one launch saves, another resumes two stages on
# (CI: local to mpi; DeepSpeed's engine to one process, passed 2026-11-29, with FULL_MATRIX=1: its engine's saves are
# in CI through test_checkpoint.py's deepspeed-2 pair)
RESUME = {
    "local-to-mpi": ("local-1", "mpiexec-2", "gpt2:3:32,t5:1:32,shared:2:32,resnet_syncbn:0:32,lora:3:32", "mpi"),
    **({"deepspeed-to-local": ("deepspeed-2", "local-1", "gpt2:2:32,t5:3:32,shared:1:32,lora:2:32,resnet:1:32",
                               "deepspeed")} if os.environ.get("FULL_MATRIX") == "1" else {}),
}


@pytest.mark.parametrize("case", [pytest.param(k, marks=MARKS[v[3]]) for k, v in RESUME.items()])
def test_checkpoint_resumes_on_another_backend(case: str, tmp_path: Path) -> None:
    saver, loader, cells, _ = RESUME[case]
    first, second = LAUNCHES[saver], LAUNCHES[loader]
    require(*first.engines, *second.engines)
    _needs_transformers()
    saved, resumed = tmp_path / "saved", tmp_path / "resumed"
    saved.mkdir()
    resumed.mkdir()
    proc = run(first.command(WORKER, "--out", str(saved), "--cells", cells), env=first.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    proc = run(second.command(WORKER, "--out", str(resumed), "--cells", "none", "--resume-from", str(saved)),
               env=second.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    res = results(resumed, second.size)
    assert sorted(res) == list(range(second.size)), proc.describe()
    for rank, report in res.items():
        got = {k: v for k, v in report.items() if k.startswith("resume/")}
        assert len(got) == len(cells.split(",")), (rank, sorted(got))
        for key, r in got.items():
            assert r["diff"] == 0.0 and r["ints_equal"] and r["tied"] and r["spread"] == 0.0, (rank, key, r)
    print(json.dumps(res[0], indent=1))


# one GPU: every model, mixed stages and precisions, against the same process's reference on the same GPU (the worker
# makes CUDA's kernels deterministic); torchrun at one rank (nccl), so what it checks is the device path, not the
# reduction (two ranks on one GPU are test_gpu.py's)
GPU_CELLS = ("gpt2:0:32,gpt2:3:bf16-mixed,bert:2:bf16-mixed,t5:1:32,llama:3:bf16-mixed,torch_encoder:3:32,"
             "torch_transformer:3:bf16-mixed,resnet:3:bf16-mixed,resnet_syncbn:0:32,lora:3:32,branches:2:32,"
             "shared:3:32,parent_reads:3:32")


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.gpu
@pytest.mark.torch
@pytest.mark.skipif(_gpus() == 0 and os.environ.get("UNIDIST_TEST_GPU_REHEARSAL") != "1",
                    reason="needs a CUDA device; torch sees none on this machine")
def test_zoo_on_one_gpu(tmp_path: Path) -> None:
    """(UNIDIST_TEST_GPU_REHEARSAL=1 runs it on the CPU: tests/multiproc/test_gpu.py says why.)"""
    launch = LAUNCHES["torchrun-2"].resized(1)
    require(*launch.engines)
    _needs_transformers()
    proc = run(launch.command(WORKER, "--out", str(tmp_path), "--cells", GPU_CELLS, "--outputs"), env=launch.env,
               timeout=900)
    assert proc.returncode == 0, proc.describe()
    res = results(tmp_path, 1)
    assert res, proc.describe()
    for key, cell in res[0].items():
        if key.startswith("_"):
            continue
        if key.startswith("outputs/"):
            assert "refused" not in cell and cell["floats"] == ["torch.float32"], (key, cell)
            continue
        assert "error" not in cell and "refused" not in cell, (key, cell)
        _, stage, precision = key.split("/")
        assert cell["out_type"] == cell["ref_type"] and cell["tied"] and cell["never_moved"] == 0.0, (key, cell)
        assert cell["diff"] <= matrix.tolerance("torch", int(stage), precision), (key, cell)
        print(f"cuda {key}: max |w - w_one_process| {cell['diff']:.2e}")
