"""``unidist verify`` run as a user runs it, on real launchers: correct scripts agree, planted mistakes are caught
at the step, on the quantity and with the cause they must be, a failing launch is reported as one.

The scripts are tests/verify_scripts/ (each a second or two of CPU). Launches are sampled, one launch checks many
things: train_digits under every default launch (the ones ``unidist info --check`` finds usable here), each compat
script under two launchers, each planted mistake under one 2-rank launch (two for the DeepSpeed-only one, whose
other launch must agree). Each test carries the mark of the engine its launches need (tox runs each engine's
tests in its own environment) and fails, rather than skips, where REQUIRE_ENGINES names a missing engine.
Launches are found by their position in the report (the reference first, then the --launch values in order),
and every figure checked beside the report's is recomputed here from the fingerprint files it kept.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path
from typing import Any

import pytest
from helpers import BIN, ROOT, Run, require, run

UNIDIST = str(BIN / "unidist")
SCRIPTS = ROOT / "tests" / "verify_scripts"
MPIEXEC = "mpiexec -n 2"
TORCHRUN = "torchrun --standalone --nproc_per_node 2"
DEEPSPEED = "deepspeed --num_gpus 2 --no_local_rank"
HOROVODRUN = "horovodrun -np 2 -H localhost:2 --gloo"
FP32_TOL = 1e-4  # what `unidist verify --help` documents for float32 (the unit tests check each precision's)


def verify(tmp_path: Path, script: str | Path, *launches: str, args: tuple[str, ...] = ()
           ) -> tuple[Run, dict[str, Any]]:
    """``unidist verify --json`` (fingerprints kept in tmp_path); the run and its parsed report."""
    argv = [UNIDIST, "verify", "--json", "--timeout", "240", "--out-dir", str(tmp_path / "fingerprints")]
    for launch in launches:
        argv += ["--launch", launch]
    proc = run([*argv, str(script), *args], timeout=900)
    assert not proc.timed_out, proc.describe()
    try:
        result = json.loads(proc.stdout)
    except json.JSONDecodeError:
        pytest.fail(f"unidist verify --json printed no JSON:\n{proc.describe()}")
    assert [e["status"] for e in result["launches"]][:1] in (["reference"], ["failed"]), result
    assert len(result["launches"]) == len(launches) + 1 or not launches, result
    return proc, result


def fingerprint(result: dict[str, Any], index: int) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """The header and steps of launch ``index``'s fingerprint (0: the one-process run), read as plain JSON."""
    path = Path(result["fingerprints"]) / f"{result['launches'][index]['label']}.jsonl"
    lines = [json.loads(s) for s in path.read_text().splitlines() if s.strip()]
    return lines[0], lines[1:]


def brief(proc: Run, result: dict[str, Any]) -> str:
    """What to show when an assertion fails: each launch's status (a failed one's output tail) and stderr."""
    out = [f"exit {proc.returncode}, verdict {result.get('verdict')}"]
    for e in result["launches"]:
        out.append(f"- {e['label']}: {e['status']} {e.get('why') or ''} worst={e.get('worst')} "
                   f"divergence={e.get('divergence')}")
        if e["status"] == "failed":
            out += ["    " + line for line in str(e.get("tail")).splitlines()]
    return "\n".join(out) + f"\n--- stderr\n{proc.stderr[-3000:]}"


def assert_agrees(proc: Run, result: dict[str, Any], steps: int, worst: float = 1e-5) -> None:
    """Exit 0, every launch agrees over all ``steps`` steps, every worst difference finite and below ``worst``."""
    assert proc.returncode == 0 and result["verdict"] == "agree", brief(proc, result)
    assert result["launches"][0]["steps"] == steps, brief(proc, result)
    for entry in result["launches"][1:]:
        assert entry["status"] == "agrees" and entry["divergence"] is None, brief(proc, result)
        assert entry["steps"] == steps and len(entry["diffs"]) == steps, brief(proc, result)
        for quantity, value in entry["worst"].items():
            assert value is None or (math.isfinite(value) and value < worst), (entry["label"], quantity, value)
        assert entry["worst"]["params"] is not None and entry["worst"]["grad_norm"] is not None, entry["worst"]


