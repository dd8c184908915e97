"""A DeepSpeed fp16 section off DeepSpeed (compat/deepspeed/loss_scale.py): unidist's LossScaler and AgreedGradScaler,
given ``loss_scaling(section)``, move the scale and skip the steps DeepSpeed 0.19.8's own scalers do, on long
overflow patterns; and a one-process ``prepare(precision="fp16-mixed")`` run follows the same sequence.

The reference is DeepSpeed's code itself: the section parsed by ``DeepSpeedFP16Config``, ZeRO's scaler built by
``CreateLossScaler`` as zero/stage_1_and_2.py:722 builds it, stage 0's by a real ``FP16_UnfusedOptimizer``. Both
log through ``deepspeed.comm``, so the module runs them inside a one-process gloo group, on DeepSpeed's CPU
accelerator: the tensors here are CPU tensors, and DeepSpeed would otherwise pick CUDA on a GPU machine (stage 0's
FP16_UnfusedOptimizer then gives a CPU parameter a CUDA gradient)."""

from __future__ import annotations

import random
import socket
from collections.abc import Iterator, Mapping
from typing import Any

import pytest
import torch

from unidist import Config, LaunchInfo, LocalManager
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError
from unidist.compat.deepspeed.loss_scale import loss_scaling
from unidist.engines.deepspeed.scaler import AgreedGradScaler
from unidist.errors import InvalidArgumentError
from unidist.request import ScalerOptions
from unidist.train.precision import LossScaleFloorError, LossScaler

CPU = torch.device("cpu")
SECTIONS: dict[str, dict[str, Any]] = {
    "defaults": {},
    "cifar": {"initial_scale_power": 15, "loss_scale_window": 500, "hysteresis": 2, "min_loss_scale": 1},
    "hysteresis-1": {"hysteresis": 1, "loss_scale_window": 5},
    "consecutive": {"hysteresis": 3, "consecutive_hysteresis": True, "loss_scale_window": 4},
    "window-3": {"initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 2},
    "floor": {"initial_scale_power": 3, "loss_scale_window": 6, "hysteresis": 2, "min_loss_scale": 2},
    "static": {"loss_scale": 128},
}


def _patterns() -> dict[str, list[bool]]:
    """Overflow flags per step: sparse random ones, bursts of consecutive overflows, and long clean runs."""
    rng = random.Random(22)
    sparse = [rng.random() < 0.08 for _ in range(400)]
    bursty: list[bool] = []
    while len(bursty) < 400:
        bursty += [False] * rng.choice([0, 1, 2, 3, 4, 7, 12, 30]) + [True] * rng.choice([1, 1, 2, 3, 5])
    clean = [False] * 1002 + [True, False, True, True] + [False] * 1002 + [True] * 3 + [False] * 200
    return {"sparse": sparse, "bursty": bursty[:400], "clean": clean}


PATTERNS = _patterns()


@pytest.fixture(scope="module")
def ds() -> Iterator[Any]:
    """deepspeed on its CPU accelerator, with the one-process gloo group its scalers log through (torch.distributed,
    DS_ACCELERATOR and DeepSpeed's accelerator left as found). DS_ACCELERATOR=cpu is how the project runs DeepSpeed
    on the CPU; DeepSpeed reads it only until it has chosen once in this process, so its choice is set too."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("DS_ACCELERATOR", "cpu")
        deepspeed = pytest.importorskip("deepspeed")
        import deepspeed.comm as dist
        from deepspeed.accelerator import real_accelerator
        from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

        mp.setattr(real_accelerator, "ds_accelerator", CPU_Accelerator())
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        # as unidist's deepspeed manager does: init_distributed would JIT-compile DeepSpeed's CPU shared-memory op
        # (44-74 s on a clean machine) that only its inference_all_reduce uses
        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
        dist.init_distributed(dist_backend="gloo", auto_mpi_discovery=False, init_method=f"tcp://127.0.0.1:{port}",
                              rank=0, world_size=1, verbose=False)
        yield deepspeed
        dist.destroy_process_group()


def _deepspeed_run(section: Mapping[str, Any], flags: list[bool], stage: int) -> list[float | str]:
    """The scale after each step from DeepSpeed's own scaler for ``stage``; "raise" where it stops the run."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    cfg = DeepSpeedFP16Config(enabled=True, **section)
    dynamic, static, args = cfg.loss_scale == 0, cfg.loss_scale, cfg.dynamic_loss_scale_args()
    if stage:  # ZeRO 1-3 (zero/stage_1_and_2.py:722, zero/stage3.py:524)
        scaler = CreateLossScaler(dtype=torch.half, static_loss_scale=static, dynamic_scaling=dynamic,
                                  dynamic_loss_args=args)
        update, read = scaler.update_scale, lambda: scaler.cur_scale
    else:  # stage 0 with a torch optimizer (engine.py:2555-2609)
        lsc = LossScaleConfig(torch.float16, dynamic, static, args, profile=LossScaleProfile.UNFUSED)
        half = torch.nn.Parameter(torch.zeros(3, dtype=torch.half))
        opt = FP16_UnfusedOptimizer(torch.optim.SGD([half], lr=0.1), loss_scale_config=lsc,
                                    low_precision_dtype=torch.float16, verbose=False)
        update, read = opt._update_scale, lambda: opt.loss_scale
    out: list[float | str] = []
    for flag in flags:
        try:
            update(flag)
        except Exception as err:  # DeepSpeed raises a bare Exception at the floor
            if "minimum" not in str(err):
                raise
            out.append("raise")
            break
        out.append(float(read()))
    return out


def _loss_scaler_run(options: ScalerOptions, flags: list[bool], resume_at: int | None = None) -> list[float | str]:
    """unidist's LossScaler on the same flags (its skip decision checked too); optionally resumed from its
    state_dict half way, into a fresh one."""
    ours = LossScaler(options, CPU)
    out: list[float | str] = []
    for i, flag in enumerate(flags):
        if i == resume_at:
            state = ours.state_dict()
            ours = LossScaler(options, CPU)
            ours.load_state_dict(state)
        try:
            ours.update(torch.tensor([float(flag)]))
        except LossScaleFloorError:
            out.append("raise")
            break
        assert ours.last_step_skipped == flag
        out.append(ours.scale_value)
    assert ours.skipped_steps == sum(flags[:len(out)])
    return out


def _agreed_run(options: ScalerOptions, flags: list[bool], resume_at: int | None = None) -> list[float | str]:
    """AgreedGradScaler through EngineOptimizer.step's calls (begin_step, step, update, end_step), with real
    gradients that are inf on the flagged steps, on a one-rank group."""
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.0)
    scaler = AgreedGradScaler(options, CPU, None)
    out: list[float | str] = []
    for i, flag in enumerate(flags):
        if i == resume_at:
            state = scaler.state_dict()
            scaler = AgreedGradScaler(options, CPU, None)
            scaler.load_state_dict(state)
        opt.zero_grad()
        loss = (p * torch.arange(1.0, 5.0)).sum() * (float("inf") if flag else 1.0)
        scaler.scale(loss).backward()
        scaler.begin_step()
        scaler.step(opt)
        scaler.update()
        try:
            scaler.end_step(engine_skipped=False)
        except LossScaleFloorError:
            out.append("raise")
            break
        assert scaler.last_step_skipped == flag
        out.append(scaler.scale_value)
    return out


