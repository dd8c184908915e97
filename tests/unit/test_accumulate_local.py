"""accumulate() on one process: the block's refusals, and the update of plain torch's accumulation."""

from __future__ import annotations

import pytest
import torch

import unidist
from unidist import Config, InvalidArgumentError, LaunchInfo

# the models and batches here are CPU tensors: the Manager is told the CPU, so that a GPU machine runs the same tests
CPU = Config(device="cpu")


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_block_equals_plain_accumulation(stage: int) -> None:
    x, y = torch.randn(6, 4) * 3, torch.randn(6, 2) * 10
    ref = _model()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for _ in range(2):
        for part in range(3):
            (torch.nn.functional.mse_loss(ref(x[2 * part:2 * part + 2]), y[2 * part:2 * part + 2]) / 3).backward()
        ref_opt.step()
        ref_opt.zero_grad()
    with unidist.LocalManager(CPU, LaunchInfo()) as mgr:
        model = _model()
        model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), zero_stage=stage)
        for _ in range(2):
            with mgr.accumulate(model):
                for part in range(3):
                    rows = slice(2 * part, 2 * part + 2)
                    mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / 3)
            opt.step()
            opt.zero_grad()
        got = mgr.full_state_dict(model)
    assert max(float((got[k] - v).abs().max()) for k, v in ref.state_dict().items()) <= 1e-6


def test_refusals() -> None:
    with unidist.LocalManager(CPU, LaunchInfo()) as mgr:
        model = _model()
        with pytest.raises(InvalidArgumentError, match="takes a model prepare\\(\\) returned"):
            mgr.accumulate(model)
        model, _ = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), backward_passes_per_step=2)
        with pytest.raises(InvalidArgumentError, match="use one of the two ways to accumulate"):
            with mgr.accumulate(model):
                pass
        other = _model()
        other, _ = mgr.prepare(other, torch.optim.SGD(other.parameters(), lr=0.1))
        with pytest.raises(InvalidArgumentError, match="do not nest"):
            with mgr.accumulate(other), mgr.accumulate(other):
                pass
