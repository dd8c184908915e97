"""``deepspeed.pipe.PipelineModule``, ``LayerSpec``, ``TiedLayerSpec``: one stage of a layer list, on any engine.

As DeepSpeed 0.19.8 builds it (runtime/pipe/module.py): the layers are cut into ``num_stages`` runs
(``partition.py``), each rank builds and keeps only its stage's (a ``LayerSpec`` is built there, an ``nn.Module``
given whole is kept, a callable runs as it is), named by layer index (``"3.weight"``) so state dicts and
checkpoints carry DeepSpeed's names. ``seed_layers`` seeds each layer's build with ``base_seed + index`` and each
micro-batch's forward through it with ``base_seed * micro-batch offset + index``. ``TiedLayerSpec`` layers with one
key share one module per stage (under ``tied_modules``); the stages holding it start from the first one's weights
and sum its gradients before the step (``tie_groups``). ``activation_checkpoint_interval`` recomputes runs of that
many layers in backward. The schedule is the engine's (``engine.py``, on ``unidist.parallel.Pipeline``).

Under the deepspeed backend the constructor returns DeepSpeed's own ``PipelineModule`` built from the same
arguments (``handoff.py``): its engine runs it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from functools import partial
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.pipe import partition
from unidist.compat.deepspeed.pipe.handoff import deepspeed_pipeline_module
from unidist.compat.deepspeed.pipe.specs import LayerSpec, TiedLayerSpec
from unidist.compat.deepspeed.pipe.topology import PipeGrid, check_stages, stages_of
from unidist.compat.deepspeed.seed import set_random_seed
from unidist.errors import InvalidArgumentError

__all__ = ["LayerSpec", "PipelineModule", "TiedLayerSpec"]


def _layer_name(layer: Any) -> str | None:
    if isinstance(layer, LayerSpec):
        return layer.typename.__name__
    if isinstance(layer, nn.Module):
        return type(layer).__name__
    return getattr(layer, "__name__", None)


def _attr(module: nn.Module, path: str) -> torch.Tensor:
    found: Any = module
    for part in path.split("."):
        found = getattr(found, part)
    return found  # type: ignore[no-any-return]


class PipelineModule(nn.Module):
    """This rank's stage of ``layers`` (see the module docstring).

    Args:
        layers: the model as a sequence of ``nn.Module``s, ``LayerSpec``s and callables (each feeds the next).
        num_stages: the pipeline's depth; it must divide the world (the rest is data parallel).
        topology: DeepSpeed's topology object; not supported here (pass ``num_stages``).
        loss_fn: ``loss_fn(outputs, labels)`` on the last stage (None: the last layer returns the loss).
        seed_layers, seed_fn, base_seed: seed each layer's build and forward (see the module docstring).
        partition_method: ``"parameters"`` (default), ``"uniform"`` or ``"type:<regex>"``.
        activation_checkpoint_interval: recompute runs of this many layers in backward (0: off).
        activation_checkpoint_func: the checkpoint function (default torch's, non-reentrant).
        checkpointable_layers: class names to checkpoint (default: every run holding parameters).
        dynamic_shape: accepted (the micro-batches of a step share a shape; each step announces its own).
    """

    def __new__(cls, *args: Any, **kwargs: Any) -> Any:
        mgr = state.manager()
        if mgr.backend == "deepspeed":
            return deepspeed_pipeline_module(mgr, *args, **kwargs)  # DeepSpeed's class: __init__ is not run
        return super().__new__(cls)

    def __init__(self, layers: Sequence[Any], num_stages: int | None = None, topology: Any = None,
                 loss_fn: Callable[..., Any] | None = None, seed_layers: bool = False,
                 seed_fn: Callable[[int], Any] | None = None, base_seed: int = 1234,
                 partition_method: str = "parameters", activation_checkpoint_interval: int = 0,
                 activation_checkpoint_func: Callable[..., Any] | None = None,
                 checkpointable_layers: list[str] | None = None, dynamic_shape: bool = False) -> None:
        super().__init__()
        mgr = state.manager()
        if topology is not None:  # DeepSpeed's grid: pipe x data (x model of 1), its rank order
            num_stages = stages_of(topology, mgr.size, num_stages)
        if num_stages is None:
            raise InvalidArgumentError("PipelineModule needs num_stages (DeepSpeed: 'must provide num_stages or "
                                       "topology')")
        self.num_stages = check_stages(num_stages, mgr.size)
        method = partition.check_method(partition_method)
        specs = list(layers)
        if not specs:
            raise InvalidArgumentError("PipelineModule(layers=[]) has no layers to place on stages")
        for i, layer in enumerate(specs):
            if isinstance(layer, PipelineModule):
                raise InvalidArgumentError(f"PipelineModule layer {i} is a PipelineModule: nesting is not "
                                           "supported (DeepSpeed: 'RECURSIVE BUILD NOT YET IMPLEMENTED')")
            if not (isinstance(layer, (nn.Module, LayerSpec)) or callable(layer)):
                raise InvalidArgumentError(f"PipelineModule layer {i} is a {type(layer).__name__}: pass nn.Modules, "
                                           "LayerSpecs or callables")
        if isinstance(activation_checkpoint_interval, bool) or not isinstance(activation_checkpoint_interval, int) \
                or activation_checkpoint_interval < 0:
            raise InvalidArgumentError(f"PipelineModule(activation_checkpoint_interval="
                                       f"{activation_checkpoint_interval!r}) takes an int >= 0 (0: off)")
        self.loss_fn, self.seed_layers, self.seed_fn, self.base_seed = loss_fn, seed_layers, seed_fn, base_seed
        self.activation_checkpoint_interval = activation_checkpoint_interval
        self.activation_checkpoint_func = activation_checkpoint_func
        self.checkpointable_layers = checkpointable_layers
        self.dynamic_shape = dynamic_shape
        self.micro_offset = 0
        self._layer_specs = specs
        self.grid = PipeGrid.make(mgr, self.num_stages)
        self.stage_id = self.grid.stage_id
        self.global_rank, self.world_size = mgr.rank, mgr.size
        self.parts = self._partition(method)
        if mgr.rank == 0:
            self._print_partition()
        self._local_start, self._local_stop = self.parts[self.stage_id], self.parts[self.stage_id + 1]
        self.forward_funcs: list[Callable[..., Any]] = []
        self.tied_modules = nn.ModuleDict()
        self.tied_weight_attrs: dict[str, list[str]] = {}
        self._build()
        self.to(mgr.device)
        self.tie_groups = self._tie(mgr)

    # ------------------------------------------------------------------------------------ building
    def _partition(self, method: str) -> list[int]:
        specs = self._layer_specs
        if method == "uniform":
            return partition.uniform(len(specs), self.num_stages)
        if method == "parameters":
            return partition.balanced(self._trainable_counts(), self.num_stages)
        names = [_layer_name(layer) for layer in specs]
        return partition.balanced(partition.type_weights(names, method[len("type:"):]), self.num_stages)

    def _trainable_counts(self) -> list[int]:
        """Each layer's trainable parameters; a LayerSpec is built to count them, as DeepSpeed does (so the
        random state the stage's own layers are built from is the same as under DeepSpeed)."""
        counts = []
        for layer in self._layer_specs:
            module = layer.build() if isinstance(layer, LayerSpec) else layer if isinstance(layer, nn.Module) else None
            counts.append(0 if module is None else sum(p.numel() for p in module.parameters() if p.requires_grad))
        return counts

    def _print_partition(self) -> None:
        """DeepSpeed's printout of the cut (rank 0)."""
        for stage in range(self.num_stages):
            start, stop = self.parts[stage], self.parts[stage + 1]
            print(f"stage={stage} layers={stop - start}")
            for idx, layer in enumerate(self._layer_specs[start:stop]):
                print(f"    {idx + start:2d}: {_layer_name(layer) or layer}")
        if self.loss_fn is not None:
            print(f"  loss: {getattr(self.loss_fn, '__name__', type(self.loss_fn).__name__)}")

    def _build(self) -> None:
        for idx in range(self._local_start, self._local_stop):
            layer = self._layer_specs[idx]
            if self.seed_layers:
                (self.seed_fn or set_random_seed)(self.base_seed + idx)
            if isinstance(layer, TiedLayerSpec):
                if layer.key not in self.tied_modules:
                    self.tied_modules[layer.key] = layer.build()
                    self.tied_weight_attrs[layer.key] = layer.tied_weight_attr
                module = self.tied_modules[layer.key]
                self.forward_funcs.append(module if layer.forward_fn is None else partial(layer.forward_fn, module))
            elif isinstance(layer, (LayerSpec, nn.Module)):
                module = layer.build() if isinstance(layer, LayerSpec) else layer
                self.forward_funcs.append(module)
                self.add_module(str(idx), module)
            else:
                self.forward_funcs.append(layer)

    def _tie(self, mgr: Any) -> dict[str, tuple[Any, list[str]]]:
        """For each tie key (sorted, on every rank): a Group of the stages holding it for this data index; its
        weights start as the first stage's. Returns key -> (group, weight attributes) for this rank's ties."""
        ties: dict[str, tuple[Any, list[str]]] = {}
        keys = sorted({s.key for s in self._layer_specs if isinstance(s, TiedLayerSpec)})
        if self.num_stages == 1:
            return ties
        for key in keys:
            group = mgr.split(self.grid.dp_id if key in self.tied_modules else None, key=self.stage_id)
            if group is None:
                continue
            ties[key] = (group, self.tied_weight_attrs[key])
            with torch.no_grad():
                for name in self.tied_weight_attrs[key]:
                    group.broadcast_(_attr(self.tied_modules[key], name).data, 0)
        return ties

    def stage_owner(self, layer_idx: int) -> int:
        """The stage holding layer ``layer_idx``."""
        for stage in range(self.num_stages):
            if self.parts[stage] <= layer_idx < self.parts[stage + 1]:
                return stage
        raise InvalidArgumentError(f"PipelineModule has no layer {layer_idx} (it has {len(self._layer_specs)})")

    def partitions(self) -> list[int]:
        """The stage boundaries: stage s holds layers ``parts[s]:parts[s + 1]``."""
        return list(self.parts)

    def allreduce_tied_weight_gradients(self) -> None:
        """Sum each tied weight's gradient over the stages holding it (before the data-parallel average)."""
        for key, (group, names) in self.tie_groups.items():
            for name in names:
                weight = _attr(self.tied_modules[key], name)
                if weight.grad is not None:
                    group.allreduce_(weight.grad, "sum")

    def replicated_parameters(self) -> list[nn.Parameter]:
        """The tied modules' parameters on every stage but the first holding them (DeepSpeed marks them
        ``ds_pipe_replicated``: its ZeRO counts each once in the gradient norm)."""
        return [p for key, (group, _) in self.tie_groups.items() if group.rank != 0
                for p in self.tied_modules[key].parameters()]

    # ------------------------------------------------------------------------------------- forward
    def forward(self, forward_input: Any) -> Any:
        """This stage's layers in order (activation checkpointing and layer seeds as configured)."""
        self.micro_offset += 1
        interval = self.activation_checkpoint_interval
        if interval == 0:
            return self._run(0, len(self.forward_funcs), self.micro_offset + 1)(forward_input)
        x = forward_input
        for start in range(0, len(self.forward_funcs), interval):
            stop = min(start + interval, len(self.forward_funcs))
            run = self._run(start, stop, self.micro_offset + 1)
            if self._checkpointable(self.forward_funcs[start:stop]):
                args = x if isinstance(x, tuple) else (x,)
                func = self.activation_checkpoint_func
                x = func(run, *args) if func is not None else checkpoint(run, *args, use_reentrant=False)
            else:
                x = run(x)
        return x

    def _run(self, start: int, stop: int, offset: int) -> Callable[..., Any]:
        def run(*inputs: Any) -> Any:
            x: Any = inputs[0] if len(inputs) == 1 else inputs
            for i, layer in enumerate(self.forward_funcs[start:stop]):
                if self.seed_layers:  # DeepSpeed's seed counts from the stage's first layer, not the run's
                    (self.seed_fn or set_random_seed)(self.base_seed * offset + self._local_start + i)
                x = layer(x)
            return x
        return run

    def _checkpointable(self, funcs: list[Callable[..., Any]]) -> bool:
        """DeepSpeed's rule: a run is recomputed if it holds parameters (or a layer of a named class)."""
        if self.checkpointable_layers is not None:
            return all(type(f).__name__ in self.checkpointable_layers for f in funcs)
        return any(isinstance(f, nn.Module) and any(True for _ in f.parameters()) for f in funcs)
