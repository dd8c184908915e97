"""Random generators and the loader's position travel in checkpoints (issue 47 part 4;
tests/workers/checkpoint_rng.py): a run with dropout, numpy noise and ``random`` draws, each rank seeded with its
rank, its data from a shuffled ``mgr.loader``, saved mid-epoch at step 4 and resumed in a new launch seeded otherwise,
reads the same rows at every later step and ends with exactly the weights of the uninterrupted 8 steps (and of the
writer's own continuation). Without the generators' restore the resumed run ended 0.13 away, and with a fresh
DataLoader iterator drawing its seed at the resume 0.17 away (both measured), so the equality can fail. Loaded by
one process, it reads the rest of the epoch (each remaining row once) and the log says which ranks got their
generators back.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from helpers import LAUNCHES, MARKS, WORKERS, require, run

WORKER = str(WORKERS / "checkpoint_rng.py")
# the generators and the position are the trainer's, one code for every engine: CI runs mpiexec at ZeRO-3; the other
# launchers (passed 2026-11-29) with FULL_MATRIX=1
CASES = [pytest.param("mpiexec-2", 3, marks=MARKS["mpi"]),
         *([pytest.param("deepspeed-2", 0, marks=MARKS["deepspeed"]),
            pytest.param("torchrun-2", 0, marks=MARKS["torch"]),
            pytest.param("horovodrun-gloo-2", 0, marks=MARKS["horovod"])] if os.environ.get("FULL_MATRIX") == "1"
           else [])]


def _phase(launch_id: str, tmp: Path, phase: str, stage: int) -> str:
    launch = LAUNCHES[launch_id]
    require(*launch.engines)
    proc = run(launch.command(WORKER, "--phase", phase, "--ckpt", str(tmp / "ck"), "--out", str(tmp),
                              "--stage", str(stage)), env=launch.env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    return proc.stdout + proc.stderr


def _weights(tmp: Path, kind: str, rank: int) -> dict[str, torch.Tensor]:
    return torch.load(tmp / f"{kind}-rank{rank}.pt", weights_only=True)  # type: ignore[no-any-return]


@pytest.mark.parametrize(("launch_id", "stage"), CASES)
def test_a_run_resumed_mid_epoch_with_dropout_equals_the_uninterrupted_one(launch_id: str, stage: int,
                                                                         tmp_path: Path) -> None:
    _phase(launch_id, tmp_path, "save", stage)
    _phase(launch_id, tmp_path, "resume", stage)
    rows = {(kind, r): _rows(tmp_path, kind, r) for kind in ("whole", "continued", "resumed") for r in range(2)}
    for rank in range(2):
        whole = _weights(tmp_path, "whole", rank)
        for kind in ("continued", "resumed"):
            got = _weights(tmp_path, kind, rank)
            assert all(torch.equal(got[k], whole[k]) for k in whole), (kind, rank)
            assert rows[kind, rank] == rows["whole", rank][4:], (kind, rank)  # the next batch, then the next epoch
    if launch_id == "mpiexec-2":  # the same checkpoint on one process: rank 0's generators, and the log says so
        said = _phase("local-1", tmp_path, "resume", stage)
        assert "random generator states restored on rank 0; the states of rank 1 of the 2 that wrote the " \
               "checkpoint have no rank here" in said, said
        # the rest of epoch 0 (the 2 ranks' steps 4-5 read it), each row once, in 4 batches of 4
        rest = sorted(i for r in range(2) for batch in rows["whole", r][4:6] for i in batch)
        alone = _rows(tmp_path, "resumed", 0)[:4]
        assert sorted(i for batch in alone for i in batch) == rest and len(set(rest)) == 16, (alone, rest)


def _rows(tmp: Path, kind: str, rank: int) -> list[list[int]]:
    return json.loads((tmp / f"{kind}-rows-rank{rank}.json").read_text())  # type: ignore[no-any-return]
