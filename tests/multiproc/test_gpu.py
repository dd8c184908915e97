"""GPU paths of the torch backend, under real torchrun; skipped with a reason where torch sees no CUDA device.

What a CPU machine cannot check for real is covered in tests/unit/test_gpu_backend.py with a stated mock.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from helpers import WORKERS, require, run, torchrun

pytestmark = [pytest.mark.torch, pytest.mark.gpu]


def _gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


@pytest.mark.skipif(_gpus() == 0, reason="needs a CUDA device; torch sees none on this machine")
def test_torch_backend_on_cuda(tmp_path: Path) -> None:
    require("torch")
    n = min(2, _gpus())  # nccl needs one GPU per rank
    proc = run(torchrun(n, str(WORKERS / "gpu_contract.py"), "--out", str(tmp_path)), timeout=600)
    assert proc.returncode == 0, proc.describe()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(n)]
    for rank, r in enumerate(reports):
        assert r["device"] == f"cuda:{rank}"
        assert r["param_spread"] == 0.0, r
        assert r["state_devices"] == [f"cuda:{rank}"], r  # broadcast optimizer state lands on this rank's GPU
        assert r["allgather"] == [[float(k), float(k)] for k in range(n) for _ in range(k + 1)]
        assert r["mean"] == pytest.approx((n - 1) / 2)
        assert r["object"] == {"from": n - 1}
        assert r["cpu_allreduce"] == [n * (n + 1) / 2] * 3
