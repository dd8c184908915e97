"""``deepspeed.moe.utils``: the param-group helpers, for models without MoE layers.

``is_moe_param`` is DeepSpeed's test (ds/moe/utils.py:29-32: a parameter MoE marked ``allreduce = False``), so it
answers False for every parameter here (no MoE layer can be built, moe/layer.py). On groups without MoE
parameters ``split_params_into_different_moe_groups_for_optimizer`` returns what DeepSpeed's does
(ds/moe/utils.py:72-160): a dict becomes ``[dict]``, a tuple a list, anything else raises ValueError, each
group's ``params`` becomes a list; the groups are the caller's own dicts (DeepSpeed edits them in place too).
One difference: DeepSpeed reads ``params`` twice, so a generator there ends up an empty list; here it is read
once and kept. Groups holding MoE parameters raise DeepSpeedUnsupportedError.
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.compat.deepspeed.moe.layer import moe_unsupported

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer", "split_params_into_shared_and_expert_params"]

ParamGroups = dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether MoE marked ``param`` as an expert parameter (``param.allreduce`` is False)."""
    return hasattr(param, "allreduce") and not param.allreduce


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether the group is an MoE group (DeepSpeed's ``'moe'`` key)."""
    return bool(param_group.get("moe", False))


def has_moe_layers(m: torch.nn.Module) -> tuple[bool, int]:
    """(False, 0): no MoE layer can exist here (DeepSpeed: whether ``m`` holds one, and its expert count)."""
    return False, 0


def split_params_into_shared_and_expert_params(
        params: list[torch.nn.Parameter]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(shared, expert) parameters; expert ones are refused."""
    params = list(params)
    if any(is_moe_param(p) for p in params):
        raise moe_unsupported("split_params_into_shared_and_expert_params on MoE parameters")
    return params, []


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: float = 178956971) -> list[dict[str, Any]]:
    """The optimizer's param groups with MoE groups split out: unchanged here, where no group has MoE params."""
    if isinstance(param_groups, tuple):
        groups = list(param_groups)
    elif isinstance(param_groups, dict):
        groups = [param_groups]
    elif isinstance(param_groups, list):
        groups = param_groups
    else:
        raise ValueError(f"Unknown param group type of {type(param_groups)}")  # ds/moe/utils.py:96
    for group in groups:
        group["params"] = list(group["params"])
        if any(is_moe_param(p) for p in group["params"]):
            raise moe_unsupported("split_params_into_different_moe_groups_for_optimizer on MoE parameters")
    return groups
