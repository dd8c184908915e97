"""``hvd.elastic.TorchState``: models, optimizers and ElasticSamplers in a State, the rest plain objects.

Each keyword argument that is a ``torch.nn.Module``, a ``torch.optim.Optimizer`` or an ``ElasticSampler``
gets a handler (Horovod's design): ``save`` deep-copies its state dict, ``restore`` loads it back, ``sync``
broadcasts rank 0's. Everything else is an ``ObjectState`` attribute. A written commit holds the model and the
first optimizer as a unidist checkpoint (several models: one ``ModuleDict`` of them), and the other
optimizers' and the samplers' state dicts with the plain objects.
"""

from __future__ import annotations

import copy
from typing import Any

import torch

import unidist
from unidist.compat.horovod.elastic.sampler import ElasticSampler
from unidist.compat.horovod.elastic.state import ObjectState

__all__ = ["TorchState"]


class _Handler:
    """Saves, restores and syncs one tracked object; ``set_value`` is assignment (it saves, as Horovod's)."""

    def __init__(self, value: Any) -> None:
        self.value = value
        self.saved = self._copy()

    def _copy(self) -> Any:
        return copy.deepcopy(self.value.state_dict())

    def save(self) -> None:
        self.saved = self._copy()

    def restore(self) -> None:
        self.value.load_state_dict(self.saved)

    def sync(self) -> None:
        raise NotImplementedError

    def set_value(self, value: Any) -> None:
        self.value = value
        self.save()


class _ModelHandler(_Handler):
    def sync(self) -> None:
        unidist.get_manager().broadcast_parameters(self.value.state_dict(), 0)


class _OptimizerHandler(_Handler):
    def sync(self) -> None:
        unidist.get_manager().broadcast_optimizer_state(self.value, 0)


class _SamplerHandler(_Handler):
    def sync(self) -> None:
        mgr = unidist.get_manager()
        state = self.value.state_dict()
        # indices recorded one by one (older Horovod's record_indices) are each rank's own: take the union
        everyone = mgr.allgather_object(state["processed_indices"])
        state["processed_indices"] = sorted(set().union(*everyone))
        self.value.load_state_dict(mgr.broadcast_object(state, 0))


_HANDLERS: list[tuple[type, type[_Handler]]] = [
    (torch.nn.Module, _ModelHandler),
    (torch.optim.Optimizer, _OptimizerHandler),
    (ElasticSampler, _SamplerHandler),
]


def _handler(value: Any) -> _Handler | None:
    for kind, make in _HANDLERS:
        if isinstance(value, kind):
            return make(value)
    return None


class TorchState(ObjectState):
    """The state of a PyTorch training process, for ``hvd.elastic.run``.

    Args:
        model: a ``torch.nn.Module`` (or None).
        optimizer: a ``torch.optim.Optimizer``, e.g. ``hvd.DistributedOptimizer(...)`` (or None).
        kwargs: more models, optimizers and ``ElasticSampler``s (tracked the same way), and plain picklable
            objects such as ``epoch=0, batch=0`` — all attributes of the state (``state.epoch``).
    """

    def __init__(self, model: torch.nn.Module | None = None, optimizer: torch.optim.Optimizer | None = None,
                 **kwargs: Any) -> None:
        kwargs.update(model=model, optimizer=optimizer)
        handlers: dict[str, _Handler] = {}
        plain: dict[str, Any] = {}
        for name, value in kwargs.items():
            handler = _handler(value)
            if handler is not None:
                handlers[name] = handler
            else:
                plain[name] = value
        self._handlers = handlers
        for name, handler in handlers.items():
            setattr(self, name, handler.value)
        super().__init__(**plain)

    def save(self) -> None:
        for handler in self._handlers.values():
            handler.save()
        super().save()

    def restore(self) -> None:
        for handler in self._handlers.values():
            handler.restore()
        super().restore()

    def sync(self) -> None:
        for handler in self._handlers.values():
            handler.sync()
        super().sync()

    def __setattr__(self, name: str, value: Any) -> None:
        handlers = self.__dict__.get("_handlers", {})
        if name in handlers and name in self.__dict__:
            handlers[name].set_value(value)
        super().__setattr__(name, value)

    # ------------------------------------------------------------------ the written commit
    def _kinds(self, kind: type[_Handler]) -> dict[str, Any]:
        return {n: h.value for n, h in self._handlers.items() if type(h) is kind}

    def _checkpointed(self) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
        """(the model to checkpoint, the optimizer checkpointed with it, the other optimizers)."""
        models = self._kinds(_ModelHandler)
        model: torch.nn.Module
        if len(models) == 1:
            model = next(iter(models.values()))
        else:
            model = torch.nn.ModuleDict(models) if models else torch.nn.Module()
        params = {id(p) for p in model.parameters()}
        optimizers = self._kinds(_OptimizerHandler)
        first = next((n for n, o in optimizers.items()
                      if all(id(p) in params for g in o.param_groups for p in g["params"])), None)
        others = {n: o for n, o in optimizers.items() if n != first}
        return model, optimizers.get(first) if first is not None else None, others

    def _durable(self) -> tuple[torch.nn.Module, Any, dict[str, Any]]:
        model, optimizer, others = self._checkpointed()
        objects = {"objects": dict(self._saved_state),
                   "optimizers": {n: self._handlers[n].saved for n in others},
                   "samplers": {n: self._handlers[n].saved for n in self._kinds(_SamplerHandler)}}
        return model, optimizer, objects

    def _load_durable(self, objects: dict[str, Any]) -> None:
        for group in ("optimizers", "samplers"):
            for name, state in objects.get(group, {}).items():
                if name in self._handlers:
                    self._handlers[name].value.load_state_dict(state)
        super()._load_durable(objects)