def assert_diverged(proc: Run, result: dict[str, Any], index: int, step: int, quantity: str, cause: str
                    ) -> dict[str, Any]:
    """Exit 1; launch ``index`` diverged at ``step`` on ``quantity`` with a cause that says ``cause``; returns the
    divergence."""
    assert proc.returncode == 1 and result["verdict"] == "diverged", brief(proc, result)
    entry = result["launches"][index]
    assert entry["status"] == "diverged", brief(proc, result)
    found = entry["divergence"]
    assert (found["step"], found["quantity"]) == (step, quantity), brief(proc, result)
    assert any(cause in c for c in found["causes"]), found["causes"]
    return found  # type: ignore[no-any-return]


# --------------------------------------------------------------------------------- correct scripts agree
@pytest.mark.mpi
@pytest.mark.slow
def test_train_digits_agrees_under_every_default_launch(tmp_path: Path) -> None:
    """No --launch: one process, then each usable backend's main launch at 2 ranks; every one agrees."""
    require("mpi4py")
    proc, result = verify(tmp_path, ROOT / "examples" / "train_digits.py", args=("--epochs", "1"))
    # 1797 digits, 80% (1437) for training, global batch 48: 29 optimizer steps in one epoch, at any world size
    assert_agrees(proc, result, steps=1437 // 48)
    assert result["tolerance"] == FP32_TOL and result["launches"][0]["precision"] == "32"
    backends = [e["env"].get("UNIDIST_BACKEND") for e in result["launches"][1:]]
    required = {"mpi4py", "torch"} | set(os.environ.get("REQUIRE_ENGINES", "").replace(",", " ").split())
    expected = {b for b, engine in (("mpi", "mpi4py"), ("torch", "torch"), ("deepspeed", "deepspeed"),
                                    ("horovod", "horovod"))
                if engine in required or importlib.util.find_spec(engine) is not None}
    assert expected <= set(backends) and len(backends) == len(set(backends)), (expected, backends)
    for i, entry in enumerate(result["launches"][1:], start=1):
        header, steps = fingerprint(result, i)
        assert (header["backend"], header["world"]) == (entry["env"]["UNIDIST_BACKEND"], 2), header
        assert all(s["rows"] == 48 for s in steps), entry["label"]  # the ranks together saw the global batch


@pytest.mark.torch
def test_compat_deepspeed_script_agrees(tmp_path: Path) -> None:
    """deepspeed.initialize with a fixed train_batch_size and 2 accumulation steps, on unidist's engine under
    mpiexec and torchrun: both train the one-process model (DeepSpeed's own engine under the deepspeed launcher
    is sampled by the clipping test and the default launches)."""
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "compat_deepspeed.py", MPIEXEC, TORCHRUN)
    assert_agrees(proc, result, steps=6)
    for i in range(3):
        header, steps = fingerprint(result, i)
        assert (header["clip"], header["accumulation"]) == (0.5, 2), header  # the config's, on every launch
        assert all(s["rows"] == 16 and s["passes"] == 2 for s in steps), steps[0]
    assert [fingerprint(result, i)[0]["backend"] for i in (1, 2)] == ["mpi", "torch"]


@pytest.mark.horovod
def test_compat_horovod_script_agrees(tmp_path: Path) -> None:
    """hvd.DistributedOptimizer (no mgr.prepare in the script) records a fingerprint on every launch, and the
    launches train the one-process model."""
    require("horovod")
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "compat_horovod.py", MPIEXEC, HOROVODRUN)
    missing = [e["label"] for e in result["launches"] if "no fingerprint" in str(e.get("why"))]
    assert not missing, f"hvd.DistributedOptimizer recorded no fingerprint under {missing}:\n{brief(proc, result)}"
    assert_agrees(proc, result, steps=8)
    assert fingerprint(result, 2)[0]["backend"] == "horovod"


