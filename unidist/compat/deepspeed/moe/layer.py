"""``deepspeed.moe.layer.MoE``: refused when built (see moe/__init__.py for why)."""

from __future__ import annotations

from typing import Any

import torch

from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError

__all__ = ["MoE", "moe_unsupported"]


def moe_unsupported(what: str) -> DeepSpeedUnsupportedError:
    """The error every MoE entry point raises."""
    return DeepSpeedUnsupportedError(
        f"{what}: Mixture of Experts needs DeepSpeed's engine (expert-parallel groups and all-to-all dispatch); run "
        "under the deepspeed launcher with real deepspeed (import deepspeed), or build the model without MoE layers")


class MoE(torch.nn.Module):
    """DeepSpeed's MoE layer (ds/moe/layer.py:38-53 takes hidden_size, expert, num_experts, ep_size, k, ...):
    construction raises DeepSpeedUnsupportedError."""

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1,
                 k: int = 1, *args: Any, **kwargs: Any) -> None:
        raise moe_unsupported("deepspeed.moe.layer.MoE")
