"""``deepspeed.pipe``: ``PipelineModule``, ``LayerSpec``, ``TiedLayerSpec`` importable, refused when built:
DeepSpeed's pipeline parallelism is its PipelineEngine's schedule (ds/runtime/pipe/); unidist's own pipelines
are ``unidist.parallel.pipeline`` (GPipe, 1F1B), with another API."""

from __future__ import annotations

from typing import Any

import torch

from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


def _refused(what: str) -> DeepSpeedUnsupportedError:
    return DeepSpeedUnsupportedError(
        f"deepspeed.pipe.{what}: pipeline parallelism needs DeepSpeed's PipelineEngine; run under the deepspeed "
        "launcher with real deepspeed (import deepspeed), or use unidist.parallel.pipeline")


class LayerSpec:
    """DeepSpeed's lazily built layer (typename, *args, **kwargs): refused."""

    def __init__(self, typename: Any, *module_args: Any, **module_kwargs: Any) -> None:
        raise _refused("LayerSpec")


class TiedLayerSpec(LayerSpec):
    """A LayerSpec whose weights are tied across stages: refused."""

    def __init__(self, key: str, typename: Any, *module_args: Any, **module_kwargs: Any) -> None:
        raise _refused("TiedLayerSpec")


class PipelineModule(torch.nn.Module):
    """DeepSpeed's pipeline model (layers, num_stages, loss_fn, ...): refused."""

    def __init__(self, layers: Any, num_stages: int | None = None, *args: Any, **kwargs: Any) -> None:
        raise _refused("PipelineModule")