# --------------------------------------------------------------------------------- planted mistakes are caught
@pytest.mark.deepspeed
def test_clipping_in_a_deepspeed_only_config_diverges_under_deepspeed_only(tmp_path: Path) -> None:
    require("deepspeed")
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "clip_in_ds_config.py", MPIEXEC, DEEPSPEED)
    assert result["launches"][1]["status"] == "agrees", brief(proc, result)
    found = assert_diverged(proc, result, 2, step=1, quantity="params", cause="clips the gradient norm at 1.0")
    first = result["launches"][2]["diffs"][0]
    assert first["loss"] < FP32_TOL and first["grad_norm"] < FP32_TOL, first  # the norm is taken before clipping
    (ref_header, ref), (header, steps) = fingerprint(result, 0), fingerprint(result, 2)
    assert (ref_header["clip"], header["clip"], header["backend"]) == (None, 1.0, "deepspeed")
    assert ref[0]["grad_norm"] > 100, ref[0]  # well above the clip: the clipped update is far smaller
    diffs = {n: max(abs(a[0] - b[0]), abs(a[1] - b[1])) / b[0]
             for n, b in ref[0]["params"].items() for a in [steps[0]["params"][n]]}
    name = max(diffs, key=diffs.__getitem__)
    assert found["param"] == name and found["value"] == pytest.approx(diffs[name], rel=1e-9), (found, diffs)


@pytest.mark.torch
def test_a_shuffle_seeded_with_the_rank_diverges_at_step_1(tmp_path: Path) -> None:
    proc, result = verify(tmp_path, SCRIPTS / "rank_seed_shuffle.py", TORCHRUN)
    assert_diverged(proc, result, 1, step=1, quantity="loss", cause="data order that depends on the rank")
    (_, ref), (_, steps) = fingerprint(result, 0), fingerprint(result, 1)
    assert steps[0]["rows"] == ref[0]["rows"] == 16  # as many rows, other rows
    assert abs(steps[0]["inputs"] - ref[0]["inputs"]) > 1e-3, (steps[0]["inputs"], ref[0]["inputs"])


@pytest.mark.mpi
def test_every_rank_on_the_whole_batch_diverges_on_rows(tmp_path: Path) -> None:
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "no_shard.py", MPIEXEC)
    found = assert_diverged(proc, result, 1, step=1, quantity="rows", cause="a different effective batch")
    assert found["value"] == 2 * 16, found
    assert "saw 32 rows in step 1, the one-process run 16" in found["causes"][0], found["causes"]
    # the averaged gradient is the one-process one: only the rows show the mistake
    assert all(d["loss"] < FP32_TOL and d["params"] < FP32_TOL for d in result["launches"][1]["diffs"]), result


@pytest.mark.mpi
def test_an_fp16_overflow_on_the_whole_batch_only_diverges_on_skipped(tmp_path: Path) -> None:
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "fp16_overflow.py", MPIEXEC)
    found = assert_diverged(proc, result, 1, step=1, quantity="skipped", cause="fp16 overflow")
    assert any("the one-process run skipped step 1" in c for c in found["causes"]), found["causes"]
    assert result["tolerance"] == pytest.approx(2e-2)  # fp16-mixed's
    (ref_header, ref), (header, steps) = fingerprint(result, 0), fingerprint(result, 1)
    assert ref_header["precision"] == header["precision"] == "fp16-mixed"
    # the whole batch overflowed float16 and backed the scale off; each half did not
    assert (ref[0]["skipped"], ref[0]["loss_scale"], ref[0]["grad_norm"]) == (True, 2.0**15, None), ref[0]
    assert (steps[0]["skipped"], steps[0]["loss_scale"]) == (False, 2.0**16), steps[0]
    assert not any(s["skipped"] for s in ref[1:] + steps[1:])


# --------------------------------------------------------------------------------- a failing launch
@pytest.mark.mpi
def test_a_launch_that_fails_exits_2_with_its_output_tail(tmp_path: Path) -> None:
    require("mpi4py")
    proc, result = verify(tmp_path, SCRIPTS / "fails_on_rank1.py", MPIEXEC)
    assert proc.returncode == 2 and result["verdict"] == "failed", brief(proc, result)
    ref, launch = result["launches"]
    assert ref["status"] == "reference" and ref["steps"] == 4, ref
    assert launch["status"] == "failed" and launch["returncode"] not in (0, 124), launch
    assert "RuntimeError: planted failure on rank 1 at step 2" in launch["tail"], launch["tail"]
