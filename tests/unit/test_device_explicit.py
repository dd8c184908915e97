"""Every unit test states the device it means: the unit suite passes on a machine that pretends to have a GPU.

On a GPU machine the local backend picks ``cuda:0`` (``UNIDIST_DEVICE=auto``) and DeepSpeed picks its CUDA
accelerator, so a test that builds CPU tensors without saying so fails there, and only there (issue 37: 70 failures
on an H100). A CPU machine finds them by running the suite with ``UNIDIST_TEST_PRETEND_CUDA=1``
(tests/conftest.py: torch then says it has one CUDA device, and whatever lets unidist or DeepSpeed choose gets
``cuda:0`` and fails with "Torch not compiled with CUDA enabled"). This test is that run, in a subprocess: the unit
suite without this file (no recursion) and without the doc test a fresh checkout fails for its own reason, with the
outer run's marker selection, and with DeepSpeed left to choose its accelerator as on a GPU machine (no
DS_ACCELERATOR: where it is exported as cpu, as tox's deepspeed env does, it would hide a test that leaves that
choice to the machine).
It doubles the unit suite's time (about 50 s more here). Where torch sees a real GPU it skips: there the unit suite
itself is the check.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().relative_to(ROOT).as_posix()
PRETEND = "UNIDIST_TEST_PRETEND_CUDA"  # tests/conftest.py
# fails on a fresh checkout for a reason of its own (not the device); the plain run reports it
UNRELATED = ("tests/unit/test_doc_blocks.py::test_paths_the_pages_name_exist",)
TAIL = 6000  # characters of the nested run's output shown on failure: its failures and short summary


@pytest.mark.skipif(torch.cuda.is_available(), reason="torch sees a real GPU: the unit suite itself is the check here")
@pytest.mark.skipif(os.environ.get(PRETEND) == "1", reason=f"this run already pretends ({PRETEND}=1): it is the check")
# the outer run's selection (a tox env's engines); the deepspeed-marked unit tests run only in the env that has
# DeepSpeed, which selects -m deepspeed: there this test runs them
@pytest.mark.parametrize("only", [None, pytest.param("deepspeed", marks=pytest.mark.deepspeed)])
def test_the_unit_suite_passes_where_torch_pretends_to_see_a_gpu(request: pytest.FixtureRequest, only: str | None
                                                                 ) -> None:
    args = [sys.executable, "-m", "pytest", "tests/unit", "-q", "-p", "no:cacheprovider", "-x", "--ignore", HERE]
    args += [arg for test in UNRELATED for arg in ("--deselect", test)]
    marks = only or request.config.getoption("markexpr")
    if marks:
        args += ["-m", marks]
    env = {name: value for name, value in os.environ.items() if name != "DS_ACCELERATOR"} | {PRETEND: "1"}
    proc = subprocess.run(args, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          timeout=1800, check=False)
    assert proc.returncode == 0, (
        f"the unit suite with {PRETEND}=1 exited {proc.returncode}: a test that fails only there lets unidist (or "
        "DeepSpeed) choose the device and feeds it CPU tensors; state the device (UNIDIST_DEVICE=cpu, "
        "Config(device='cpu'), DS_ACCELERATOR=cpu). A failure the plain run has too is not about the device.\n"
        f"{' '.join(args[1:])}\n...\n{proc.stdout[-TAIL:]}")
