"""``deepspeed.zero``: the two calls scripts make around ZeRO-3's partitioned parameters.

``GatheredParameters(params)`` gives the full parameters inside the block on every backend (unidist's ZeRO-3
gathers them; on the deepspeed backend DeepSpeed's own call does); with ``modifier_rank`` that rank's edits reach
every rank, as DeepSpeed's do; on parameters built partitioned and not yet given to ``initialize`` it makes them
whole for the block. ``Init`` builds the model inside it partitioned: under the deepspeed launcher it is DeepSpeed's
own; elsewhere it is ``Manager.partitioned_build`` (unidist/train/zero_init.py), whose parameters ``initialize``
shards at ZeRO stage 3 without ever making the model whole (any other stage makes it whole first).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.errors import InvalidArgumentError
from unidist.train import zero_init

__all__ = ["GatheredParameters", "Init"]


@contextlib.contextmanager
def GatheredParameters(params: Any, modifier_rank: int | None = None, fwd_module: Any = None,  # noqa: N802
                       enabled: bool = True) -> Iterator[None]:
    """Full parameters inside the block.

    Args:
        params: a parameter or an iterable of them, of a model ``initialize`` prepared (other tensors are whole).
        modifier_rank: the rank whose edits inside the block every rank keeps (None: read only; edits made
            identically on every rank are kept too).
        fwd_module: accepted (DeepSpeed registers external parameters with it).
        enabled: False makes the block do nothing.
    """
    plist = [params] if isinstance(params, torch.Tensor) else list(params if isinstance(params, Iterable) else [])
    mgr = state.running()
    if mgr is not None and mgr.backend == "deepspeed":  # DeepSpeed's own: its Init's parameters, its engine's
        with mgr.engine_api.zero.GatheredParameters(params, modifier_rank, fwd_module, enabled):
            yield
        return
    if enabled and any(zero_init.is_partitioned(p) for p in plist):  # built by Init, not yet initialized
        with zero_init.gathered([p for p in plist if isinstance(p, torch.nn.Parameter)], modifier_rank):
            yield
        return
    engine = state.engine_of(plist) if enabled and plist else None
    if engine is None:
        yield
        return
    mgr = engine.manager  # the engine's (a Manager started since)
    if modifier_rank is not None and not 0 <= modifier_rank < mgr.size:
        raise InvalidArgumentError(f"GatheredParameters(modifier_rank={modifier_rank}): no such rank (world size "
                                   f"{mgr.size})")
    with mgr.gathered_parameters(engine.prepared_model):
        yield
        if modifier_rank is not None and mgr.size > 1:
            with torch.no_grad():
                for p in plist:
                    mgr.broadcast_(p.data, modifier_rank)


class Init:
    """``deepspeed.zero.Init(...)``: modules built inside are partitioned as they are built (see the module).

    Args:
        module: an already built module to partition now (DeepSpeed's ``Init(module=model)``).
        remote_device: None or "cpu" (the parts stay where the parameters are; ``offload_param`` in the config
            decides offloading at ``initialize``); "nvme" is refused.
        enabled: False builds whole.
        data_parallel_group, mpu: only None (the world) off DeepSpeed.
        The other arguments (config_dict_or_path, config, dtype, pin_memory, mem_efficient_linear, ...) are
        accepted: ``initialize`` reads the config, and casts the parameters when it makes them whole.
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        mgr = state.manager()
        if mgr.backend == "deepspeed":
            return mgr.engine_api.zero.Init(*args, **kwargs)  # DeepSpeed's own: it partitions for its engine
        return super().__new__(cls)

    def __init__(self, module: torch.nn.Module | None = None, data_parallel_group: Any = None,
                 mem_efficient_linear: bool = True, remote_device: str | None = None, pin_memory: bool = False,
                 config_dict_or_path: Any = None, config: Any = None, enabled: bool = True, dtype: Any = None,
                 mpu: Any = None, **more: Any) -> None:
        for name, value in (("data_parallel_group", data_parallel_group), ("mpu", mpu)):
            if value is not None:
                raise DeepSpeedUnsupportedError(f"deepspeed.zero.Init({name}=...) is not supported by "
                                                "unidist.compat.deepspeed: parameters are partitioned over the whole "
                                                "world; leave it None, or run under the deepspeed launcher")
        if remote_device not in (None, "cpu", "none"):
            raise DeepSpeedUnsupportedError(f"deepspeed.zero.Init(remote_device={remote_device!r}): NVMe is not "
                                            "supported by unidist.compat.deepspeed; use None or 'cpu'")
        self.build = state.manager().partitioned_build(enabled=enabled)
        if module is not None and enabled:
            zero_init.partition_module(module, self.build.comm)

    def __enter__(self) -> Init:
        self.build.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.build.__exit__(*exc)
