"""``deepspeed.moe.utils``: the param-group helpers around MoE layers (DeepSpeed 0.19.8's ds/moe/utils.py).

``is_moe_param`` is DeepSpeed's test (a parameter its MoE layer marked ``allreduce = False``; ``layer.MoE`` here
marks its experts the same way). ``split_params_into_different_moe_groups_for_optimizer`` returns what DeepSpeed's
does: a dict becomes ``[dict]``, a tuple a list, anything else raises ValueError; each group keeps its dense
parameters, and for each group and each expert group name a new group ``{**group, 'name': <group_name>, 'moe':
True, 'params': [...]}`` is appended, cut into groups of at most ``max_group_size`` elements. The groups are the
caller's own dicts, edited in place as DeepSpeed edits them. One difference: DeepSpeed reads ``params`` twice, so a
generator there ends up an empty list; here it is read once and kept.
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.parallel.moe import MoE, is_expert_param

__all__ = ["has_moe_layers", "is_moe_param", "is_moe_param_group",
           "split_params_into_different_moe_groups_for_optimizer", "split_params_into_shared_and_expert_params"]

ParamGroups = dict[str, Any] | tuple[dict[str, Any], ...] | list[dict[str, Any]]


def is_moe_param(param: torch.Tensor) -> bool:
    """Whether a MoE layer marked ``param`` as an expert parameter (``param.allreduce`` is False)."""
    return is_expert_param(param)


def is_moe_param_group(param_group: dict[str, Any]) -> bool:
    """Whether the group is an MoE group (DeepSpeed's ``'moe'`` key)."""
    return bool(param_group.get("moe", False))


def has_moe_layers(m: torch.nn.Module) -> tuple[bool, int]:
    """(whether ``m`` holds a MoE layer, the experts of the last one found), as DeepSpeed's."""
    found, experts = False, 0
    for module in m.modules():
        if isinstance(module, MoE):
            found, experts = True, module.num_experts
    return found, experts


def split_params_into_shared_and_expert_params(
        params: list[torch.nn.Parameter]) -> tuple[list[torch.nn.Parameter], list[torch.nn.Parameter]]:
    """(shared, expert) parameters, in their order."""
    params = list(params)
    return [p for p in params if not is_moe_param(p)], [p for p in params if is_moe_param(p)]


def split_params_into_different_moe_groups_for_optimizer(param_groups: ParamGroups,
                                                         max_group_size: float | None = 178956971
                                                         ) -> list[dict[str, Any]]:
    """The optimizer's param groups with each expert group's parameters moved into groups of their own."""
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
    names = sorted({p.group_name for g in groups for p in g["params"] if is_moe_param(p)})
    moe: dict[str, dict[str, dict[str, Any]]] = {
        g["name"]: {name: {**g, "name": name, "moe": True, "params": []} for name in names} for g in groups}
    for group in groups:
        dense = []
        for p in group["params"]:
            if is_moe_param(p):
                moe[group["name"]][p.group_name]["params"].append(p)
            else:
                dense.append(p)
        group["params"] = dense
    for per_name in moe.values():
        for group in per_name.values():
            if max_group_size is None:
                groups.append(group)
                continue
            run: list[torch.nn.Parameter] = []
            size = 0
            for p in group["params"]:
                if run and size + p.numel() > max_group_size:
                    groups.append({**group, "params": run})
                    run, size = [], 0
                run.append(p)
                size += p.numel()
            if run:
                groups.append({**group, "params": run})
    return groups
