"""A DeepSpeed config's ``optimizer`` section built on torch.optim, with DeepSpeed 0.19.8's meaning.

DeepSpeed's ``"type": "Adam"`` is not torch's Adam: ``adam_w_mode`` defaults to True, so its ``weight_decay`` is
decoupled (AdamW) decay, and its FusedAdam's ``weight_decay`` defaults to 0 where torch.optim.AdamW's is 0.01
(``deepspeed/runtime/engine.py:2470-2493``, ``ops/adam/fused_adam.py:76-85``). FusedAdam's update is torch's
AdamW/Adam update (``ops/csrc/includes/cpu_adam.h:94-205``), so off DeepSpeed ``build_optimizer`` gives
``torch.optim.AdamW`` (adam_w_mode) or ``torch.optim.Adam`` (L2 decay) with weight_decay passed explicitly.
Type names follow DeepSpeed's lookup (``runtime/config.py:519``, ``engine.py:2548``): its own optimizer names in
any case, any other name as a ``torch.optim`` attribute, case-sensitive.
"""

from __future__ import annotations

import inspect
from collections.abc import Iterable, Mapping
from typing import Any

import torch

from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.compat.deepspeed.ops.adam import DeepSpeedCPUAdam, FusedAdam

__all__ = ["ZERO_SUPPORTED", "build_optimizer", "check_zero_supported", "optimizer_name"]

ADAM, ADAMW, ADAGRAD = "adam", "adamw", "adagrad"
# DeepSpeed's own names (config.py:53-66): lowercased wherever they appear.
DEEPSPEED_OPTIMIZERS = (ADAGRAD, ADAM, ADAMW, "lamb", "muadam", "muadamw", "musgd", "lion", "muon")
# Built from DeepSpeed's kernels or mup: nothing on torch.optim computes the same.
_KERNEL_ONLY = {"lamb": "FusedLamb", "lion": "FusedLion", "muadam": "mup.MuAdam", "muadamw": "mup.MuAdamW",
                "musgd": "mup.MuSGD", "muon": "MuonWithAuxAdam"}
# ZeRO's tested optimizers that exist off DeepSpeed (zero/utils.py:45-48: exact types, subclasses do not count).
ZERO_SUPPORTED: tuple[type, ...] = (torch.optim.Adam, torch.optim.AdamW, torch.optim.Adagrad, FusedAdam,
                                    DeepSpeedCPUAdam)  # the last two: deepspeed.ops.adam's, DeepSpeed's own kernels
