"""``unidist.compat.deepspeed``'s engine in one process (the local backend): what it refuses and how, the
checkpoint protocol's edges, and DeepSpeed's precedence of a script's own optimizer and scheduler. The numbers
against real DeepSpeed are tests/multiproc/test_ds_engine.py's."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import compat_local_manager

import unidist.compat.deepspeed as deepspeed
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.errors import CheckpointError, InvalidArgumentError

pytestmark = pytest.mark.local


@pytest.fixture(autouse=True)
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Each test in its own local-backend Manager (helpers.compat_local_manager)."""
    yield from compat_local_manager(monkeypatch)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


def _config(stage: int = 0, **extra: Any) -> dict[str, Any]:
    return {"train_batch_size": 4, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True, **extra}


def _step(engine: Any) -> None:
    x = torch.randn(4, 4)
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def test_initialize_refuses_what_it_cannot_do() -> None:
    with pytest.raises(InvalidArgumentError, match="requires a model"):
        deepspeed.initialize(config=_config())
    with pytest.raises(DeepSpeedUnsupportedError, match="mpu"):
        deepspeed.initialize(model=_model(), config=_config(), mpu=object())
    with pytest.raises(DeepSpeedConfigError, match="gradient_clipping"):
        deepspeed.initialize(model=_model(), config=_config(gradient_cliping=1.0))
    with pytest.raises(DeepSpeedUnsupportedError, match="offload_optimizer"):
        deepspeed.initialize(model=_model(), config=_config(2) | {"zero_optimization": {
            "stage": 2, "offload_optimizer": {"device": "nvme", "nvme_path": "/local_nvme"}}})


@pytest.mark.parametrize(("stage", "key"), [(2, "offload_optimizer"), (3, "offload_param")])
def test_cpu_offload_keys_are_prepares_offload(stage: int, key: str) -> None:
    """DeepSpeed's CPU offload keys run as prepare(offload="cpu"): the same training as without them. The CPU path
    is rehearsed here (offload.rehearse_on_cpu: host copies even though the parameters are on the CPU already)."""
    from unidist.train import offload as offloading

    def run(offload: bool) -> tuple[Any, list[torch.Tensor]]:
        zero = {"stage": stage, **({key: {"device": "cpu", "pin_memory": True}} if offload else {})}
        engine, *_ = deepspeed.initialize(model=_model(), config=_config(stage) | {"zero_optimization": zero})
        torch.manual_seed(1)
        for _ in range(3):
            _step(engine)
        with deepspeed.zero.GatheredParameters(list(engine.module.parameters())):
            return engine, [p.detach().clone() for p in engine.module.parameters()]
    offloading.rehearse_on_cpu(True)
    try:
        engine, moved = run(True)
    finally:
        offloading.rehearse_on_cpu(False)
    assert engine.optimizer.offload is True and engine.zero_optimization_stage() == stage
    _, plain = run(False)
    for a, b in zip(moved, plain, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_script_optimizer_and_scheduler_win_over_the_config() -> None:
    model = _model()
    mine = torch.optim.SGD(model.parameters(), lr=0.5)
    engine, _, _, sched = deepspeed.initialize(
        model=model, optimizer=mine, config=_config(scheduler={"type": "WarmupLR", "params": {}}),
        lr_scheduler=lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda step: 0.5 ** step))
    assert isinstance(sched, torch.optim.lr_scheduler.LambdaLR)  # the callable was called on the optimizer
    assert engine.get_lr() == [0.5]  # the script's optimizer's lr, not the config's 0.1
    _step(engine)
    assert engine.get_lr() == [0.25] and engine.global_steps == 1 and engine.was_step_applied()


def test_engine_refuses_unsupported_calls() -> None:
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(2))
    with pytest.raises(InvalidArgumentError, match="ZeRO stage 2"), engine.no_sync():
        pass
    with pytest.raises(DeepSpeedUnsupportedError, match="retain_graph"):
        engine.backward(engine(torch.randn(4, 4)).sum(), retain_graph=True)
    engine0, _, _, _ = deepspeed.initialize(model=_model(), config=_config(0))
    with pytest.raises(InvalidArgumentError, match=r"inside engine\.no_sync"), engine0.no_sync():
        engine0.step()