@pytest.mark.deepspeed
@pytest.mark.parametrize("stage", [1, 0])
@pytest.mark.parametrize("pattern", sorted(PATTERNS))
@pytest.mark.parametrize("name", sorted(SECTIONS))
def test_same_scales_and_skips_as_deepspeed(ds: Any, name: str, pattern: str, stage: int) -> None:
    section, flags = SECTIONS[name], PATTERNS[pattern]
    want = _deepspeed_run(section, flags, stage)
    beyond = [i for i, s in enumerate(want) if isinstance(s, float) and s > torch.finfo(torch.float32).max]
    if beyond:  # DeepSpeed's float64 scale outgrows float32 (ours stops below it): compare up to there
        assert pattern == "clean" and section["loss_scale_window"] <= 6  # only 250+ growths in a row get there
        flags, want = flags[:beyond[0]], want[:beyond[0]]
    options = ScalerOptions.parse(loss_scaling(section, zero_stage=stage))
    assert _loss_scaler_run(options, flags) == want
    if pattern != "clean":
        assert _loss_scaler_run(options, flags, resume_at=len(flags) // 3) == want
    if pattern == "bursty":  # (each step a backward: one pattern is enough)
        assert _agreed_run(options, flags[:240], resume_at=120) == want[:240]
    if "static" not in name and pattern != "clean":
        assert len(set(want) - {"raise"}) > 2, "the scale moved both ways"


@pytest.mark.deepspeed
@pytest.mark.parametrize("name", ["consecutive", "window-3"])
def test_a_checkpoint_moves_between_backends(ds: Any, name: str) -> None:
    """A scale saved by LossScaler (mpi/torch/horovod/local) resumes in AgreedGradScaler (deepspeed) mid-pattern,
    hysteresis left and growth count included, and DeepSpeed's sequence goes on."""
    flags = PATTERNS["bursty"][:200]
    want = _deepspeed_run(SECTIONS[name], flags, 1)
    options = ScalerOptions.parse(loss_scaling(SECTIONS[name]))
    ours = LossScaler(options, CPU)
    for flag in flags[:101]:
        ours.update(torch.tensor([float(flag)]))
    state = ours.state_dict()
    assert state["scale"] == want[100]
    p = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([p], lr=0.0)
    agreed = AgreedGradScaler(options, CPU, None)
    agreed.load_state_dict(state)
    for step in range(101, 200):
        opt.zero_grad()
        agreed.scale(p.sum() * (float("inf") if flags[step] else 1.0)).backward()
        agreed.begin_step()
        agreed.step(opt)
        agreed.update()
        agreed.end_step(engine_skipped=False)
        assert agreed.scale_value == want[step], step
    assert agreed.skipped_steps == sum(flags)


@pytest.mark.deepspeed
def test_the_patterns_reach_what_they_test(ds: Any) -> None:
    """Growth after window + 1 good steps, hysteresis absorbing overflows, the floor's error: all happen."""
    assert _deepspeed_run(SECTIONS["window-3"], [False] * 4, 1) == [256.0, 256.0, 256.0, 512.0]
    assert _deepspeed_run(SECTIONS["window-3"], [True, True, True], 1) == [256.0, 128.0, 64.0]  # 1st absorbed
    assert _deepspeed_run(SECTIONS["window-3"], [True, True, True], 0) == [128.0, 64.0, 32.0]  # stage 0: none
    assert _deepspeed_run(SECTIONS["floor"], PATTERNS["bursty"], 1)[-1] == "raise"
    assert _deepspeed_run(SECTIONS["floor"], PATTERNS["bursty"], 0)[-1] != "raise"


@pytest.mark.deepspeed
@pytest.mark.parametrize(("name", "overflow_at"), [("window-3", {0, 1, 2, 6, 7, 13}), ("static", {2, 3})])
def test_prepare_fp16_follows_deepspeed(ds: Any, name: str, overflow_at: set[int]) -> None:
    """One process, prepare(precision="fp16-mixed", loss_scaling=loss_scaling(section)); the loss times 1e30 on
    the chosen steps overflows fp16's backward: the optimizer reports DeepSpeed's scales and skips."""
    steps = 20
    flags = [i in overflow_at for i in range(steps)]
    want = _deepspeed_run(SECTIONS[name], flags, 1)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    with LocalManager(Config(device=CPU.type), LaunchInfo()) as mgr:
        model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01), precision="fp16-mixed",
                                 loss_scaling=loss_scaling(SECTIONS[name]))
        skipped, scales = [], []
        for step in range(steps):
            before = [q.detach().clone() for q in model.parameters()]
            loss = torch.nn.functional.mse_loss(model(x), y) * (1e30 if flags[step] else 1.0)
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
            moved = any(not torch.equal(b, q) for b, q in zip(before, model.parameters(), strict=True))
            assert moved != opt.last_step_skipped
            skipped.append(opt.last_step_skipped)
            scales.append(opt.loss_scale)
        assert skipped == flags and opt.skipped_steps == sum(flags)
        assert scales == want


