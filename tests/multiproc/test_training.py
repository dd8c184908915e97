"""One training loop on every backend: N ranks on B/N rows train exactly like one process on B rows.

tests/workers/equivalence.py trains a small MLP with ``mgr.prepare``/``mgr.backward``/``opt.step`` under
each real launcher and compares with plain single-process torch on the full batch, every rank computing
the reference itself. Parameters must also be identical across ranks after every step.
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, Run, require, run

TRAINING = [k for k, v in LAUNCHES.items() if "UNIDIST_CHECK_COLLECTIVES" not in v.env]  # checks change no math
# float32 end to end agrees to rounding (Adam's division by sqrt(v) amplifies it); compressed wires round every
# gradient once per step
TOLERANCE = {"plain": 1e-5, "k2": 1e-5, "fp16": 1e-3, "bf16": 5e-3, "sgd_big": 1e-5, "adam_clip": 1e-4,
             "sgd_steplr": 1e-5, "sgd_onecycle": 1e-5, "dropout": 1e-5, "roundtrip": 1e-4}
GENTLE = ("plain", "k2", "fp16", "bf16")


@pytest.fixture(scope="module", params=[pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in TRAINING])
def reports(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
            ) -> tuple[Launch, Run, list[dict[str, Any]]]:
    launch = LAUNCHES[request.param]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(f"eq-{request.param}")
    trace = out / "trace.json"  # the timeline's test reuses this launch (test_timeline_lists_exactly_the_calls_made)
    proc = run(launch.command(str(WORKERS / "equivalence.py"), "--out", str(out)),
               env={**launch.env, "UNIDIST_TIMELINE": str(trace)}, timeout=900)
    proc.trace = trace  # type: ignore[attr-defined]
    return launch, proc, [json.loads(p.read_text()) for p in sorted(out.glob("rank*.json"))]


def _ok(reports: tuple[Launch, Run, list[dict[str, Any]]]) -> tuple[Launch, list[dict[str, Any]]]:
    launch, proc, res = reports
    assert proc.returncode == 0, proc.describe()
    assert len(res) == launch.size, proc.describe()
    assert all(r["backend"] == launch.backend for r in res)
    return launch, res


@pytest.mark.parametrize("variant", list(TOLERANCE))
def test_matches_single_process_training(reports: tuple[Launch, Run, list[dict[str, Any]]], variant: str) -> None:
    launch, res = _ok(reports)
    for report in res:
        r = report[variant]
        if variant == "bf16" and launch.backend == "horovod":
            assert "compression='bf16' is unavailable" in str(r.get("refused")), r
            continue
        assert "refused" not in r, r
        if variant not in GENTLE:  # large enough for a default clip at 1.0 to change the result
            assert r["first_grad_norm"] > 5.0, r
        assert r["is_optimizer"], r  # isinstance(opt, torch.optim.Optimizer): LR schedulers accept it
        assert r["max_spread"] == 0.0, r  # every rank holds the same parameters after every step
        assert r["max_diff"] <= TOLERANCE[variant], r


def test_synchronize_then_step_reduces_once(reports: tuple[Launch, Run, list[dict[str, Any]]]) -> None:
    _, res = _ok(reports)
    for report in res:
        r = report["synchronize_once"]
        assert r["applied_minus_synchronized"] <= 1e-6, r  # step applied exactly the synchronized gradient
        assert r["synchronized_minus_expected"] <= 1e-4, r  # which is the sum (or mean) over ranks, once


def test_prepare_has_one_signature(reports: tuple[Launch, Run, list[dict[str, Any]]]) -> None:
    launch, res = _ok(reports)
    for report in res:
        r = report["api"]
        assert "prepare() got unknown keyword(s) 'config' (did you mean deepspeed_config=?)" in r["unknown"], r
        assert "clip_grad_norm" in r["unknown"] and "backward_passes_per_step" in r["unknown"], r
        assert r["untouched_after_error"], r  # refused before parameters were broadcast
        assert "did you mean clip_grad_norm=?" in r["ds_name"], r
        assert "clip_grad_norm=-1.0" in r["bad_clip"], r
        assert "op='max'" in r["bad_op"], r
        if launch.backend == "deepspeed":
            assert r["deepspeed_only"] == "accepted", r
        else:
            assert f"deepspeed backend only, and this run uses {launch.backend}" in r["deepspeed_only"], r
        assert r["unwrap_is_user_module"] and r["state_dict_keys_equal"], r
        for name in ("StepLR", "LambdaLR", "OneCycleLR", "CosineAnnealingLR"):
            assert r[name] == "ok", (name, r[name])


def test_backward_serves_the_model_whose_loss_it_is(reports: tuple[Launch, Run, list[dict[str, Any]]]) -> None:
    """Two prepared models interleaved, one accumulating 2 passes: each trains as one process on the whole batch
    (before: backward used the last prepared model's accumulation and, on DeepSpeed, its engine)."""
    _, res = _ok(reports)
    for report in res:
        assert report["two_models"]["a"] <= 1e-5 and report["two_models"]["b"] <= 1e-5, report["two_models"]


# unidist's own DistributedOptimizer (the backends whose record names no engine trainer of its own)
FEATURES = [k for k, v in LAUNCHES.items() if v.own_training and v.size > 1 and not v.env]


@pytest.mark.parametrize("name", [pytest.param(k, marks=MARKS[LAUNCHES[k].backend]) for k in FEATURES])
def test_optimizer_features(name: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    launch = LAUNCHES[name]
    require(*launch.engines)
    out = tmp_path_factory.mktemp(f"features-{name}")
    proc = run(launch.command(str(WORKERS / "optimizer_features.py"), "--out", str(out)), env=launch.env,
               timeout=600)
    assert proc.returncode == 0, proc.describe()
    res = [json.loads((out / f"rank{r}.json").read_text()) for r in range(launch.size)]
    for r in res:
        # a parameter without gradient on some ranks: no hang, ranks stay identical, several buckets used
        assert r["unused_parameters"]["spread"] == 0.0 and r["unused_parameters"]["buckets"] > 1, r
        # no_sync pass + synced pass == one step on the summed losses
        assert r["no_sync_equals_summed_loss"]["diff"] <= 1e-6, r
        assert r["no_sync_equals_summed_loss"]["spread"] == 0.0
        # a large gradient reduced in its own storage (MPI) or in a bucket (elsewhere): the ranks' mean either way
        big = r["large_gradient_in_place"]
        assert big["diff"] <= 1e-5 and big["spread"] == 0.0, big
        # 4.5 MB: past MPI's reduce_alone_from (1 MiB) and torch's (4 MiB); Horovod's reducer is hvd's own
        assert big["alone"] is (big["backend"] in ("mpi", "torch")), big
        # Adam state (tensors and step counts) from rank 0 everywhere
        assert r["optimizer_state"]["steps"] == [[2.0, 2.0]] * launch.size
        assert r["optimizer_state"]["exp_avg_spread"] == 0.0
        assert r["sampler"]["mean"] == pytest.approx((launch.size - 1) / 2)
    for epoch in res[0]["sampler"]["epochs"]:
        flat = [i for part in epoch for i in part]
        assert len({len(part) for part in epoch}) == 1  # equal shares
        assert set(flat) == set(range(103))  # everything covered (the tail wraps around)
    first, second = res[0]["sampler"]["epochs"]
    assert first != second  # reshuffled per epoch


def test_timeline_lists_exactly_the_calls_made(reports: tuple[Launch, Run, list[dict[str, Any]]]) -> None:
    """UNIDIST_TIMELINE on this very launch: one well-formed Chrome trace, monotonic per rank, whose engine
    calls and regions between the worker's two marks are as many as the watchdog counted (its own counter)."""
    launch, _ = _ok(reports)
    path = reports[1].trace  # type: ignore[attr-defined]
    if launch.size == 1:  # no peers, nothing to record
        assert not path.exists()
        return
    doc = json.loads(path.read_text())
    assert doc["otherData"]["ranks"] == list(range(launch.size)) and doc["otherData"]["dropped"] == 0
    events = [e for e in doc["traceEvents"] if e["ph"] != "M"]
    for rank in range(launch.size):
        mine = [e for e in events if e["pid"] == rank]
        stamps = [e["ts"] for e in mine]
        assert stamps == sorted(stamps) and all(e.get("dur", 0) >= 0 for e in mine), rank
        marks = [i for i, e in enumerate(mine) if e["name"] == "counted"]
        assert len(marks) == 2, (rank, marks)
        first, last = (mine[i]["args"]["calls"] for i in marks)
        calls = [e for e in mine[marks[0]:marks[1]] if e["cat"] in ("call", "launch", "wait", "region")]
        assert len(calls) == last - first > 0, (rank, len(calls), last - first)
        names = {e["name"] for e in calls}
        if launch.own_training and launch.backend == "mpi":
            # MPI moves a collective only inside a wait: the buckets are reduced one after another at the step
            assert "allreduce" in names, names
            assert {"backward", "step", "bucket launch"} <= {e["name"] for e in mine}
        elif launch.own_training:  # unidist's DistributedOptimizer: async bucket allreduces inside backward
            assert {"allreduce launch", "allreduce wait"} <= names, names
            assert {"backward", "step", "bucket launch", "bucket wait"} <= {e["name"] for e in mine}
        else:  # the engine's own exchange, recorded as a region
            assert any("gradient exchange" in n for n in names), names
