"""precision= on one process: LossScaler against torch's GradScaler, the forward's dtypes, settings that disagree."""

from __future__ import annotations

import copy

import pytest
import torch

import unidist
from unidist import Config, ConfigError, LaunchInfo
from unidist.request import ScalerOptions
from unidist.train.precision import LossScaler, Precision

# the models and batches here are CPU tensors and the forward's autocast is the CPU's: the Manager is told the CPU,
# so that a GPU machine runs the same tests
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("options", [ScalerOptions(), ScalerOptions(init_scale=8.0, growth_factor=3.0,
                                                                    backoff_factor=0.25, growth_interval=3)])
def test_loss_scaler_follows_gradscaler(options: ScalerOptions) -> None:
    """The same inf pattern through both: the same scales, and the same unscaled gradient bits."""
    ref = torch.amp.GradScaler("cpu", init_scale=options.init_scale, growth_factor=options.growth_factor,
                               backoff_factor=options.backoff_factor, growth_interval=options.growth_interval)
    ours = LossScaler(options, torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    for step in range(40):
        bad = step % 7 == 3 or step in (20, 21)
        grad = torch.randn(50, generator=gen) * 1e3
        if bad:
            grad[step] = float("nan") if step % 2 else float("inf")
        p = torch.nn.Parameter(torch.zeros(50))
        opt = torch.optim.SGD([p], lr=0.0)
        ref.scale(torch.ones(()))  # GradScaler makes its scale tensor on first use
        p.grad = grad.clone()
        ref.unscale_(opt)
        mine = grad.clone()
        found = ours.unscale([mine])
        assert bool(found) == bad
        if not bad:
            assert torch.equal(mine, p.grad)
        ref.step(opt)
        ref.update()
        ours.update(found)
        assert ours.scale_value == ref.get_scale(), step
    assert ours.skipped_steps == sum(1 for s in range(40) if s % 7 == 3 or s in (20, 21))
    state = ours.state_dict()
    assert {k: state[k] for k in ref.state_dict()} == ref.state_dict()  # GradScaler's keys and values


@pytest.mark.parametrize("mode", ["32", "bf16-mixed", "fp16-mixed", "bf16-true"])
def test_forward_dtypes(mode: str) -> None:
    with unidist.LocalManager(Config.from_env(ON_CPU), LaunchInfo()) as mgr:
        model = _model()
        model, _ = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), precision=mode)
        seen: list[torch.dtype] = []
        model[0].register_forward_hook(lambda m, a, out: seen.append(out.dtype))
        out = model(torch.randn(3, 4))
        assert out.dtype == torch.float32  # outputs back as float32: the loss is computed in float32
        want = {"32": torch.float32, "bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16,
                "bf16-true": torch.bfloat16}[mode]
        assert seen == [want]
        assert next(model.parameters()).dtype == (torch.bfloat16 if mode == "bf16-true" else torch.float32)
        assert not torch.is_autocast_enabled("cpu")  # left after the forward
        copy.deepcopy(model)(torch.randn(3, 4))  # a copy (an EMA) carries its own hooks


def test_autocast_left_when_the_forward_raises() -> None:
    class Boom(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            raise ValueError("boom")

    model = Boom()
    Precision.of("bf16-mixed").apply(model, torch.device("cpu"))
    with pytest.raises(ValueError, match="boom"):
        model(torch.ones(1))
    assert not torch.is_autocast_enabled("cpu")


@pytest.mark.parametrize(("env", "kwargs", "message"), [
    ({"UNIDIST_ZERO_STAGE": "2"}, {"zero_stage": 3}, "prepare(zero_stage=3) and the environment's "
                                                      "UNIDIST_ZERO_STAGE=2 disagree"),
    ({"UNIDIST_PRECISION": "bf16-mixed"}, {"precision": "fp16-mixed"}, "UNIDIST_PRECISION='bf16-mixed' disagree"),
])
def test_an_argument_and_the_environment_that_disagree(env: dict[str, str], kwargs: dict[str, object],
                                                      message: str) -> None:
    with unidist.LocalManager(Config.from_env(ON_CPU | env), LaunchInfo()) as mgr:
        with pytest.raises(ConfigError) as err:
            mgr.prepare(_model(), torch.optim.SGD(_model().parameters(), lr=0.1), **kwargs)
        assert message in str(err.value)


def test_an_argument_and_the_environment_that_agree() -> None:
    env = {"UNIDIST_ZERO_STAGE": "1", "UNIDIST_PRECISION": "bf16-mixed"}
    with unidist.LocalManager(Config.from_env(ON_CPU | env), LaunchInfo()) as mgr:
        model = _model()
        _, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=1,
                             precision="bf16-mixed")
        assert type(opt).__name__ == "ZeroOptimizer"
    with unidist.LocalManager(Config.from_env(ON_CPU | {"UNIDIST_PRECISION": "fp16-mixed"}), LaunchInfo()) as mgr:
        model = _model()
        _, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))  # the environment's, unasked
        assert opt.loss_scale == 65536.0  # type: ignore[attr-defined]