def test_checkpoint_protocol_edges(tmp_path: Path) -> None:
    engine, _, _, _ = deepspeed.initialize(model=_model(), config=_config(1))
    _step(engine)
    assert engine.save_checkpoint(str(tmp_path), client_state={"epoch": 3})
    assert (tmp_path / "latest").read_text() == "global_step1"  # DeepSpeed's bare tag, no newline
    engine.save_checkpoint(str(tmp_path), tag="named", save_latest=False)
    assert (tmp_path / "latest").read_text() == "global_step1"
    fresh, _, _, _ = deepspeed.initialize(model=_model(), config=_config(3))
    path, client = fresh.load_checkpoint(str(tmp_path))
    assert Path(path).name == "global_step1" and client == {"epoch": 3} and fresh.global_steps == 1
    with pytest.raises(CheckpointError, match=r"no checkpoint .*'nope'.*\['global_step1', 'named'\]"):
        fresh.load_checkpoint(str(tmp_path), tag="nope")
    assert fresh.load_checkpoint(str(tmp_path / "empty")) == (None, None)  # no latest file: DeepSpeed's answer
    blocked = tmp_path / "file"
    blocked.write_text("x")
    with pytest.raises(CheckpointError, match="cannot create"):
        engine.save_checkpoint(str(blocked / "sub"))
    with pytest.raises(InvalidArgumentError, match="client_state"):
        engine.save_checkpoint(str(tmp_path), client_state=[1, 2])  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match=r"\['loader'\] cannot be client-state keys"):
        engine.save_checkpoint(str(tmp_path), client_state={"loader": 1})  # a keyword of mgr.save_checkpoint


def test_the_loader_pins_memory_for_the_managers_gpu_only(manager: Any) -> None:
    """Pinned host memory is for copies to a GPU: on the CPU device (UNIDIST_DEVICE=cpu, here, even where torch sees
    a GPU) nothing is pinned, so no rank opens a CUDA context for it (as ``mgr.loader``)."""
    data = torch.utils.data.TensorDataset(torch.randn(8, 4))
    _, _, loader, _ = deepspeed.initialize(model=_model(), config=_config(), training_data=data)
    assert manager.device == torch.device("cpu") and loader._loader.pin_memory is False


@pytest.mark.parametrize("stage", [0, 3])
def test_safe_get_helpers_and_fused_adam(stage: int) -> None:
    """deepspeed.utils.safe_get_full_*: the full parameter, averaged gradient and Adam state as plain torch has them
    (one rank: the average is the gradient); FusedAdam (torch's Adam, DeepSpeed's defaults) is ZeRO-supported."""
    from unidist.compat.deepspeed.ops.adam import FusedAdam
    from unidist.compat.deepspeed.utils import (
        safe_get_full_fp32_param,
        safe_get_full_grad,
        safe_get_full_optimizer_state,
    )

    model, ref = _model(), _model()
    engine, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters(), lr=0.01),
                                      config={"train_batch_size": 4, "zero_optimization": {"stage": stage}})
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=0.01, weight_decay=0.0)
    x = torch.randn(4, 4)
    engine.backward(engine(x).pow(2).mean())
    ref(x).pow(2).mean().backward()
    first = next(iter(engine.module.parameters()))
    torch.testing.assert_close(safe_get_full_grad(first), next(iter(ref.parameters())).grad)
    engine.step()
    torch.nn.utils.clip_grad_norm_(ref.parameters(), 1.0)  # DeepSpeed's default clipping, as the engine's
    ref_opt.step()
    for p, q in zip(engine.module.parameters(), ref.parameters(), strict=True):
        torch.testing.assert_close(safe_get_full_fp32_param(p), q.detach())
        torch.testing.assert_close(safe_get_full_optimizer_state(p, "exp_avg"), ref_opt.state[q]["exp_avg"])
    assert safe_get_full_fp32_param(torch.nn.Parameter(torch.ones(2))) is None  # no engine manages it


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_bf16_section_keeps_float32_masters_that_safe_get_returns(stage: int) -> None:
    """The bf16 section is precision "bf16-master": a bfloat16 model, outputs in bfloat16 (as DeepSpeed's engine
    returns them), and ``safe_get_full_fp32_param`` the float32 master copy, not the rounded weight: after a step
    whose update is far below a bfloat16 step, the weights did not move and the master copies did."""
    from unidist.compat.deepspeed.utils import safe_get_full_fp32_param

    model = _model()
    start = [p.detach().to(torch.bfloat16).float() for p in model.parameters()]
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=1e-6),
                                      config={"train_batch_size": 4, "bf16": {"enabled": True},
                                              "zero_optimization": {"stage": stage}})
    out = engine(torch.randn(4, 4))
    assert out.dtype == torch.bfloat16
    engine.backward(out.float().pow(2).mean())
    engine.step()
    for p, s in zip(engine.module.parameters(), start, strict=True):
        master = safe_get_full_fp32_param(p)
        assert p.dtype == torch.bfloat16 and master is not None and master.dtype == torch.float32
        assert torch.equal(master.to(torch.bfloat16).float(), s)  # the weights rounded back to where they were
        assert not torch.equal(master, s)  # the master copies moved by lr x gradient
