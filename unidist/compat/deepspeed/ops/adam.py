"""``deepspeed.ops.adam``: ``FusedAdam`` and ``DeepSpeedCPUAdam`` as torch's Adam with DeepSpeed's defaults.

DeepSpeed's kernels compute torch's Adam/AdamW update (``ops/csrc/includes/cpu_adam.h``; optimizers.py says how it
was checked): ``adam_w_mode`` (default True) decouples the weight decay, whose default is 0 (torch's AdamW: 0.01),
and the moments' bias is always corrected. So these are ``torch.optim.Adam`` with ``decoupled_weight_decay`` set
from ``adam_w_mode`` and DeepSpeed's defaults; unidist's ZeRO treats them as the Adam they are. Arguments that only
tune DeepSpeed's kernels are accepted; ``bias_correction=False`` and ``amsgrad=True`` are refused, as DeepSpeed's
FusedAdam refuses AMSGrad.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.compat.deepspeed.missing import uncovered

__all__ = ["DeepSpeedCPUAdam", "FusedAdam"]


class FusedAdam(torch.optim.Adam):
    """DeepSpeed's FusedAdam (ops/adam/fused_adam.py:76-85).

    Args:
        params: parameters or param groups. lr, betas, eps, weight_decay: Adam's (weight_decay default 0).
        bias_correction: must be True. adam_w_mode: decoupled weight decay (AdamW), default True.
        amsgrad: must be False. set_grad_none: accepted (zero_grad sets None, torch's default).
    """

    def __init__(self, params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, adam_w_mode: bool = True,
                 weight_decay: float = 0.0, amsgrad: bool = False, set_grad_none: bool = True) -> None:
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adam_w_mode)
        self.adam_w_mode = adam_w_mode


class DeepSpeedCPUAdam(torch.optim.Adam):
    """DeepSpeed's CPU Adam for ZeRO-Offload (ops/adam/cpu_adam.py): the same update; here it steps wherever the
    parameters are (``prepare(offload="cpu")`` puts ZeRO's shards in host memory).

    Args:
        model_params: parameters or param groups. lr, betas, eps, weight_decay, amsgrad, adamw_mode,
            bias_correction: as FusedAdam's. fp32_optimizer_states: accepted (the states follow the parameters).
    """

    def __init__(self, model_params: Iterable[Any], lr: float = 1e-3, bias_correction: bool = True,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 amsgrad: bool = False, adamw_mode: bool = True, fp32_optimizer_states: bool = True) -> None:
        _check(type(self).__name__, bias_correction, amsgrad)
        super().__init__(model_params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                         decoupled_weight_decay=adamw_mode)
        self.adam_w_mode = adamw_mode


def _check(name: str, bias_correction: bool, amsgrad: bool) -> None:
    if not bias_correction:
        raise DeepSpeedUnsupportedError(f"{name}(bias_correction=False): torch's Adam always corrects the moments' "
                                        "bias; run under the deepspeed launcher with real deepspeed, or drop it")
    if amsgrad:
        raise DeepSpeedUnsupportedError(f"{name}(amsgrad=True): DeepSpeed's FusedAdam does not support AMSGrad "
                                        "either; drop it")


__getattr__ = uncovered(__name__)
