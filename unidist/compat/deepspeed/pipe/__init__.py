"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` on every backend.

``module.py`` builds a rank's stage of the layers ``specs.py`` describes, as DeepSpeed does (``partition.py`` cuts
the layers, ``topology.py`` places the ranks); ``deepspeed.initialize`` wraps it in ``engine.py``'s
``PipelineEngine``, whose ``train_batch`` runs ``unidist.parallel.Pipeline``'s 1F1B schedule. Under the deepspeed
backend both are DeepSpeed's own (``handoff.py``).
"""

from __future__ import annotations

from unidist.compat.deepspeed.pipe.module import PipelineModule
from unidist.compat.deepspeed.pipe.specs import LayerSpec, TiedLayerSpec

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]
