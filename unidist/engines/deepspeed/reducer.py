"""A DeepSpeed engine at ZeRO stage 0 whose gradients unidist's buckets average (``prepare(reducer=...)``).

At stage 0 DeepSpeed 0.19.8 averages after backward, in ``allreduce_gradients``: every gradient flattened into
one buffer of up to 5e8 elements (a constant, not a config key), one allreduce, the averages copied back; nothing
overlaps backward. On GPT-2 shapes that cost 1.63x a plain allreduce per tensor (benchmarks/RESULTS.md), where
unidist's buckets, started from backward's hooks on the same gloo collectives, cost about half of it. So the
engine stays (its step, clipping, loss scale, counters and checkpoints are DeepSpeed's), its own allreduce is
switched off (``enable_backward_allreduce``, DeepSpeed's switch for engines whose gradients something else
reduces) and a ``GradientReducer`` over the engine's module does the averaging on the engine's accumulation
boundary, outside its ``no_sync``, as the engine would have.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from unidist.comm.protocol import Comm
from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import PrepareRequest
from unidist.train.gradcore import Compression
from unidist.train.precision import Precision
from unidist.train.reducer import GradientReducer

__all__ = ["install", "wanted"]


def wanted(opts: PrepareRequest, config: Mapping[str, Any], stage: int, user_config: object = None) -> bool:
    """Whether unidist's buckets reduce for this engine. ``auto`` says yes only where nothing of the engine's own
    reduction is asked for: stage 0, no user DeepSpeed config (whose predivide factors, fp16 sections or
    communication dtype the engine's reducer implements), no wire compression, float32 parameters.

    Args:
        opts: ``prepare``'s options (``reducer``: auto, engine or unidist).
        config: the DeepSpeed config the engine was built from.
        stage: its ZeRO stage.
        user_config: ``UNIDIST_DEEPSPEED_CONFIG``, if set (a config from the environment counts as the user's).
    """
    if opts.reducer == "engine":
        return False
    if stage != 0:
        if opts.reducer == "unidist":
            raise InvalidArgumentError(
                f"prepare(reducer='unidist') on the deepspeed backend at ZeRO stage {stage}: DeepSpeed's ZeRO "
                "reduces its own partitions; use reducer='auto' or 'engine' with DeepSpeed's ZeRO, or "
                "prepare(group=...) for unidist's ZeRO")
        return False
    plain = (opts.deepspeed_config is None and user_config is None and opts.compression == "none"
             and Precision.of(opts.precision).param_dtype is None
             and not config.get("fp16", {}).get("enabled") and not config.get("bf16", {}).get("enabled"))
    if opts.reducer == "unidist" and not plain:
        raise InvalidArgumentError(
            "prepare(reducer='unidist') on the deepspeed backend needs what unidist's reducer does the same way: no "
            "deepspeed_config, compression='none', precision '32' or '*-mixed'; use reducer='engine' (or 'auto') to "
            "keep DeepSpeed's own reduction")
    return plain


def install(engine: Any, comm: Comm, bucket_bytes: float) -> GradientReducer:
    """Switch the engine's allreduce off and hook unidist's buckets onto its module's parameters.

    Args:
        engine: a DeepSpeed engine at stage 0.
        comm: the ranks the engine averages over (the world: DeepSpeed's data-parallel group).
        bucket_bytes: the most bytes in one bucket (``prepare(bucket_mb=...)``).
    """
    engine.enable_backward_allreduce = False
    params = [p for p in engine.module.parameters() if p.requires_grad]
    return GradientReducer(comm, params, ReduceOp.MEAN, Compression.none, bucket_bytes,
                           lambda: not engine.inside_no_sync_ctxt and engine.is_gradient_accumulation_boundary())
