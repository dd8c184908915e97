"""``unidist.compat.deepspeed``'s engine against real DeepSpeed 0.19.8, on every launcher (tests/workers/ds_engine.py).

The worker trains a small MLP with DeepSpeed's math switched fully on: 2 accumulation steps, WarmupLR, the default
gradient clipping at 1.0 with gradients of norm ~13 (so every step clips), Adam with decoupled weight decay and SGD
with momentum, ZeRO stages 0-3; it also runs ``no_sync``, and a checkpoint saved after the first epoch by one launch
is resumed by another launch at another ZeRO stage and world size; and a model built inside ``zero.Init`` (edited in
``GatheredParameters(modifier_rank=0)``) trains at ZeRO-3 as real DeepSpeed's own ``zero.Init`` does.

Real DeepSpeed exists only in the deepspeed tox env and horovodrun only in the horovod env, so the chain is:

- deepspeed env: real DeepSpeed under ``deepspeed --num_gpus 2`` (the reference) against compat under the deepspeed
  launcher (stages 0 and 3, and stage 2 with ``offload_optimizer``, which only DeepSpeed's engine does) and python
  (one process, every stage, resuming the deepspeed launch's checkpoint);
- py env: compat under python against compat under mpiexec-2 (every stage, resuming python's checkpoint);
  horovod env: the same with horovodrun --gloo (stages 0 and 3). torchrun is left to
  test_ds_examples.py (DeepSpeedExamples' script under torchrun-2 against real DeepSpeed) to keep CI short.

python's run is the anchor the three envs share. Tolerances (measured: weights 3e-8, losses 1.9e-6 at |loss| ~ 20,
learning rates exact): weights 1e-6, losses 1e-5 (2-rank runs only: one process computes its loss over both ranks'
rows), counters, boundaries, applied steps, the gradient-norm sequence (1e-4 relative) and data order exact.
Known difference: real DeepSpeed's ``get_global_grad_norm()`` is None at fp32 stage 0 (its optimizer wrapper there
measures nothing), and so it is under the deepspeed launcher; elsewhere the engine reports the norm it clipped by.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, WORKERS, Launch, require, results, run

WORKER = str(WORKERS / "ds_engine.py")
W_TOL, LOSS_TOL = 1e-6, 1e-5
ALL = "0,1,2,3"
Got = dict[int, dict[str, Any]]


def _launch(launch: Launch, out: Path, *args: str) -> Got:
    require(*launch.engines)
    out.mkdir(parents=True, exist_ok=True)
    proc = run(launch.command(WORKER, "--out", str(out), *args), env=launch.env, timeout=600)
    got = results(out, launch.size)
    assert proc.returncode == 0 and sorted(got) == list(range(launch.size)), proc.describe()
    return got


@pytest.fixture(scope="module")
def deepspeed_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Got]:
    """Real DeepSpeed and compat on the deepspeed launcher and python (one module-wide set of runs)."""
    tmp = tmp_path_factory.mktemp("ds-engine")
    ck = tmp / "ck"
    return {"real": _launch(LAUNCHES["deepspeed-2"], tmp / "real", "--real", "--stages", ALL),
            "deepspeed-2": _launch(LAUNCHES["deepspeed-2"], tmp / "ds", "--stages", "0,3", "--save", str(ck),
                                   "--offload"),
            "local-1": _launch(LAUNCHES["local-1"], tmp / "l1", "--stages", ALL, "--load", str(ck))}


def _anchor_and(launch_id: str, stages: str, tmp: Path) -> dict[str, Got]:
    ck = tmp / "ck"
    anchor = _launch(LAUNCHES["local-1"], tmp / "l1", "--stages", stages, "--save", str(ck))
    return {"real": anchor, launch_id: _launch(LAUNCHES[launch_id], tmp / "other", "--stages", stages,
                                                "--load", str(ck))}


@pytest.fixture(scope="module")
def mpi_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Got]:
    return _anchor_and("mpiexec-2", ALL, tmp_path_factory.mktemp("ds-engine-mpi"))


@pytest.fixture(scope="module")
def horovod_env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Got]:
    return _anchor_and("horovodrun-gloo-2", "0,3", tmp_path_factory.mktemp("ds-engine-hvd"))


ENVS = [pytest.param("deepspeed_env", marks=MARKS["deepspeed"]), pytest.param("mpi_env", marks=MARKS["mpi"]),
        pytest.param("horovod_env", marks=MARKS["horovod"])]


def _max_diff(a: dict[str, list[float]], b: dict[str, list[float]]) -> float:
    assert sorted(a) == sorted(b)
    return max(abs(x - y) for k in a for x, y in zip(a[k], b[k], strict=True))


def _mean_losses(got: Got, key: str, n: int) -> list[float]:
    """Each step's loss averaged over the ranks (the last ``n`` steps)."""
    per_rank = [cases[key]["losses"][-n:] for cases in got.values()]
    return [sum(ls) / len(ls) for ls in zip(*per_rank, strict=True)]


