"""unidist's SyncBatchNorm against torch's BatchNorm on the whole batch: forward, input and parameter gradients,
running statistics, eval, conversion. The ranks are threads over a tiny in-process communicator (the real
launchers run it in tests/multiproc/test_model_zoo.py, resnet_syncbn)."""

from __future__ import annotations

import copy
import pickle
import threading
from typing import Any

import pytest
import torch

from unidist.errors import InvalidArgumentError
from unidist.train.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm


class ThreadComm:
    """Rank ``rank`` of ``size`` threads: allgather (dim 0) and sum-allreduce through a shared board."""

    def __init__(self, rank: int, size: int, board: dict[str, Any], barrier: threading.Barrier) -> None:
        self.rank, self.size, self._board, self._barrier = rank, size, board, barrier

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        self._barrier.wait()
        self._board[self.rank] = x.clone()
        self._barrier.wait()
        got = [self._board[r] for r in range(self.size)]
        self._barrier.wait()
        return got

    def allgather(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x))

    def allreduce(self, x: torch.Tensor, op: str = "sum") -> torch.Tensor:
        assert op == "sum"
        return torch.stack(self._exchange(x)).sum(0)


def _ranks(size: int, work: Any) -> list[Any]:
    board: dict[str, Any] = {}
    barrier = threading.Barrier(size)
    results: list[Any] = [None] * size
    errors: list[BaseException] = []

    def run(rank: int) -> None:
        try:
            results[rank] = work(ThreadComm(rank, size, board, barrier))
        except BaseException as err:  # reported below
            errors.append(err)
            barrier.abort()
    threads = [threading.Thread(target=run, args=(r,)) for r in range(size)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


@pytest.mark.parametrize(("size", "shape", "momentum"), [(2, (8, 3, 5, 5), 0.1), (3, (9, 4), None),
                                                          (2, (6, 2, 3, 3, 3), 0.3)])
def test_whole_batch_statistics_and_gradients(size: int, shape: tuple[int, ...], momentum: float | None) -> None:
    torch.manual_seed(0)
    x = 3 * torch.randn(*shape, dtype=torch.float64).float() + 2.0  # a mean far from 0: the variance must not cancel
    upstream = torch.randn(*shape)
    cls = {2: torch.nn.BatchNorm1d, 4: torch.nn.BatchNorm2d, 5: torch.nn.BatchNorm3d}[len(shape)]
    ref = cls(shape[1], momentum=momentum)
    with torch.no_grad():
        ref.weight.uniform_(0.5, 1.5)
        ref.bias.uniform_(-0.5, 0.5)
    start = copy.deepcopy(ref)
    xr = x.clone().requires_grad_()
    for _ in range(2):  # two steps: the running statistics' update (and the cumulative average's count)
        ref_out = ref(xr)
        ref_out.mul(upstream).sum().backward()
    per = shape[0] // size

    def work(comm: ThreadComm) -> tuple[torch.Tensor, ...]:
        bn = convert_sync_batchnorm(copy.deepcopy(start), comm)
        rows = slice(comm.rank * per, (comm.rank + 1) * per)
        mine = x[rows].clone().requires_grad_()
        for _ in range(2):
            out = bn(mine)
            out.mul(upstream[rows]).sum().backward()
        return out.detach(), mine.grad, bn.weight.grad, bn.bias.grad, bn.running_mean, bn.running_var, \
            bn.num_batches_tracked

    got = _ranks(size, work)
    out = torch.cat([g[0] for g in got])
    assert torch.allclose(out, ref_out.detach(), atol=1e-5)
    assert torch.allclose(torch.cat([g[1] for g in got]), xr.grad, atol=1e-5)
    # each rank's own part of the parameter gradients; the optimizer's sum over ranks is the whole batch's
    assert torch.allclose(sum(g[2] for g in got), ref.weight.grad, atol=1e-4)
    assert torch.allclose(sum(g[3] for g in got), ref.bias.grad, atol=1e-4)
    for g in got:
        assert torch.allclose(g[4], ref.running_mean, atol=1e-6) and torch.allclose(g[5], ref.running_var, atol=1e-5)
        assert int(g[6]) == int(ref.num_batches_tracked) == 2


def test_eval_uses_running_statistics_without_communicating() -> None:
    bn = convert_sync_batchnorm(torch.nn.BatchNorm1d(3), comm=None)  # type: ignore[arg-type]
    assert isinstance(bn, SyncBatchNorm)
    bn.eval()
    with torch.no_grad():
        bn.running_mean.fill_(1.0)
        bn.running_var.fill_(4.0)
    x = torch.randn(5, 3)
    assert torch.allclose(bn(x), (x - 1.0) / torch.sqrt(torch.tensor(4.0 + bn.eps)))


def test_conversion_keeps_the_tensors_the_optimizer_holds_and_the_keys() -> None:
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.Sequential(
        torch.nn.BatchNorm2d(4)))
    params, keys = list(model.parameters()), list(model.state_dict())
    buffers = [model[1].running_mean, model[2][0].running_var]
    out = convert_sync_batchnorm(model, comm=None)  # type: ignore[arg-type]
    assert out is model and isinstance(model[1], SyncBatchNorm) and isinstance(model[2][0], SyncBatchNorm)
    assert all(a is b for a, b in zip(params, model.parameters(), strict=True))
    assert list(model.state_dict()) == keys
    assert model[1].running_mean is buffers[0] and model[2][0].running_var is buffers[1]


def test_a_copy_shares_the_communicator_and_a_pickle_carries_none() -> None:
    comm = object()
    bn = convert_sync_batchnorm(torch.nn.BatchNorm1d(2), comm)  # type: ignore[arg-type]
    assert copy.deepcopy(bn)._comm.comm is comm
    assert pickle.loads(pickle.dumps(bn))._comm.comm is None


def test_one_value_per_channel_in_all_is_refused() -> None:
    def work(comm: ThreadComm) -> None:
        bn = convert_sync_batchnorm(torch.nn.BatchNorm1d(2), comm)
        bn(torch.randn(1 if comm.rank == 0 else 0, 2))

    with pytest.raises(InvalidArgumentError, match="more than one value per channel"):
        _ranks(2, work)
