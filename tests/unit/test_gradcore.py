"""The gradient core (unidist/train/gradcore.py) and what both optimizers take from it; checked against plain
torch on one process."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

import unidist
from unidist import InvalidArgumentError
from unidist.request import SyncOptions
from unidist.train.gradcore import Compression, FP16Compressor, pack

# the models and batches here are CPU tensors: the Manager is told the CPU, so that a GPU machine runs the same tests
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


@pytest.fixture
def mgr() -> Iterator[unidist.Manager]:
    with unidist.init(environ=ON_CPU) as m:
        yield m


def test_pack_reverse_order_by_size_and_key() -> None:
    ps = [torch.zeros(4), torch.zeros(4), torch.zeros(4, dtype=torch.float64), torch.zeros(8)]
    slots = pack(ps, limit_bytes=32, key=lambda p: p.dtype)
    assert [[id(p) for p in s] for s in slots] == [[id(ps[3])], [id(ps[2])], [id(ps[1]), id(ps[0])]]


def test_pack_puts_large_parameters_in_slots_of_their_own() -> None:
    """From ``alone_from`` bytes a parameter is a slot alone (reduced where it is); the order stays reversed and the
    small ones around it still fuse."""
    ps = [torch.zeros(2), torch.zeros(2), torch.zeros(64), torch.zeros(2), torch.zeros(2)]
    slots = pack(ps, limit_bytes=1024, key=lambda p: p.dtype, alone_from=256)
    assert [[id(p) for p in s] for s in slots] == [[id(ps[4]), id(ps[3])], [id(ps[2])], [id(ps[1]), id(ps[0])]]
    assert pack(ps, limit_bytes=1024, key=lambda p: p.dtype) == [list(reversed(ps))]


def test_wire_copy_scales_before_the_narrow_cast() -> None:
    """A mean over 4 ranks of 60000 each: undivided, 60000 already nears fp16's limit (65504) and the sum
    overflows; divided first, each piece is 15000 and the sum is exact."""
    grads = [torch.full((3,), 6e4), None]
    flat = torch.full((5,), 7.0, dtype=torch.float16)
    FP16Compressor.write(flat, grads, [3, 2], 0.25)
    assert flat.tolist() == [15000.0] * 3 + [0.0, 0.0]
    assert torch.isfinite(flat.float() * 4).all()


def test_compression_names() -> None:
    assert Compression.of("bf16").wire_dtype(torch.float32) is torch.bfloat16
    assert not Compression.of("none").copies(torch.float32) and Compression.of("fp16").copies(torch.float32)
    with pytest.raises(InvalidArgumentError, match="compression='int8'"):
        Compression.of("int8")


def test_options_checked_once_with_the_callers_name() -> None:
    with pytest.raises(InvalidArgumentError, match=r"distributed_optimizer\(bucket_mb=0\)"):
        SyncOptions.parse("distributed_optimizer", op="mean", compression="none", backward_passes_per_step=1,
                          bucket_mb=0, clip_grad_norm=None)


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_on_one_rank_gathers_nothing(mgr: unidist.Manager, stage: int) -> None:
    """One rank's shard is the whole unit: refresh (stages 1-2) and the stage-3 gathers make no allgather (and
    copy nothing: the parameters are views of the shard); training still equals plain torch. At N ranks they pass
    out= (tests/multiproc/test_zero.py trains through them)."""
    torch.manual_seed(0)
    ref = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model = torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))
    model.load_state_dict(ref.state_dict())
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), zero_stage=stage)
    calls: list[Any] = []
    real = mgr.allgather

    def spy(x: Any, out: Any = None) -> Any:
        calls.append(out)
        return real(x, out=out)
    mgr.allgather = spy  # type: ignore[method-assign]
    try:
        for step in range(3):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step)) * 3
            mgr.backward(model(x).pow(2).sum())
            opt.step()
            opt.zero_grad()
            ref_opt.zero_grad()
            ref(x).pow(2).sum().backward()
            ref_opt.step()
    finally:
        del mgr.allgather
    assert mgr.size == 1 and calls == []
    with mgr.gathered_parameters(model):
        for (name, p), q in zip(model.named_parameters(), ref.parameters(), strict=True):
            assert float((p - q).detach().abs().max()) <= 1e-6, name
