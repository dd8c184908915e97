"""``deepspeed.moe.layer.MoE`` on every backend: ``unidist.parallel.moe.MoE`` with DeepSpeed's signature.

The layer's arithmetic, placement and parameter names are DeepSpeed 0.19.8's (``unidist/parallel/moe.py`` says
how); ``forward`` returns ``(output, l_aux, exp_counts)``. Two arguments DeepSpeed has and this layer does not
honour are refused when set: ``use_tutel`` (an optional CUDA kernel library; the math is the same without it, so
False is accepted) and ``enable_expert_tensor_parallelism``. ``noisy_gate_policy="RSample"`` with ``k=2`` is
ignored, as DeepSpeed's top-2 gate ignores it (unidist's own layer refuses the pair). Under the deepspeed backend
the constructor returns DeepSpeed's own layer, so its engine creates the expert groups and reduces the experts'
gradients.
"""

from __future__ import annotations

from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.parallel import moe

__all__ = ["MoE"]


class MoE(moe.MoE):
    """DeepSpeed's MoE layer (ds/moe/layer.py:38-53: hidden_size, expert, num_experts, ep_size, k,
    capacity_factor, eval_capacity_factor, min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts,
    use_tutel, enable_expert_tensor_parallelism, top2_2nd_expert_sampling)."""

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        mgr = state.manager()
        if mgr.backend == "deepspeed":
            return mgr.engine_api.moe.layer.MoE(*args, **kwargs)  # DeepSpeed's class: __init__ is not run
        return super().__new__(cls)

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, use_tutel: bool = False, enable_expert_tensor_parallelism: bool = False,
                 top2_2nd_expert_sampling: bool = True) -> None:
        for name, value in (("use_tutel", use_tutel), ("enable_expert_tensor_parallelism",
                                                       enable_expert_tensor_parallelism)):
            if value:
                raise DeepSpeedUnsupportedError(f"deepspeed.moe.layer.MoE({name}=True) is not supported by "
                                                "unidist.compat.deepspeed; leave it False, or run under the deepspeed "
                                                "launcher with real deepspeed")
        if noisy_gate_policy == "RSample" and k == 2:
            noisy_gate_policy = None  # DeepSpeed's top-2 gate never reads it (sharded_moe.py top2gating)
        super().__init__(hidden_size, expert, num_experts, ep_size, k, capacity_factor, eval_capacity_factor,
                         min_capacity, use_residual, noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling,
                         group=state.manager())
