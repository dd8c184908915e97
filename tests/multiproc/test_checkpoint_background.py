"""Background checkpoints (``save_checkpoint(..., blocking=False)``) under the real launchers.

tests/workers/checkpoint_background.py: a background save of step 3 written while the ranks train two more steps
(collectives on the training thread, the writer on its own) loads equal to a synchronous save of step 3; a
second save while one is in flight publishes the first; a save never waited for is published by the ``with``
exit; and a job SIGKILLed while its writers are mid-shard leaves the previous checkpoint, which loads equal to
what was saved.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from helpers import LAUNCHES, Launch, require, results, run

from unidist.checkpoint import latest_checkpoint

WORKER = "tests/workers/checkpoint_background.py"


def _run_phase(lch: Launch, tmp_path: Path, stage: int, *more: str) -> dict[int, dict[str, Any]]:
    out = tmp_path / "out"
    out.mkdir()
    proc = run(lch.command(WORKER, "--phase", "run", "--stage", str(stage), "--dir", str(tmp_path / "ck"),
                           "--out", str(out), *more), env=lch.env, timeout=300)
    assert proc.returncode == 0, proc.describe()
    res: dict[int, dict[str, Any]] = results(out, lch.size)  # type: ignore[assignment]
    assert sorted(res) == list(range(lch.size)), proc.describe()
    for rank, rep in res.items():
        assert (rep["backend"], rep["size"]) == (lch.backend, lch.size), rep
        assert rep["latest_before_wait"] == "None", (rank, rep)  # published by wait(), not before
        assert rep["waited"] == "step-3" and rep["published"], (rank, rep)
        assert rep["bg_vs_sync"] == 0.0, (rank, rep)  # the snapshot of step 3, not the weights trained on since
        assert rep["bg_vs_trained"] > 0.0, (rank, rep)
        assert rep["extra"] == {"step": 3}, (rank, rep)
        assert rep["first_published_by_second"] and rep["latest_in_flight"] == "step-5", (rank, rep)
        assert rep["latest_after"] == "step-6", (rank, rep)
    # the last save was never waited for: the Manager's exit published it (keep=2 removed step-5)
    bg = tmp_path / "ck" / "bg"
    assert latest_checkpoint(bg) == bg / "step-7"
    assert sorted(p.name for p in bg.iterdir()) == ["step-6", "step-7"]
    return res


@pytest.mark.mpi
def test_background_save_and_crash_mpiexec(tmp_path: Path) -> None:
    """mpiexec -n 2 at ZeRO stage 1: both ranks SIGKILLed with their writers mid-shard (slowed to 10 ms per
    write) while training on; the previous checkpoint (step 3) is the latest and loads equal to its synchronous
    twin; then the run phase (equal to a synchronous save, one in flight, exit publishes)."""
    lch = LAUNCHES["mpiexec-2"]
    require(*lch.engines)
    crashed = tmp_path / "crashed"
    proc = run(lch.command(WORKER, "--phase", "crash", "--stage", "1", "--dir", str(crashed)), env=lch.env,
               timeout=300)
    assert proc.returncode != 0 and not proc.timed_out, proc.describe()
    assert "killed mid-write" in proc.stdout, proc.describe()
    assert latest_checkpoint(crashed) == crashed / "step-3"
    unfinished = [p for p in crashed.iterdir() if p.name.startswith(".step-5.tmp-")]
    assert len(unfinished) == 1 and not (unfinished[0] / "manifest.json").exists(), proc.describe()
    assert sorted(p.name for p in unfinished[0].iterdir() if p.name.startswith("shard-")) == \
        ["shard-00000-of-00002.pt", "shard-00001-of-00002.pt"]
    res = _run_phase(lch, tmp_path, 1, "--crashed", str(crashed))
    for rank, rep in res.items():
        assert rep["crashed_latest"] == "step-3" and rep["crashed_step"] == 3, (rank, rep)
        assert rep["crashed_diff"] == 0.0, (rank, rep)


@pytest.mark.torch
def test_background_save_torchrun(tmp_path: Path) -> None:
    """torchrun 2 ranks (gloo) at ZeRO stage 3: the run phase."""
    lch = LAUNCHES["torchrun-2"]
    require(*lch.engines)
    _run_phase(lch, tmp_path, 3)

