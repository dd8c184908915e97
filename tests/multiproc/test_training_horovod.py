"""hvd.DistributedOptimizer through HorovodManager under both Horovod launch modes."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import WORKERS, horovodrun, mpiexec, require, run

pytestmark = pytest.mark.horovod
LAUNCHERS: dict[str, tuple[Callable[..., list[str]], dict[str, str]]] = {
    "horovodrun-gloo": (horovodrun, {}),
    "mpiexec": (mpiexec, {"UNIDIST_BACKEND": "horovod"}),
}


@pytest.mark.parametrize("launcher", LAUNCHERS)
def test_distributed_optimizer_keeps_ranks_identical(launcher: str, tmp_path: Path) -> None:
    require("horovod")
    argv, env = LAUNCHERS[launcher]
    proc = run(argv(2, str(WORKERS / "horovod_optimizer.py"), "--out", str(tmp_path)), env=env, timeout=600)
    assert proc.returncode == 0, proc.describe()
    reports = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    for report in reports:
        assert report["backend"] == "horovod"
        for key in ("none-k1", "none-k2", "fp16-k1", "fp16-k2"):
            run_ = report[key]
            assert run_["max_spread"] == 0.0, (key, run_)  # parameters identical on both ranks after every step
            assert run_["losses"][-1] < 0.7 * run_["losses"][0], (key, run_)
        assert "compression='bf16' is unavailable" in report["bf16"]
    # accumulation over k=2 identical batches is the same update as k=1: the loss curves agree
    assert reports[0]["none-k1"]["losses"] == pytest.approx(reports[0]["none-k2"]["losses"], rel=1e-5)
