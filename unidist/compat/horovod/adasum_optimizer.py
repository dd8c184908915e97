"""``hvd.DistributedOptimizer(..., op=hvd.Adasum)`` on more than one rank: Horovod's delta optimizer.

Adasum combines what each rank would do on its own, so the local optimizer steps first, on the local gradient,
and the ranks' parameter changes are combined: when a parameter's ``backward_passes_per_step``-th gradient is
accumulated, a hook saves the parameter (``start``), steps the wrapped optimizer on that parameter alone and
turns the parameter into its delta (``new - start``); ``step()`` reduces every delta with Adasum and sets each
parameter to ``start + reduced delta``. Optimizer state (momentum, Adam moments) therefore stays local to each
rank, as in Horovod. ``step()`` first does the local step of every parameter whose hook has not (no gradient
this step, or fewer passes than ``backward_passes_per_step``). ``synchronize()`` does nothing and
``skip_synchronize()`` is refused, as in Horovod; so is ``zero_grad()`` between ``backward()`` and ``step()``.

As ``DistributedOptimizer``, the result is an instance of a subclass of the user's optimizer class built on the
same ``param_groups`` (with its own, fresh state).

One difference in mechanics, none in results: Horovod starts each delta's reduction in the hook and matches them
across ranks by name; unidist's engines match calls by order, so ``step()`` reduces all deltas in one fused Adasum
call in parameter order (per-tensor coefficients, as Horovod's fused buffer), the same on every rank whatever
order the hooks ran in.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from unidist.comm.communicator import Communicator
from unidist.compat.horovod.adasum import adasum_, check_adasum
from unidist.compat.horovod.exceptions import OptimizerProtocolError
from unidist.compat.horovod.process_sets import global_process_set
from unidist.compat.horovod.protocol import TOO_MANY_PASSES, ZERO_GRAD_MID_STEP, check_named_parameters
from unidist.errors import NotInitializedError

__all__ = ["adasum_optimizer"]


def _world() -> Communicator:
    """The communicator Adasum runs over: always the world (Adasum refuses other process sets): the Manager
    ``hvd.init()`` started, else one started with ``unidist.init()`` (the Adasum optimizer used directly)."""
    from unidist.compat.horovod import basics
    from unidist.managers.base import get_manager

    try:
        comm: Communicator = basics.manager()
    except NotInitializedError as err:  # Horovod's not-initialized error, unless unidist has a Manager
        try:
            comm = get_manager()
        except NotInitializedError:
            raise err from None
    return comm


class _AdasumOptimizer(torch.optim.Optimizer):
    """Mixed in front of the user's optimizer class by ``adasum_optimizer``: see the module docstring."""

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 compression: Any, backward_passes_per_step: int) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the user's optimizer class, its own defaults
        named = list(named_parameters) if named_parameters is not None else \
            [(f"allreduce.noname.{i}", v) for g in self.param_groups for i, v in enumerate(g["params"])]
        check_named_parameters(named, self.param_groups)
        self._ada_compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        # parameters in a fixed order (param_groups'), so every rank reduces the same list
        self._ada_params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        self._ada_delay = {id(p): backward_passes_per_step for p in self._ada_params}
        self._ada_start = {id(p): torch.zeros_like(p, requires_grad=False) for _, p in named}
        # id(p) -> (compressed delta, ctx) once the local step is done, None while passes remain (Horovod's
        # _handles: non-empty between backward() and step())
        self._ada_pending: dict[int, tuple[torch.Tensor, Any] | None] = {}
        self._ada_hooks = []
        for p in self._ada_params:
            p.grad = torch.zeros_like(p)
            self._ada_hooks.append(p.register_post_accumulate_grad_hook(self._ada_hook))  # type: ignore[no-untyped-call]

    def _ada_hook(self, p: torch.Tensor) -> None:
        key = id(p)
        if self._ada_pending.get(key) is not None and self._ada_delay[key] <= 0:
            raise OptimizerProtocolError(TOO_MANY_PASSES)
        self._ada_delay[key] -= 1
        self._ada_pending[key] = self._ada_local_step(p) if self._ada_delay[key] == 0 else None

    def _ada_local_step(self, p: torch.Tensor) -> tuple[torch.Tensor, Any]:
        """Step the wrapped optimizer on ``p`` alone; ``p`` becomes its delta, compressed for the reduction."""
        check_adasum(_world().size, True)  # Horovod refuses here too: when the first reduction would start
        start = self._ada_start[id(p)]
        stashed = [g["params"] for g in self.param_groups]
        for g in self.param_groups:
            g["params"] = [p] if any(p is v for v in g["params"]) else []
        try:
            with torch.no_grad():
                start.copy_(p)
            super().step()
            with torch.no_grad():
                p.sub_(start)
            compressed, ctx = self._ada_compression.compress(p)
        finally:
            for g, params in zip(self.param_groups, stashed, strict=True):
                g["params"] = params
        return compressed.detach(), ctx

    # ------------------------------------------------------------------ Horovod's optimizer protocol
    def synchronize(self) -> None:
        """Nothing to do: the deltas are reduced in ``step()`` (Horovod's Adasum optimizer: the same)."""

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        raise OptimizerProtocolError("Skipping synchronization is not supported when using Adasum optimizer.")
        yield  # pragma: no cover  (a generator, so the refusal comes at ``with``, as Horovod's)

    def step(self, closure: Any = None) -> Any:
        """Local steps still due, one Adasum of every delta, then ``p = start + reduced delta``."""
        loss = closure() if closure is not None else None
        done: list[tuple[torch.Tensor, tuple[torch.Tensor, Any]]] = []
        for p in self._ada_params:
            entry = self._ada_pending.get(id(p))
            done.append((p, entry if entry is not None else self._ada_local_step(p)))
        adasum_(_world(), [compressed for _, (compressed, _) in done])
        with torch.no_grad():
            for p, (compressed, ctx) in done:
                start = self._ada_start[id(p)]
                start.add_(self._ada_compression.decompress(compressed, ctx))
                p.copy_(start)
                self._ada_delay[id(p)] = self.backward_passes_per_step
        self._ada_pending.clear()
        return loss

    def step_without_reduction(self) -> Any:
        """The wrapped optimizer class's own step on the gradients as they are (``broadcast_optimizer_state``'s
        state initialisation, as Horovod's)."""
        return super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Refused between ``backward()`` and ``step()``, as in Horovod."""
        if self._ada_pending:
            raise OptimizerProtocolError(ZERO_GRAD_MID_STEP)
        super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for key in self._ada_delay:
            self._ada_delay[key] = passes


def adasum_optimizer(optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                     compression: Any, backward_passes_per_step: int, process_set: Any) -> torch.optim.Optimizer:
    """Horovod's Adasum delta optimizer around ``optimizer`` (see the module docstring); an instance of its class.

    Args:
        optimizer: the torch optimizer to wrap (its ``param_groups`` are shared, its state is not).
        named_parameters: ``model.named_parameters()`` (checked as Horovod checks them).
        compression: ``hvd.Compression.none`` or ``.fp16``: the delta is reduced in the compressed dtype.
        backward_passes_per_step: backward passes whose gradients add up before the local step.
        process_set: must be the global process set (Horovod refuses others for Adasum).
    """
    if process_set is not None and process_set != global_process_set:
        check_adasum(_world().size, False)
    cls = type(type(optimizer).__name__, (_AdasumOptimizer, type(optimizer)), {})
    made: torch.optim.Optimizer = cls(optimizer.param_groups, named_parameters, compression,
                                      backward_passes_per_step)
    return made