# ----------------------------------------------------------------- the mapping and its refusals
def test_mapping() -> None:
    assert loss_scaling({"enabled": True, "auto_cast": False}) == {
        "init_scale": 65536.0, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 1000,
        "growth_rule": "deepspeed", "min_scale": 1.0, "hysteresis": 2, "consecutive_hysteresis": False,
        "raise_at_min_scale": True}
    stage0 = loss_scaling(SECTIONS["cifar"], zero_stage=0)
    assert (stage0["init_scale"], stage0["growth_interval"], stage0["hysteresis"]) == (2.0**15, 500, 1)
    assert not stage0["raise_at_min_scale"]
    assert loss_scaling({"loss_scale": 128.0, "hysteresis": 0}) == {"init_scale": 128.0, "dynamic": False}


@pytest.mark.parametrize(("section", "says"), [
    ({"loss_scale": -1}, "fp16.loss_scale=-1: must be >= 0"),
    ({"loss_scale": True}, "must be a finite number"),
    ({"loss_scale_window": 0}, "fp16.loss_scale_window=0: must be >= 1"),
    ({"min_loss_scale": 0}, "fp16.min_loss_scale=0: must be >= 1"),
    ({"hysteresis": 0}, "never backs off"),
    ({"initial_scale_power": 15.5}, "fp16.initial_scale_power=15.5: must be an integer"),
    ({"consecutive_hysteresis": "yes"}, "must be true or false"),
])
def test_refusals(section: dict[str, Any], says: str) -> None:
    with pytest.raises(DeepSpeedConfigError, match=says.replace(".", r"\.")):
        loss_scaling(section)


@pytest.mark.parametrize(("given", "says"), [
    ({"hysteresis": 0}, "hysteresis must be an int >= 1"),
    ({"hysteresis": True}, "hysteresis must be an int >= 1"),
    ({"min_scale": -1.0}, "min_scale must be a finite number >= 0"),
    ({"growth_rule": "megatron"}, "growth_rule must be one of 'torch', 'deepspeed'"),
    ({"dynamic": 0}, "dynamic must be True or False"),
])
def test_scaler_options_refusals(given: dict[str, Any], says: str) -> None:
    with pytest.raises(InvalidArgumentError, match=says):
        ScalerOptions.parse(given)