def _compared(runs: dict[str, Got]) -> list[tuple[str, int, str, dict[str, Any], dict[str, Any]]]:
    """(launch, rank, case, got, reference case) for every case of every compat launch."""
    ref = runs["real"][0]
    rows = []
    for launch_id, got in runs.items():
        if launch_id == "real":
            continue
        for rank, cases in got.items():
            for key, case in cases.items():
                if key.startswith("_"):
                    continue
                if not key.startswith("fp16/"):  # compared among the compat launches (below)
                    ref_key = key.replace("resume/", "train/Adam/").replace("offload/", "train/Adam/")
                    rows.append((launch_id, rank, key, case, ref[ref_key]))
    return rows


@pytest.mark.parametrize("env", ENVS)
def test_weights_and_losses_equal_real_deepspeed(env: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(env)
    seen = set()
    for launch_id, rank, key, case, ref in _compared(runs):
        assert _max_diff(case["weights"], ref["weights"]) <= W_TOL, (launch_id, rank, key)
        seen.add(key.split("/")[0])
        if key == "init/s3":  # built inside zero.Init: the parameters' own data holds next to nothing
            assert case["held"] < 0.05 and ref["held"] < 0.05, (launch_id, rank, case["held"])
        if "losses" not in case:
            continue
        moved = max(abs(w) for w in case["weights"]["0.weight"])
        assert moved > 0
        ref_key = key.replace("resume/", "train/Adam/").replace("offload/", "train/Adam/")
        n = len(case["losses"])
        if runs[launch_id][0]["_meta"]["size"] == runs["real"][0]["_meta"]["size"]:
            want, mine = runs["real"][rank][ref_key]["losses"][-n:], case["losses"]
        else:  # a step's micro-batch on one process is the two ranks' together (DistributedSampler's split)
            want, mine = _mean_losses(runs["real"], ref_key, n), _mean_losses(runs[launch_id], key, n)
        assert max(abs(a - b) for a, b in zip(mine, want, strict=True)) <= LOSS_TOL, (launch_id, rank, key)
    assert {"train", "nosync", "resume", "init"} <= seen
    assert ("offload" in seen) == (env == "deepspeed_env")


@pytest.mark.parametrize("env", ENVS)
def test_counters_schedule_and_clipping_follow_deepspeed(env: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(env)
    for launch_id, rank, key, case, ref in _compared(runs):
        if not key.startswith(("train/", "offload/")):
            continue
        assert case["boundary"] == ref["boundary"] == [False, True] * 8, (launch_id, key)
        assert case["applied"] == ref["applied"], (launch_id, key)
        assert case["scaled_loss"] == pytest.approx([0.5] * 16), (launch_id, key)  # backward returns loss / gas
        assert case["counters"] == ref["counters"] == {"global_steps": 8, "global_samples": 128,
                                                       "skipped_steps": 0}, (launch_id, key)
        assert case["lr"] == ref["lr"], (launch_id, key)  # WarmupLR stepped on applied steps only
        assert case["lr"][1] == [0.0] and case["lr"][-1][0] > 0.0  # WarmupLR starts at its minimum
        assert (case["training_flag"], case["eval_flag"]) == (True, False)
        for mine, theirs in zip(case["norms"], ref["norms"], strict=True):
            if mine is None:  # the deepspeed launcher at stage 0: DeepSpeed's own engine, which measures none
                assert theirs is None and launch_id == "deepspeed-2", (launch_id, key)
                continue
            assert mine > 1.0  # every step clipped (DeepSpeed's default gradient_clipping 1.0)
            if theirs is not None:  # None: real DeepSpeed at fp32 stage 0 measures no norm
                assert math.isclose(mine, theirs, rel_tol=1e-4), (launch_id, key, mine, theirs)
        q, rq = case["queries"], ref["queries"]
        size = runs[launch_id][0]["_meta"]["size"]
        assert q["train_batch_size"] == rq["train_batch_size"] == 16
        assert q["gas"] == rq["gas"] == 2 and q["stage"] == rq["stage"]
        assert q["micro"] == 16 // 2 // size and q["batches"] == 64 // size // q["micro"]
        assert (q["global_rank"], q["world_size"], q["local_rank"]) == (rank, size, rank)
        assert q["fp16"] is q["bf16"] is False and q["is_module"] and q["has_optimizer"] and q["has_scheduler"]
        if size == runs["real"][0]["_meta"]["size"]:
            theirs = runs["real"][rank][key.replace("offload/", "train/Adam/")]
            assert case["first_labels"] == theirs["first_labels"]  # DistributedSampler's order


@pytest.mark.parametrize("env", ENVS)
def test_checkpoint_resumes_across_launchers_and_stages(env: str, request: pytest.FixtureRequest) -> None:
    runs = request.getfixturevalue(env)
    resumed = [(launch_id, key, case) for launch_id, _, key, case, _ in _compared(runs) if key.startswith("resume/")]
    assert resumed
    for launch_id, key, case in resumed:
        loaded = case["loaded"]
        assert loaded["path_tag"] == "global_step4", (launch_id, key)  # DeepSpeed's default tag, from `latest`
        assert loaded["client_state"] == {"epoch": 1, "note": "after epoch 1"}
        assert loaded["global_steps"] == 4
        assert case["missing"] == [None, None]  # no `latest` file: DeepSpeed's (None, None)
    saver = next(got for got in runs.values() if any("latest" in c for c in got[0].values() if isinstance(c, dict)))
    assert next(c["latest"] for c in saver[0].values() if isinstance(c, dict) and "latest" in c) == "global_step4"


@pytest.mark.parametrize("env", ENVS)
def test_fp16_section_skips_the_overflowing_steps_on_every_launcher(env: str, request: pytest.FixtureRequest) -> None:
    """DeepSpeed's fp16 section (compat only: real DeepSpeed refuses fp16 on a CPU; the scale arithmetic is compared
    with DeepSpeed's own scaler classes in tests/unit/test_ds_loss_scale.py). Micro-steps 3, 6, 7 and 10 are made to
    overflow: optimizer steps 1, 3 and 5 are skipped, counted, leave the scheduler alone, and the scale sequence is
    the same on every launcher and rank."""
    runs = request.getfixturevalue(env)
    anchor = runs["local-1" if "local-1" in runs and env == "deepspeed_env" else "real"][0]
    seen = 0
    for launch_id, got in runs.items():
        for rank, cases in got.items():
            for key, case in cases.items():
                if not key.startswith("fp16/"):
                    continue
                seen += 1
                assert case["applied"] == [i not in (1, 3, 5) for i in range(8)], (launch_id, rank, key)
                assert case["skipped"] == [0, 1, 1, 2, 2, 3, 3, 3] and case["global_steps"] == 8
                lrs = [lr[0] for lr in case["lr"]]
                for i in (1, 3, 5):
                    assert lrs[i] == lrs[i - 1]  # not stepped on a skipped step
                assert lrs[-1] > lrs[0]
                scales = case["scale"]
                assert all(b in (a, a / 2) for a, b in itertools.pairwise(scales)), scales  # backs off
                assert scales[-1] < scales[0]
                assert case == anchor[key], (launch_id, rank, key)
    assert seen


@pytest.mark.mpi
def test_safe_get_helpers_gather_zeros_shards() -> None:
    """deepspeed.utils.safe_get_full_grad/_fp32_param/_optimizer_state at ZeRO 0-3 under mpiexec -n 2: each stage's
    full averaged gradient equals plain torch's on the whole batch (shards gathered at 1-3), and Adam's first
    moment after a step is 0.1 x it (tests/workers/ds_safe_get.py asserts on every rank)."""
    require("mpi4py")
    launch = LAUNCHES["mpiexec-2"]
    proc = run(launch.command(str(WORKERS / "ds_safe_get.py")), env=launch.env, timeout=300)
    assert proc.returncode == 0, proc.describe()
    for stage in range(4):
        for rank in range(2):
            assert f"rank {rank} stage {stage}: full gradients, parameters and exp_avg agree" in proc.stdout, \
                proc.describe()
