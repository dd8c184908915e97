"""Under the deepspeed backend a ``PipelineModule`` is DeepSpeed's own, so its PipelineEngine trains it.

``deepspeed.initialize`` on the deepspeed backend hands a DeepSpeed ``PipelineModule`` to DeepSpeed's
``initialize`` unchanged (``initialize.py``); this builds that module from the compat layer's arguments, turning
the compat ``LayerSpec``/``TiedLayerSpec`` objects into DeepSpeed's (its builder checks their classes), and a
compat topology into DeepSpeed's ``ProcessTopology`` of the same axes and sizes (its grid calls its methods).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from unidist.compat.deepspeed.pipe.specs import LayerSpec, TiedLayerSpec
from unidist.compat.deepspeed.pipe.topology import ProcessTopology

__all__ = ["deepspeed_pipeline_module"]


def deepspeed_pipeline_module(mgr: Any, layers: Sequence[Any], *args: Any, **kwargs: Any) -> Any:
    """DeepSpeed's ``PipelineModule(layers, *args, **kwargs)``, the compat specs in ``layers`` made DeepSpeed's."""
    pipe = mgr.engine_api.pipe

    def convert(layer: Any) -> Any:
        if isinstance(layer, TiedLayerSpec):
            return pipe.TiedLayerSpec(layer.key, layer.typename, *layer.module_args, forward_fn=layer.forward_fn,
                                      tied_weight_attr=layer.tied_weight_attr, **layer.module_kwargs)
        if isinstance(layer, LayerSpec):
            return pipe.LayerSpec(layer.typename, *layer.module_args, **layer.module_kwargs)
        return layer

    topology = kwargs.get("topology")
    if isinstance(topology, ProcessTopology):
        kwargs["topology"] = mgr.engine_api.runtime.pipe.topology.ProcessTopology(topology.axes, topology.dims)
    return pipe.PipelineModule([convert(layer) for layer in layers], *args, **kwargs)
