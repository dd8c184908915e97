"""``hvd.DistributedOptimizer``: Horovod's gradient averaging, with its arguments and its loop.

As in Horovod, the result is an instance of a subclass of the user's optimizer class (``isinstance(opt,
torch.optim.SGD)`` holds) built on the same ``param_groups``, with its own state. A hook on every parameter
counts backward passes; on the ``backward_passes_per_step``-th it starts that gradient's reduction (gradients of
the passes in between add up locally and are not divided by the pass count, as in Horovod); ``step()`` first
``synchronize()``s: it starts what has not started (a parameter with no gradient sends zeros), waits, and writes
the results into ``p.grad``. ``op=Average`` sums ``grad / gradient_predivide_factor`` and multiplies by
``gradient_predivide_factor / size``, in Horovod's order; ``compression=hvd.Compression.fp16`` reduces a float16
copy. Gradients are fused as Horovod's tensor fusion does it: consecutive parameters of one dtype, up to
``UNIDIST_BUCKET_MB`` (25) MiB, travel as one flat allreduce when all of them are ready (the sums are
elementwise, so fusion changes no result; it turns ~1 ms per gradient on gloo into ~1 ms per bucket).
``groups``/``num_groups`` instead reduce their lists in one grouped call each, as Horovod's explicit groups.

One difference in mechanics, none in results: Horovod matches operations across ranks by name, in whatever
order ranks start them; unidist's engines match them by order. So reductions start in one fixed order on every
rank: rank 0's parameter order (names exchanged once, when the optimizer is made), last parameters first (the
order backward usually produces them); a gradient ready early waits until those before it are started. Neither a
parameter that gets no gradient on some rank nor param_groups listed in another order on another rank can
reorder anything; ranks naming different parameters get a CollectiveMismatchError.

Sparse gradients are reduced dense and made sparse again (Horovod allgathers indices and values; the sums are
the same). ``op=hvd.Adasum`` on more than one rank is Horovod's delta optimizer (``adasum_optimizer.py``).
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from unidist.compat.horovod import collectives, fingerprint
from unidist.compat.horovod.basics import manager, size
from unidist.compat.horovod.compression import Compression, Compressor
from unidist.compat.horovod.exceptions import OptimizerProtocolError
from unidist.compat.horovod.process_sets import ProcessSet, comm_of, global_process_set
from unidist.compat.horovod.protocol import TOO_MANY_PASSES, ZERO_GRAD_MID_STEP, check_named_parameters
from unidist.errors import CollectiveMismatchError, InvalidArgumentError, NotInitializedError
from unidist.train.gradcore import InOrder, pack

__all__ = ["DistributedOptimizer"]


class _Slot:
    """Gradients reduced by one call, in launch order: a fusion bucket (one flat allreduce, as Horovod's tensor
    fusion buffer) or one of Horovod's explicit groups (one grouped allreduce)."""

    __slots__ = ("compression", "ctxs", "fused", "handle", "params", "ready", "shapes")

    def __init__(self, compression: type[Compressor], params: list[torch.nn.Parameter], fused: bool) -> None:
        self.compression, self.params, self.fused = compression, params, fused  # the optimizer's compressor
        self.ready: set[int] = set()
        self.handle: int | None = None
        self.ctxs: list[Any] = []
        self.shapes: list[torch.Size] = []  # the compressed tensors' shapes (a compressor may change them)

    def finish(self) -> None:
        """Wait for the reduction and write each parameter's (decompressed) result into its gradient."""
        if self.handle is None:
            return
        out = collectives.synchronize(self.handle)
        self.handle = None
        if out is None:
            raise NotInitializedError("DistributedOptimizer: a gradient reduction was dropped mid-step (hvd.shutdown()"
                                      " or hvd.init() between backward() and step()); run backward() again")
        if self.fused:
            outputs, offset = [], 0
            for shape in self.shapes:
                n = shape.numel()
                outputs.append(out[offset:offset + n].view(shape))
                offset += n
        else:
            outputs = list(out)
        compression = self.compression
        for p, result, ctx in zip(self.params, outputs, self.ctxs, strict=True):
            reduced = compression.decompress(result, ctx)
            grad = p.grad
            if grad is None:
                continue
            if grad.is_sparse:
                grad.zero_().add_(reduced if reduced.is_sparse else reduced.to_sparse())
            elif reduced.data_ptr() != grad.data_ptr():  # (a lone gradient was reduced where it lies)
                with torch.no_grad():
                    grad.copy_(reduced)
        self.ctxs, self.shapes = [], []

    def drop(self) -> None:
        """Forget this step's reduction (load_state_dict mid-step)."""
        self.handle, self.ctxs, self.shapes = None, [], []