# FusedAdam's defaults where they differ from torch's: weight_decay 0 (torch.optim.AdamW: 0.01).
_FUSED_ADAM_DEFAULTS: Mapping[str, Any] = {"lr": 1e-3, "betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.0}
# FusedAdam/DeepSpeedCPUAdam arguments that torch's Adam has no use for once mapped (engine.py:2377-2409).
_ADAM_DROPPED = ("torch_adam", "fp32_optimizer_states", "set_grad_none", "foreach")


def optimizer_name(section: Mapping[str, Any]) -> str:
    """The section's type as DeepSpeed keeps it: its own optimizer names lowercased, any other name as given."""
    name = section.get("type")
    if not isinstance(name, str) or not name:
        raise DeepSpeedConfigError(f"optimizer.type must name an optimizer (\"Adam\", \"AdamW\", \"SGD\" ...), "
                                   f"got {name!r}")
    return name.lower() if name.lower() in DEEPSPEED_OPTIMIZERS else name


def _adam(name: str, params: dict[str, Any]) -> tuple[type[torch.optim.Optimizer], dict[str, Any]]:
    """Adam/AdamW: effective adam_w_mode = type AdamW or adam_w_mode (default True) (engine.py:2486-2493)."""
    adam_w_mode = params.pop("adam_w_mode", True)
    if not isinstance(adam_w_mode, bool):
        raise DeepSpeedConfigError(f"optimizer.params.adam_w_mode must be true or false, got {adam_w_mode!r}")
    if params.pop("bias_correction", True) is not True:
        raise DeepSpeedUnsupportedError("optimizer.params.bias_correction=false: torch's Adam/AdamW always correct "
                                        "the moments' bias; run under the deepspeed launcher (FusedAdam) or remove it")
    if params.get("amsgrad"):  # FusedAdam refuses it (fused_adam.py:85)
        raise DeepSpeedConfigError("optimizer.params.amsgrad: DeepSpeed's FusedAdam does not support the AMSGrad "
                                   "variant; remove it")
    params.pop("amsgrad", None)
    # "torch_adam": true is torch's AdamW/Adam with torch's own defaults (engine.py:2380-2382): weight_decay 0.01
    # for AdamW where FusedAdam's is 0
    defaults = {} if params.get("torch_adam") else _FUSED_ADAM_DEFAULTS
    for key in _ADAM_DROPPED:
        params.pop(key, None)
    decoupled = name == ADAMW or adam_w_mode
    return (torch.optim.AdamW if decoupled else torch.optim.Adam), {**defaults, **params}


def build_optimizer(section: Mapping[str, Any], params: Iterable[Any], *, zero_stage: int,
                    allow_untested: bool) -> torch.optim.Optimizer:
    """The torch optimizer DeepSpeed would build from ``section`` (``{"type": ..., "params": {...}}``).

    Args:
        section: the config's ``optimizer`` section.
        params: the model's parameters or param groups (``model_parameters``).
        zero_stage: the config's ZeRO stage: a non-Adam/AdamW/Adagrad optimizer at stage >= 1 needs
            ``allow_untested`` (``zero_allow_untested_optimizer``), as in DeepSpeed (engine.py:2296-2301).
        allow_untested: the config's ``zero_allow_untested_optimizer``.

    Raises:
        DeepSpeedConfigError: unknown type or parameter (named), ``max_grad_norm`` in params, untested optimizer.
        DeepSpeedUnsupportedError: Lamb/Lion/Mu*/Muon/OneBit*, which need DeepSpeed's kernels.
    """
    name = optimizer_name(section)
    kwargs = dict(section.get("params") or {})
    if "max_grad_norm" in kwargs:  # engine.py:2481-2484 (a ValueError there too)
        raise DeepSpeedConfigError("'max_grad_norm' is not supported as an optimizer parameter, please switch to "
                                   "using the deepspeed parameter 'gradient_clipping' see: "
                                   "https://www.deepspeed.ai/docs/config-json/#gradient-clipping for more details")
    if name in _KERNEL_ONLY or name.lower().startswith(("onebit", "zerooneadam")):
        kernel = _KERNEL_ONLY.get(name, name)
        raise DeepSpeedUnsupportedError(f"optimizer.type {section.get('type')!r} is DeepSpeed's {kernel}, built from "
                                        "DeepSpeed's kernels; run under the deepspeed launcher, or use Adam, AdamW, "
                                        "Adagrad or a torch.optim optimizer")
    cls: Any
    if name in (ADAM, ADAMW):
        cls, kwargs = _adam(name, kwargs)
    elif name == ADAGRAD:
        cls = torch.optim.Adagrad
    else:
        cls = getattr(torch.optim, name, None)
        if not (inspect.isclass(cls) and issubclass(cls, torch.optim.Optimizer)):
            known = sorted(n for n, v in vars(torch.optim).items()
                           if inspect.isclass(v) and issubclass(v, torch.optim.Optimizer) and n != "Optimizer")
            lower = {n.lower(): n for n in known}
            hint = f" (the name is case-sensitive: did you mean {lower[name.lower()]!r}?)" if name.lower() in lower \
                else ""
            raise DeepSpeedConfigError(f"optimizer.type {section.get('type')!r} is neither one of DeepSpeed's "
                                       f"(Adam, AdamW, Adagrad) nor a torch.optim optimizer{hint}")
    unknown = sorted(set(kwargs) - set(inspect.signature(cls).parameters))
    if unknown:  # the constructor's TypeError, named (DeepSpeed raises it at initialize)
        raise DeepSpeedConfigError(f"optimizer.params {unknown} are not arguments of {cls.__module__}.{cls.__name__} "
                                   f"(optimizer.type {section.get('type')!r})")
    try:
        optimizer: torch.optim.Optimizer = cls(params, **kwargs)
    except (TypeError, ValueError) as err:
        raise DeepSpeedConfigError(f"optimizer {section.get('type')!r} with params {kwargs}: {err}") from None
    check_zero_supported(optimizer, zero_stage=zero_stage, allow_untested=allow_untested)
    return optimizer


def check_zero_supported(optimizer: torch.optim.Optimizer, *, zero_stage: int, allow_untested: bool) -> None:
    """DeepSpeed's refusal of an untested optimizer under ZeRO (engine.py:2296-2301; also for a client
    optimizer): only the exact types Adam, AdamW and Adagrad pass at stage >= 1 without
    ``zero_allow_untested_optimizer``."""
    if zero_stage >= 1 and type(optimizer) not in ZERO_SUPPORTED and not allow_untested:
        raise DeepSpeedConfigError(f"You are using an untested ZeRO Optimizer ({type(optimizer).__name__} at ZeRO "
                                   f"stage {zero_stage}). Please add <\"zero_allow_untested_optimizer\": true> in "
                                   "the configuration file to use it.")
