"""unidist.compat.deepspeed.optimizers and lr_schedules: DeepSpeed's optimizer types and Adam weight-decay meaning
against an Adam written out here; the four schedules step for step against deepspeed.runtime.lr_schedules (when
deepspeed is importable); our Adam against DeepSpeed's FusedAdam when its CPU kernel is already built."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import pytest
import torch

from unidist.compat.deepspeed import lr_schedules
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.compat.deepspeed.optimizers import build_optimizer

STEPS = 10


def grads(step: int, shape: tuple[int, ...]) -> torch.Tensor:
    """A fixed, realistic gradient for ``step`` (magnitude ~1e-2)."""
    gen = torch.Generator().manual_seed(1000 + step)
    return torch.randn(shape, generator=gen, dtype=torch.float64) * 1e-2


def start() -> torch.Tensor:
    return torch.randn(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)


def reference_adam(lr: float, betas: tuple[float, float], eps: float, wd: float, decoupled: bool) -> torch.Tensor:
    """Adam written out (Kingma & Ba with bias correction): decoupled decay p -= lr*wd*p (AdamW, Loshchilov &
    Hutter) or L2 decay g += wd*p."""
    p = start()
    m, v = torch.zeros_like(p), torch.zeros_like(p)
    for t in range(1, STEPS + 1):
        g = grads(t, tuple(p.shape))
        if decoupled:
            p = p - lr * wd * p
        else:
            g = g + wd * p
        m = betas[0] * m + (1 - betas[0]) * g
        v = betas[1] * v + (1 - betas[1]) * g * g
        denom = (v / (1 - betas[1] ** t)).sqrt() + eps
        p = p - lr / (1 - betas[0] ** t) * m / denom
    return p


def train(section: Mapping[str, Any], zero_stage: int = 0) -> tuple[torch.optim.Optimizer, torch.Tensor]:
    p = torch.nn.Parameter(start())
    opt = build_optimizer(section, [p], zero_stage=zero_stage, allow_untested=False)
    for t in range(1, STEPS + 1):
        p.grad = grads(t, tuple(p.shape))
        opt.step()
    return opt, p.detach()


ADAM = {"lr": 1e-3, "betas": [0.8, 0.999], "eps": 1e-8}


@pytest.mark.parametrize(("type_", "extra", "wd", "decoupled", "cls"), [
    ("Adam", {"weight_decay": 0.1}, 0.1, True, torch.optim.AdamW),  # adam_w_mode defaults to True
    ("adam", {"weight_decay": 0.1, "adam_w_mode": False}, 0.1, False, torch.optim.Adam),  # L2
    ("AdamW", {"weight_decay": 0.1, "adam_w_mode": False}, 0.1, True, torch.optim.AdamW),  # AdamW stays AdamW
    ("ADAMW", {}, 0.0, True, torch.optim.AdamW),  # FusedAdam's weight_decay default 0 (torch's AdamW: 0.01)
    ("Adam", {"torch_adam": True, "weight_decay": 3e-7}, 3e-7, True, torch.optim.AdamW),  # DSE cifar's setting
    # torch_adam is torch's class with torch's defaults (engine.py:2380-2382): AdamW's weight_decay 0.01, not 0
    ("Adam", {"torch_adam": True}, 0.01, True, torch.optim.AdamW),
    ("Adam", {"torch_adam": True, "adam_w_mode": False}, 0.0, False, torch.optim.Adam),
])
def test_adam_types_have_deepspeeds_weight_decay(type_: str, extra: Mapping[str, Any], wd: float, decoupled: bool,
                                                 cls: type) -> None:
    opt, p = train({"type": type_, "params": {**ADAM, **extra}}, zero_stage=2)
    assert type(opt) is cls and opt.param_groups[0]["weight_decay"] == wd
    torch.testing.assert_close(p, reference_adam(1e-3, (0.8, 0.999), 1e-8, wd, decoupled), rtol=0, atol=1e-12)


def test_adam_defaults_are_fused_adams() -> None:
    opt, p = train({"type": "Adam"})
    assert {k: opt.defaults[k] for k in ("lr", "betas", "eps", "weight_decay")} == \
        {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
    torch.testing.assert_close(p, reference_adam(1e-3, (0.9, 0.999), 1e-8, 0.0, True), rtol=0, atol=1e-12)


def test_other_types_follow_deepspeeds_lookup() -> None:
    p = [torch.nn.Parameter(torch.zeros(3))]
    assert type(build_optimizer({"type": "AdaGrad", "params": {"lr": 0.1}}, p, zero_stage=1,
                                allow_untested=False)) is torch.optim.Adagrad
    sgd = build_optimizer({"type": "SGD", "params": {"lr": 1e-5, "momentum": 0.9}}, p, zero_stage=0,
                          allow_untested=False)
    assert type(sgd) is torch.optim.SGD and sgd.defaults["momentum"] == 0.9
    with pytest.raises(DeepSpeedConfigError, match="case-sensitive: did you mean 'SGD'"):
        build_optimizer({"type": "sgd"}, p, zero_stage=0, allow_untested=False)
    with pytest.raises(DeepSpeedConfigError, match="'Adamax2' is neither"):
        build_optimizer({"type": "Adamax2"}, p, zero_stage=0, allow_untested=False)


@pytest.mark.parametrize("name", ["Lamb", "lion", "MuAdam", "Muon", "OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_kernel_optimizers_need_deepspeed(name: str) -> None:
    with pytest.raises(DeepSpeedUnsupportedError, match=f"'{name}'.*deepspeed launcher"):
        build_optimizer({"type": name, "params": {"lr": 1e-3}}, [torch.nn.Parameter(torch.zeros(2))], zero_stage=0,
                        allow_untested=False)


def test_untested_optimizer_with_zero_needs_the_flag() -> None:
    def sgd(stage: int, allow: bool) -> torch.optim.Optimizer:
        return build_optimizer({"type": "SGD", "params": {"lr": 1e-5}}, [torch.nn.Parameter(torch.zeros(2))],
                               zero_stage=stage, allow_untested=allow)

    assert type(sgd(0, False)) is torch.optim.SGD and type(sgd(3, True)) is torch.optim.SGD
    with pytest.raises(DeepSpeedConfigError, match=r'untested ZeRO Optimizer.*"zero_allow_untested_optimizer": true'):
        sgd(1, False)


@pytest.mark.parametrize(("params", "match", "error"), [
    ({"max_grad_norm": 1.0}, "'max_grad_norm' is not supported.*gradient_clipping", DeepSpeedConfigError),
    ({"bias_correction": False}, "bias_correction=false", DeepSpeedUnsupportedError),
    ({"amsgrad": True}, "AMSGrad", DeepSpeedConfigError),
    ({"lr": 1e-3, "betaz": [0.9, 0.99]}, r"\['betaz'\]", DeepSpeedConfigError),
    ({"lr": -1.0}, "Invalid learning rate", DeepSpeedConfigError),
])
def test_bad_params_are_named(params: Mapping[str, Any], match: str, error: type) -> None:
    with pytest.raises(error, match=match):
        build_optimizer({"type": "Adam", "params": params}, [torch.nn.Parameter(torch.zeros(2))], zero_stage=0,
                        allow_untested=False)


# ----------------------------------------------------------------- schedules
def opt_pair() -> torch.optim.Optimizer:
    """An Adam with two param groups (lr 1e-3 and 5e-4): schedules set per-group values."""
    a, b = torch.nn.Parameter(torch.zeros(2)), torch.nn.Parameter(torch.zeros(2))
    groups: list[dict[str, Any]] = [{"params": [a]}, {"params": [b], "lr": 5e-4}]
    return torch.optim.Adam(groups, lr=1e-3)


SCHEDULES: list[tuple[str, dict[str, Any]]] = [
    ("WarmupLR", {"warmup_min_lr": 0, "warmup_max_lr": 1e-3, "warmup_num_steps": 12}),  # DSE cifar's, shorter
    ("WarmupLR", {"warmup_min_lr": 1e-5, "warmup_num_steps": 8, "warmup_type": "linear"}),
    ("WarmupDecayLR", {"total_num_steps": 40, "warmup_min_lr": 1e-5, "warmup_max_lr": 2e-3, "warmup_num_steps": 10}),
    ("WarmupCosineLR", {"total_num_steps": 40, "warmup_min_ratio": 0.05, "warmup_num_steps": 10,
                        "cos_min_ratio": 0.01}),
    ("WarmupCosineLR", {"total_num_steps": 30, "warmup_num_steps": 6, "warmup_type": "linear"}),
    ("OneCycle", {"cycle_min_lr": 1e-4, "cycle_max_lr": 1e-3, "decay_lr_rate": 0.2, "cycle_first_step_size": 10,
                  "cycle_second_step_size": 15, "decay_step_size": 5, "cycle_min_mom": 0.85, "cycle_max_mom": 0.95,
                  "decay_mom_rate": 0.01}),
    ("OneCycle", {"cycle_min_lr": [1e-4, 5e-5], "cycle_max_lr": [1e-3, 5e-4], "cycle_first_step_size": 12,
                  "cycle_first_stair_count": 3, "cycle_second_stair_count": 4}),
]


def run(build: Callable[[torch.optim.Optimizer], Any], steps: int = 50) -> list[tuple[Any, ...]]:
    opt = opt_pair()
    sched = build(opt)
    seen: list[tuple[Any, ...]] = [(tuple(g["lr"] for g in opt.param_groups),
                                    tuple(tuple(g["betas"]) for g in opt.param_groups))]
    for _ in range(steps):
        sched.step()
        seen.append((tuple(g["lr"] for g in opt.param_groups), tuple(tuple(g["betas"]) for g in opt.param_groups),
                     tuple(sched.get_last_lr()), sched.state_dict()["last_batch_iteration"]))
    return seen


@pytest.mark.deepspeed
@pytest.mark.parametrize(("name", "params"), SCHEDULES, ids=[f"{n}-{i}" for i, (n, _) in enumerate(SCHEDULES)])
def test_schedules_match_deepspeeds(name: str, params: dict[str, Any]) -> None:
    ds = pytest.importorskip("deepspeed.runtime.lr_schedules")
    ours = run(lambda opt: lr_schedules.build_scheduler({"type": name, "params": params}, opt))
    theirs = run(lambda opt: getattr(ds, name)(opt, **params))
    assert ours == theirs  # exactly: same formulas in the same order
    assert len({lr for (lrs, *_rest) in ours for lr in lrs}) > 5  # the schedule moved


@pytest.mark.parametrize(("name", "params"), SCHEDULES[:1] + SCHEDULES[5:6])
def test_schedule_state_resumes(name: str, params: dict[str, Any]) -> None:
    opt = opt_pair()
    first = lr_schedules.build_scheduler({"type": name, "params": params}, opt)
    for _ in range(17):
        first.step()
    opt2 = opt_pair()
    second = lr_schedules.build_scheduler({"type": name, "params": params}, opt2)
    second.load_state_dict(first.state_dict())
    assert first.state_dict() == {"last_batch_iteration": 16}
    for _ in range(5):
        first.step()
        second.step()
        assert first.get_last_lr() == second.get_last_lr()


def test_warmup_lr_formula() -> None:
    opt = opt_pair()
    sched = lr_schedules.WarmupLR(opt, warmup_min_lr=1e-5, warmup_max_lr=1e-3, warmup_num_steps=20)
    assert [g["lr"] for g in opt.param_groups] == [1e-5, 1e-5]  # the constructor writes the minimum
    for it in range(25):
        sched.step()
        gamma = math.log(it + 1) / math.log(20) if it < 20 else 1.0
        assert opt.param_groups[1]["lr"] == pytest.approx(1e-5 + (1e-3 - 1e-5) * gamma, rel=1e-12)


def test_build_scheduler_lookup() -> None:
    opt = opt_pair()
    assert lr_schedules.build_scheduler(None, opt) is None
    step = lr_schedules.build_scheduler({"type": "StepLR", "params": {"step_size": 2}}, opt)
    assert isinstance(step, torch.optim.lr_scheduler.StepLR)
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'WarmupLR'"):
        lr_schedules.build_scheduler({"type": "WarmupLr"}, opt)
    with pytest.raises(DeepSpeedConfigError, match="warmup_steps"):
        lr_schedules.build_scheduler({"type": "WarmupLR", "params": {"warmup_steps": 3}}, opt)


# ----------------------------------------------------------------- DeepSpeed's FusedAdam (CPU kernel)
def _fused_adam_built() -> bool:
    """Whether DeepSpeed's CPU FusedAdam kernel is already compiled here (a JIT build takes minutes: not in a unit
    test)."""
    try:
        from deepspeed.ops.op_builder.cpu import FusedAdamBuilder
        from torch.utils.cpp_extension import _get_build_directory
    except ImportError:
        return False
    import os

    folder = _get_build_directory(FusedAdamBuilder.NAME, verbose=False)
    return any(f.endswith(".so") for f in os.listdir(folder)) if os.path.isdir(folder) else False


@pytest.mark.deepspeed
@pytest.mark.parametrize("adam_w_mode", [True, False])
def test_adam_matches_deepspeeds_fused_adam(adam_w_mode: bool) -> None:
    pytest.importorskip("deepspeed")
    if not _fused_adam_built():
        pytest.skip("DeepSpeed's FusedAdam CPU kernel is not built on this machine (its JIT build takes minutes)")
    from deepspeed.ops.adam import FusedAdam

    params = {"lr": 1e-3, "betas": (0.8, 0.999), "eps": 1e-8, "weight_decay": 0.01}
    ours_p = torch.nn.Parameter(start().float())
    theirs_p = torch.nn.Parameter(start().float())
    ours = build_optimizer({"type": "Adam", "params": {**params, "adam_w_mode": adam_w_mode}}, [ours_p],
                           zero_stage=0, allow_untested=False)
    theirs = FusedAdam([theirs_p], adam_w_mode=adam_w_mode, **params)
    for t in range(1, 21):
        ours_p.grad = grads(t, (64,)).float()
        theirs_p.grad = grads(t, (64,)).float()
        ours.step()
        theirs.step()
    torch.testing.assert_close(ours_p.detach(), theirs_p.detach(), rtol=1e-5, atol=1e-7)
    assert not torch.equal(ours_p.detach(), start().float())