def _split(items: list[Any], n: int) -> list[list[Any]]:
    """``n`` contiguous, nearly equal parts (the first ``len % n`` one longer), as Horovod's num_groups."""
    d, r = divmod(len(items), n)
    return [items[i * d + min(i, r):(i + 1) * d + min(i + 1, r)] for i in range(n)]


class _HorovodOptimizer(torch.optim.Optimizer):
    """Mixed in front of the user's optimizer class by ``DistributedOptimizer``: see the module docstring."""

    def __init__(self, params: Any, named_parameters: Iterable[tuple[str, torch.Tensor]] | None,
                 compression: type[Compressor], backward_passes_per_step: int, op: int,
                 gradient_predivide_factor: float, groups: int | list[list[torch.Tensor]] | None,
                 sparse_as_dense: bool, process_set: ProcessSet) -> None:
        super().__init__(params)  # type: ignore[call-arg]  # the user's optimizer class: its own defaults
        if named_parameters is not None:
            named = list(named_parameters)
        else:
            named = [(f"allreduce.noname.{i}.{j}", v) for i, g in enumerate(self.param_groups)
                     for j, v in enumerate(g["params"])]
        check_named_parameters(named, self.param_groups)
        self._hvd_names = {id(v): k for k, v in named}
        self._hvd_compression = compression
        self.backward_passes_per_step = backward_passes_per_step
        self.op = op
        self.gradient_predivide_factor = gradient_predivide_factor
        self.sparse_as_dense = sparse_as_dense
        self.process_set = process_set
        self._hvd_delay: dict[int, int] = {}
        self._hvd_touched = False  # a hook ran since the last synchronize (Horovod's non-empty _handles)
        self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self._hvd_hooks: list[Any] = []
        self._hvd_order: InOrder[_Slot] = InOrder(self._launch)
        if process_set.included() and size() > 1:
            self._hvd_register(groups)
        self._hvd_fingerprint = fingerprint.attach(named, process_set, backward_passes_per_step)

    # ------------------------------------------------------------------ hooks and launches
    def _hvd_register(self, groups: int | list[list[torch.Tensor]] | None) -> None:
        params = [p for g in self.param_groups for p in g["params"] if p.requires_grad]
        params = self._rank0_order(params)
        if groups is None:  # fusion buckets of UNIDIST_BUCKET_MB, last parameters first (what backward produces first)
            slots = [_Slot(self._hvd_compression, part, fused=True)
                     for part in pack(params, manager().config.bucket_mb * 2**20, lambda p: (p.dtype, p.device))]
        else:
            if isinstance(groups, list):
                mine = {id(p): p for p in params}
                listed = [[mine[id(p)] for p in group if id(p) in mine] for group in groups]
                seen = {id(p) for group in listed for p in group}
                parts = [g for g in listed if g] + [[p] for p in params if id(p) not in seen]
            else:
                parts = [part for part in _split(params, groups) if part]
            slots = [_Slot(self._hvd_compression, part, fused=False) for part in reversed(parts)]
        for slot in slots:
            self._hvd_order.add(slot)
        for p in params:
            self._hvd_delay[id(p)] = self.backward_passes_per_step
            self._hvd_hooks.append(p.register_post_accumulate_grad_hook(self._hvd_hook))  # type: ignore[no-untyped-call]

    def _rank0_order(self, params: list[torch.nn.Parameter]) -> list[torch.nn.Parameter]:
        """``params`` in rank 0's order of their names, on every rank. Horovod pairs reductions by name; here
        buckets and launches follow one order, so a rank whose param_groups list them otherwise (built from a
        set, say) still reduces each gradient with its namesakes. Ranks naming different parameters: an error
        on every rank."""
        names = [self._hvd_names[id(p)] for p in params]
        lists = comm_of(self.process_set).allgather_object(names)
        for r, theirs in enumerate(lists):
            if sorted(theirs) != sorted(lists[0]):
                only = sorted(set(theirs) ^ set(lists[0]))[:5]
                raise CollectiveMismatchError(f"DistributedOptimizer: rank {r} names other parameters than rank 0 "
                                              f"(differing: {only}); every rank must wrap the same model's parameters")
        position = {name: i for i, name in enumerate(lists[0])}
        return sorted(params, key=lambda p: position[self._hvd_names[id(p)]])

    def _hvd_hook(self, p: torch.Tensor) -> None:
        delay = self._hvd_delay[id(p)]
        if delay <= 0:
            raise OptimizerProtocolError(TOO_MANY_PASSES)
        self._hvd_touched = True
        self._hvd_delay[id(p)] = delay - 1
        if delay == 1:
            self._hvd_order.ready(p)
            self._hvd_order.launch_ready()

    def _launch(self, slot: _Slot) -> None:
        tensors = []
        for p in slot.params:
            if p.grad is None:  # no gradient here; another rank may have one
                p.grad = torch.zeros_like(p)
            grad = p.grad
            tensor = grad.to_dense() if grad.is_sparse else grad
            compressed, ctx = self._hvd_compression.compress(tensor)
            tensors.append(compressed)
            slot.ctxs.append(ctx)
            slot.shapes.append(compressed.shape)
        name = self._hvd_names[id(slot.params[0])]
        if not slot.fused:  # Horovod's explicit groups: one grouped call, without the predivide split
            slot.handle = collectives.grouped_allreduce_async_(tensors, name=name, op=self.op,
                                                               process_set=self.process_set)
            return
        pre = post = 1.0
        if self.op == collectives.Average:  # the average split around the sum; the backend adds 1/size after it
            pre, post = 1.0 / self.gradient_predivide_factor, self.gradient_predivide_factor
        flat = tensors[0].reshape(-1) if len(tensors) == 1 else torch.cat([t.reshape(-1) for t in tensors])
        slot.handle = collectives.allreduce_async_(flat, name=name, op=self.op, prescale_factor=pre,
                                                   postscale_factor=post, process_set=self.process_set)

    # ------------------------------------------------------------------ Horovod's optimizer protocol
    def synchronize(self) -> None:
        """Start every reduction not started yet, wait for all, and write the results into ``p.grad``."""
        if not self.process_set.included():
            self._hvd_synchronized = True
            return
        if self._hvd_order.slots:
            self._hvd_order.drain()
            for p_id in self._hvd_delay:
                self._hvd_delay[p_id] = self.backward_passes_per_step
        self._hvd_touched = False
        self._hvd_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self) -> Iterator[None]:
        """``step()`` inside does not synchronize: for ``synchronize(); clip or unscale; step()`` loops."""
        self._hvd_should_synchronize = False
        try:
            yield
        finally:
            self._hvd_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        """Synchronize (unless inside ``skip_synchronize()``), then the wrapped optimizer's step."""
        if self._hvd_should_synchronize:
            if self._hvd_synchronized:
                warnings.warn("optimizer.step() called without optimizer.skip_synchronize() context after "
                              "optimizer.synchronize(). This can cause training slowdown. You may want to consider "
                              "using optimizer.skip_synchronize() context if you use optimizer.synchronize() in "
                              "your code.", stacklevel=2)
            self.synchronize()
        self._hvd_synchronized = False
        result = super().step(closure)
        if self._hvd_fingerprint is not None:
            fingerprint.record(self._hvd_fingerprint, self.param_groups)
        return result

    def step_without_reduction(self) -> Any:
        """The wrapped optimizer class's own step on the gradients as they are (``broadcast_optimizer_state``'s
        state initialisation: Horovod's ``super(optimizer.__class__, optimizer).step()``)."""
        return super().step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Refused between ``backward()`` and ``step()``/``synchronize()``, as in Horovod (the reductions in
        flight write into the gradients)."""
        if self._hvd_touched:
            raise OptimizerProtocolError(ZERO_GRAD_MID_STEP)
        super().zero_grad(set_to_none=set_to_none)

    def set_backward_passes_per_step(self, passes: int) -> None:
        self.backward_passes_per_step = passes
        for p_id in self._hvd_delay:
            self._hvd_delay[p_id] = passes

    def load_state_dict(self, state_dict: Any) -> None:
        """As Horovod: a step in progress is forgotten (its reductions dropped), then the state is loaded."""
        self._hvd_order.reset()
        for slot in self._hvd_order.slots:
            slot.drop()
        self._hvd_touched = self._hvd_synchronized = False
        self._hvd_should_synchronize = True
        self.set_backward_passes_per_step(self.backward_passes_per_step)
        super().load_state_dict(state_dict)


def DistributedOptimizer(optimizer: torch.optim.Optimizer,  # noqa: N802  (Horovod's name)
                         named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                         compression: type[Compressor] = Compression.none, backward_passes_per_step: int = 1,
                         op: int = collectives.Average, gradient_predivide_factor: float = 1.0, num_groups: int = 0,
                         groups: int | list[list[torch.Tensor]] | None = None, sparse_as_dense: bool = False,
                         process_set: ProcessSet = global_process_set) -> torch.optim.Optimizer:
    """Horovod's distributed optimizer around ``optimizer`` (see the module docstring).

    Args:
        optimizer: the torch optimizer to wrap; the result is an instance of its class.
        named_parameters: ``model.named_parameters()``: names key the reductions (every optimizer parameter
            must be named, names unique).
        compression: ``hvd.Compression.none`` or ``.fp16`` (or any class with static compress/decompress).
        backward_passes_per_step: backward passes whose gradients add up locally before one reduction.
        op: ``hvd.Average`` (default), ``hvd.Sum`` or ``hvd.Adasum``.
        gradient_predivide_factor: with Average, gradients are multiplied by 1/f before the sum and f/size after.
        num_groups: deprecated spelling of ``groups=n``.
        groups: n (reduce the parameters in n grouped calls) or lists of parameters reduced together.
        sparse_as_dense: reduce sparse gradients as dense ones (they are reduced dense in any case here).
        process_set: the ranks that average their gradients (default: all).
    """
    if gradient_predivide_factor != 1.0 and op != collectives.Average:
        raise InvalidArgumentError("gradient_predivide_factor not supported with op != Average")
    if num_groups != 0:
        warnings.warn("Parameter `num_groups` has been replaced by `groups` and will be removed in v0.23.0.",
                      DeprecationWarning, stacklevel=2)
        if groups is None:
            groups = num_groups
    if groups is not None:
        if not (isinstance(groups, list) or (isinstance(groups, int) and groups > 0)):
            raise InvalidArgumentError("groups should be a non-negative integer or a list of list of torch.Tensor.")
        if isinstance(groups, list):
            seen: set[int] = set()
            for group in groups:
                for p in group:
                    if not isinstance(p, torch.Tensor):
                        raise InvalidArgumentError("groups must consist of torch.Tensor.")
                    if id(p) in seen:
                        raise InvalidArgumentError("A parameter can only appear once in groups.")
                    seen.add(id(p))
    if not isinstance(backward_passes_per_step, int) or backward_passes_per_step <= 0:
        raise InvalidArgumentError("backward_passes_per_step must be > 0")
    if op not in (collectives.Average, collectives.Sum, collectives.Adasum, collectives.Min, collectives.Max,
                  collectives.Product):
        raise InvalidArgumentError(f"op={op!r} is not one of hvd.Average, hvd.Sum, hvd.Adasum, hvd.Min, hvd.Max, "
                                   "hvd.Product")
    if op == collectives.Adasum and size() > 1:
        from unidist.compat.horovod.adasum_optimizer import adasum_optimizer

        return adasum_optimizer(optimizer, named_parameters, compression, backward_passes_per_step, process_set)
    cls = type(type(optimizer).__name__, (_HorovodOptimizer, type(optimizer)), {})
    made: torch.optim.Optimizer = cls(optimizer.param_groups, named_parameters, compression,
                                      backward_passes_per_step, op, gradient_predivide_factor, groups, sparse_as_dense,
                                      process_set)
    return made
