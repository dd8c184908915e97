"""``prepare(offload="cpu")`` on one process: the argument's contract, the no-op on a CPU device, and the host path's
math (rehearsed on the CPU: the shards, gradients and optimizer state in their own host tensors) against no offload.
Multi-rank equality under the real launchers: tests/multiproc/test_zero.py (the adam_offload variant); the device
memory it saves: tests/multiproc/test_gpu.py."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
import torch

import unidist
from unidist import InvalidArgumentError
from unidist.request import PrepareRequest, check_offload
from unidist.train import offload
from unidist.train.zero import ZeroOptimizer

ON_CPU = {"UNIDIST_DEVICE": "cpu"}


@pytest.fixture
def mgr() -> Iterator[unidist.Manager]:
    with unidist.init(environ=ON_CPU) as m:
        yield m


@pytest.fixture
def rehearse() -> Iterator[None]:
    offload.rehearse_on_cpu(True)
    try:
        yield
    finally:
        offload.rehearse_on_cpu(False)


def make(seed: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 64), torch.nn.GELU(), torch.nn.LayerNorm(64),
                                torch.nn.Linear(64, 64), torch.nn.GELU(), torch.nn.Linear(64, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.1)


def train(mgr: unidist.Manager, stage: int, steps: int = 6, **kw: object
          ) -> tuple[dict[str, torch.Tensor], dict[str, object], torch.optim.Optimizer]:
    model, opt = make()
    model, opt = mgr.prepare(model, opt, zero_stage=stage, **kw)  # type: ignore[arg-type]
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(32, 16, generator=g) * 4, torch.randn(32, 4, generator=g) * 30  # norms far above 1
        mgr.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    return mgr.full_state_dict(model), mgr.full_optimizer_state_dict(opt), opt


def same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_host_path_trains_bitwise_like_no_offload(mgr: unidist.Manager, rehearse: None, stage: int) -> None:
    want_w, want_opt, _ = train(mgr, stage, clip_grad_norm=5.0)
    got_w, got_opt, opt = train(mgr, stage, clip_grad_norm=5.0, offload="cpu")
    assert isinstance(opt, ZeroOptimizer) and opt.offload
    assert same(got_w, want_w)
    for i, st in want_opt["state"].items():  # type: ignore[attr-defined]
        for key, value in st.items():
            assert torch.equal(torch.as_tensor(got_opt["state"][i][key]), torch.as_tensor(value)), (i, key)  # type: ignore[index]
    # what moved: each shard, its gradient buffer and its optimizer state are host tensors of their own, never
    # views of the flat buffer the parameters live in
    for unit in opt.units:
        assert unit.offloaded and unit.shard.device.type == "cpu"
        if unit.full is not None:
            full = unit.full.untyped_storage().data_ptr()
            assert unit.shard.untyped_storage().data_ptr() != full
        for value in opt.optimizer.state[unit.shard].values():
            if isinstance(value, torch.Tensor) and value.dim():
                assert value.device.type == "cpu" and value.untyped_storage().data_ptr() != (
                    unit.full.untyped_storage().data_ptr() if unit.full is not None else -1)


def test_host_path_checkpoint_resumes_without_offload(mgr: unidist.Manager, rehearse: None, tmp_path: object) -> None:
    """A checkpoint written with offload loads without it (and the training goes on identically)."""
    model, opt = make()
    model, opt = mgr.prepare(model, opt, zero_stage=3, offload="cpu")
    x, y = torch.randn(8, 16) * 4, torch.randn(8, 4) * 30
    for _ in range(2):
        mgr.backward(torch.nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
    path = f"{tmp_path}/ckpt"
    mgr.save_checkpoint(path, model, opt)
    offload.rehearse_on_cpu(False)
    model2, opt2 = make(seed=1)
    model2, opt2 = mgr.prepare(model2, opt2, zero_stage=2)
    mgr.load_checkpoint(path, model2, opt2)
    assert same(mgr.full_state_dict(model2), mgr.full_state_dict(model))
    for m, o in ((model, opt), (model2, opt2)):
        mgr.backward(torch.nn.functional.mse_loss(m(x), y))
        o.step()
        o.zero_grad()
    assert same(mgr.full_state_dict(model2), mgr.full_state_dict(model))


def test_no_op_on_a_cpu_device_said_once(mgr: unidist.Manager, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="unidist"):
        got_w, _, opt = train(mgr, 2, steps=2, offload="cpu")
    assert isinstance(opt, ZeroOptimizer) and not opt.offload
    said = [r for r in caplog.records if "offload" in r.getMessage()]
    assert len(said) == 1 and "no-op" in said[0].getMessage()
    assert same(got_w, train(mgr, 2, steps=2)[0])


@pytest.mark.parametrize(("kw", "needle"), [
    ({"offload": "cpu"}, "zero_stage=1, 2 or 3"),  # stage 0 holds no shards to move
    ({"offload": "gpu", "zero_stage": 1}, "use 'cpu'"),
    ({"offload": True, "zero_stage": 1}, "use 'cpu'"),
])
def test_bad_offload_is_refused_before_anything_changes(mgr: unidist.Manager, kw: dict[str, object],
                                                        needle: str) -> None:
    model, opt = make()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(InvalidArgumentError, match=needle):
        mgr.prepare(model, opt, **kw)  # type: ignore[arg-type]
    assert all(torch.equal(a, b) for a, b in zip(before, model.parameters(), strict=True))
    assert model.parameters().__next__().grad is None


def test_none_is_no_offload() -> None:
    assert check_offload(None, 0) is None and check_offload("none", 2) is None and check_offload("cpu", 1) == "cpu"
    assert PrepareRequest().offload is None


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_deepspeed_config_offloads_the_optimizer_and_at_stage3_the_parameters(stage: int) -> None:
    from unidist.config import Config
    from unidist.engines.deepspeed.config import build

    opts = PrepareRequest.build(Config(), {"zero_stage": stage, "offload": "cpu"})
    zero = build(opts, 2, None)["zero_optimization"]
    assert zero["offload_optimizer"] == {"device": "cpu", "pin_memory": True}
    assert ("offload_param" in zero) == (stage == 3)
    assert build(opts, 2, None)["zero_force_ds_cpu_optimizer"] is False
    plain = PrepareRequest.build(Config(), {"zero_stage": stage})
    assert "offload_optimizer" not in build(plain, 2, None)["zero_optimization"]
