"""Checkpoints of a model with a Mixture-of-Experts layer (issue 46): saved under mpiexec with 4 ranks and the 4
experts over 4 (one a rank), resumed there to exactly the uninterrupted run's weights, and loaded under mpiexec with
2 ranks and the experts over 2 (two a rank): every expert's weights and Adam state land on the rank that now holds
that expert (tests/workers/moe_checkpoint.py computes where, from the placement rule, independently of unidist).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers import LAUNCHES, WORKERS, require, run

WORKER = WORKERS / "moe_checkpoint.py"


def _launch(ranks: int, ep: int, phase: str, tmp: Path) -> None:
    launch = LAUNCHES["mpiexec-2"].resized(ranks)
    proc = run(launch.command(str(WORKER), "--phase", phase, "--ep", str(ep), "--ckpt", str(tmp / "ck"), "--out",
                              str(tmp / "out")), env=launch.env, timeout=300)
    assert proc.returncode == 0, proc.describe()


def _merged(files: list[Path]) -> dict[str, torch.Tensor]:
    """The layer's whole state from each rank's snapshot (entries several ranks hold must agree)."""
    out: dict[str, torch.Tensor] = {}
    for f in files:
        for k, v in torch.load(f, weights_only=True).items():
            assert k not in out or torch.equal(out[k], v), k
            out[k] = v
    return out


@pytest.mark.mpi
def test_experts_resume_and_load_where_they_are_spread_otherwise(tmp_path: Path) -> None:
    require("mpi4py")
    (tmp_path / "out").mkdir()
    _launch(4, 4, "save", tmp_path)
    _launch(4, 4, "resume", tmp_path)
    _launch(2, 2, "load", tmp_path)
    out = tmp_path / "out"
    for r in range(4):
        final = torch.load(out / f"final-rank{r}.pt", weights_only=True)
        resumed = torch.load(out / f"resumed-rank{r}.pt", weights_only=True)
        assert final.keys() == resumed.keys()
        assert all(torch.equal(final[k], resumed[k]) for k in final), r  # bit for bit, experts included
    saved = _merged([out / f"saved-rank{r}.pt" for r in range(4)])
    experts = sorted(k for k in saved if ".deepspeed_experts." in k and not k.startswith("exp_avg"))
    assert len(experts) == 8  # 4 experts' weight and bias: the whole layer, each saved by the rank holding it
    # the experts started apart (a rank reading another's expert would show)
    assert not torch.equal(saved[experts[0]], saved[experts[2]])
    for r in range(2):
        loaded = torch.load(out / f"loaded-rank{r}.pt", weights_only=True)
        assert sum(".deepspeed_experts." in k for k in loaded) == 8  # 2 experts x (weight, bias) x (value, exp_avg)
        for k, v in loaded.items():
            assert torch.equal(saved[k], v), (r, k)
