"""The deepspeed backend's precision and config agreement, without launching (engines/deepspeed/config.py and the
refusals in engines/deepspeed/trainer.py); the engine itself is tested under the deepspeed launcher
(tests/multiproc/test_ds_precision.py)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import pytest
import torch

from unidist import Config
from unidist.engines.deepspeed import config as ds_config
from unidist.errors import ConfigError, InvalidArgumentError
from unidist.request import PrepareRequest
from unidist.train.precision import Precision

LAUNCH_CONFIG = "launch_scripts/ds_config.json"  # stage 2, gradient_clipping 1.0, fp16/bf16 switched off


def opts(env: Mapping[str, str] | None = None, **given: Any) -> PrepareRequest:
    """What prepare(**given) builds in an environment with ``env``."""
    return PrepareRequest.build(Config.from_env(dict(env or {})), given)


def agree(o: PrepareRequest, user: Mapping[str, Any], source: Any = LAUNCH_CONFIG, env: bool = True
          ) -> PrepareRequest:
    return ds_config.check_agreement(o, user, source, env=env)


# ----------------------------------------------------------------- precision -> DeepSpeed's sections
@pytest.mark.parametrize(("precision", "dtype"), [("bf16-mixed", "bfloat16"), ("fp16-mixed", "float16")])
def test_mixed_is_torch_autocast_with_float32_gradient_reduction(precision: str, dtype: str) -> None:
    cfg = ds_config.build(opts(precision=precision), 2, None)
    assert cfg["torch_autocast"] == {"enabled": True, "dtype": dtype, "lower_precision_safe_modules": []}
    assert cfg["fp16"] == {"enabled": False} and cfg["bf16"] == {"enabled": False}  # never pure half
    assert cfg["gradient_clipping"] == 0.0


@pytest.mark.parametrize("precision", ["32", "bf16-true"])
def test_no_autocast_otherwise(precision: str) -> None:
    cfg = ds_config.build(opts(precision=precision), 2, None)
    assert cfg["torch_autocast"] == {"enabled": False}


def test_deepspeed_parses_the_mixed_config() -> None:
    pytest.importorskip("deepspeed")
    user = {"zero_optimization": {"stage": 2}}
    o = opts(precision="fp16-mixed", zero_stage=2)
    ds_config.validate(ds_config.build(o, 1, user), user, user)  # one process: DeepSpeed counts the world


# ----------------------------------------------------------------- conflicts (issue 20 part 6)
def test_the_motivating_bug_stage_2_config_and_zero_stage_3() -> None:
    with pytest.raises(ConfigError) as err:
        agree(opts(zero_stage=3), {"zero_optimization": {"stage": 2}})
    assert str(err.value).startswith(
        f"UNIDIST_DEEPSPEED_CONFIG '{LAUNCH_CONFIG}' sets zero_optimization.stage=2 and prepare(zero_stage=3) asks "
        "for 3; set one of them")


def test_an_environment_variable_is_named() -> None:
    with pytest.raises(ConfigError, match=r"sets zero_optimization.stage=2 and UNIDIST_ZERO_STAGE=3 asks for 3"):
        agree(opts({"UNIDIST_ZERO_STAGE": "3"}), {"zero_optimization": {"stage": 2}})


def test_a_config_given_to_prepare_is_named() -> None:
    with pytest.raises(ConfigError, match=r"^prepare\(deepspeed_config='ds.json'\) sets zero_optimization.stage=1"):
        agree(opts(zero_stage=3), {"zero_optimization": {"stage": 1}}, "ds.json", env=False)
    with pytest.raises(ConfigError, match=r"^prepare\(deepspeed_config=\{...\}\) sets zero_optimization.stage=1"):
        agree(opts(zero_stage=3), {"zero_optimization": {"stage": 1}}, {"zero_optimization": {"stage": 1}},
              env=False)


def test_agreement_is_silent_and_a_default_follows_the_config() -> None:
    user = {"zero_optimization": {"stage": 2}, "gradient_clipping": 1.0, "gradient_accumulation_steps": 4,
            "torch_autocast": {"enabled": True, "dtype": "fp16"}}
    same = agree(opts(zero_stage=2, clip_grad_norm=1.0, backward_passes_per_step=4, precision="fp16-mixed"), user)
    assert (same.zero_stage, same.clip_grad_norm, same.backward_passes_per_step, same.precision) == \
        (2, 1.0, 4, "fp16-mixed")
    followed = agree(opts(), user)  # nothing set: the config's values, and the unidist side follows them
    assert (followed.zero_stage, followed.backward_passes_per_step, followed.precision) == (2, 4, "fp16-mixed")
    cfg = ds_config.build(followed, 2, user)
    assert (cfg["zero_optimization"]["stage"], cfg["gradient_accumulation_steps"], cfg["gradient_clipping"]) == \
        (2, 4, 1.0)
    assert cfg["train_batch_size"] == 4 * 2


@pytest.mark.parametrize(("given", "user", "message"), [
    ({"clip_grad_norm": 0.5}, {"gradient_clipping": 1.0},
     "sets gradient_clipping=1.0 and prepare(clip_grad_norm=0.5) asks for 0.5"),
    ({"backward_passes_per_step": 2}, {"gradient_accumulation_steps": 4},
     "sets gradient_accumulation_steps=4 and prepare(backward_passes_per_step=2) asks for 2"),
    ({"precision": "fp16-mixed"}, {"fp16": {"enabled": True}},
     "sets fp16.enabled=true (DeepSpeed's float16 model with fp32 master weights, not autocast) and "
     "prepare(precision='fp16-mixed') asks for 'fp16-mixed'"),
    ({"precision": "bf16-mixed"}, {"bf16": {"enabled": True}}, "sets bf16.enabled=true"),
    ({"precision": "bf16-mixed"}, {"torch_autocast": {"enabled": True, "dtype": "fp16"}},
     "sets torch_autocast={enabled: true, dtype: 'fp16'} and prepare(precision='bf16-mixed') asks for"),
    ({"precision": "32"}, {"torch_autocast": {"enabled": True, "dtype": "bf16"}}, "prepare(precision='32')"),
    ({}, {"torch_autocast": {"enabled": True, "dtype": "bf16"}},  # via the environment
     "and UNIDIST_PRECISION=fp16-mixed asks for 'fp16-mixed'"),
    ({"precision": "fp16-mixed"}, {"torch_autocast": {"enabled": False}}, "sets torch_autocast.enabled=false"),
])
def test_disagreements_name_both(given: dict[str, Any], user: dict[str, Any], message: str) -> None:
    env = {} if given else {"UNIDIST_PRECISION": "fp16-mixed"}
    with pytest.raises(ConfigError) as err:
        agree(opts(env, **given), user)
    assert message in str(err.value)
    assert LAUNCH_CONFIG in str(err.value) and "set one of them" in str(err.value)


def test_deepspeed_half_sections_switched_off_agree_with_autocast() -> None:
    user = {"fp16": {"enabled": False}, "bf16": {"enabled": False}}  # as launch_scripts/ds_config.json
    assert agree(opts(precision="bf16-mixed"), user).precision == "bf16-mixed"


def test_the_launch_scripts_config_with_its_own_stage_and_clip() -> None:
    import json
    from pathlib import Path

    user = json.loads((Path(__file__).resolve().parents[2] / LAUNCH_CONFIG).read_text())
    assert agree(opts(zero_stage=2, clip_grad_norm=1.0, precision="bf16-mixed"), user).zero_stage == 2
    with pytest.raises(ConfigError, match=r"zero_optimization\.stage=2 and prepare"):
        agree(opts(zero_stage=3), user)


# ----------------------------------------------------------------- what DeepSpeed cannot do with unidist's meaning
def test_refusals() -> None:
    from unidist.engines.deepspeed.trainer import DeepSpeedTrainer

    check = DeepSpeedTrainer._check_precision
    check(Precision("bf16-true"), 0)  # a bfloat16 model and the user's optimizer: runs
    for stage in (1, 2, 3):
        with pytest.raises(InvalidArgumentError, match=r"precision='bf16-true'\) is not available on the deepspeed "
                                                       r"backend at ZeRO stage .*Use precision='bf16-master' or "
                                                       r"'bf16-mixed'"):
            check(Precision("bf16-true"), stage)
        for ok in ("32", "bf16-mixed", "fp16-mixed"):
            check(Precision(ok), stage)


# ----------------------------------------------------------------- the reporting on EngineOptimizer
class _Engine:
    skipped_steps = 0
    _step_applied = True

    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def gradient_accumulation_steps(self) -> int:
        return 3


def test_engine_optimizer_reports_as_unidists_optimizers() -> None:
    from unidist.engines.deepspeed.trainer import EngineOptimizer

    for name in ("loss_scale", "last_step_skipped", "skipped_steps", "backward_passes_per_step"):
        assert isinstance(getattr(EngineOptimizer, name), property), name  # not forwarded by __getattr__
    inner = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    opt = EngineOptimizer(_Engine(inner), inner, [], None)
    assert (opt.loss_scale, opt.last_step_skipped, opt.skipped_steps, opt.backward_passes_per_step) == \
        (1.0, False, 0, 3)


def test_the_scaler_state_is_loss_scalers() -> None:
    """An fp16 checkpoint's scale resumes across backends: AgreedGradScaler and LossScaler read each other's."""
    from unidist.engines.deepspeed.scaler import AgreedGradScaler
    from unidist.request import ScalerOptions
    from unidist.train.precision import LossScaler

    ours = AgreedGradScaler(ScalerOptions(init_scale=8.0, growth_interval=3), torch.device("cpu"), None)
    theirs = LossScaler(ScalerOptions(init_scale=32.0), torch.device("cpu"))
    theirs.skipped_steps = 2
    ours.load_state_dict(theirs.state_dict())
    assert (ours.scale_value, ours.skipped_steps, ours.state_dict()["growth_interval"]) == (32.0, 2, 3)
    back = LossScaler(ScalerOptions(), torch.device("cpu"))
    back.load_state_dict(ours.state_dict())
    assert (back.scale_value, back.skipped_steps) == (32.0, 2)
