"""``deepspeed.moe``: ``layer.MoE`` and the param-group helpers of ``utils`` on every backend (the layer is
``unidist.parallel.moe``'s, with DeepSpeed's signature; under the deepspeed launcher DeepSpeed's own)."""

from __future__ import annotations

from unidist.compat.deepspeed.moe import layer, utils

__all__ = ["layer", "utils"]
