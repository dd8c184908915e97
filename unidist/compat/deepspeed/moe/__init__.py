"""``deepspeed.moe``: importable, so scripts that import it at the top run (DSE cifar imports
``deepspeed.moe.utils`` and builds ``deepspeed.moe.layer.MoE`` only with ``--moe``). Mixture of Experts needs
DeepSpeed's engine (expert-parallel groups, all-to-all dispatch inside the engine's step): building a MoE layer
raises DeepSpeedUnsupportedError (layer.py); the param-group helpers work for models without MoE (utils.py)."""

from __future__ import annotations

from unidist.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
