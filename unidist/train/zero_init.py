"""Modules built already partitioned (``mgr.partitioned_build()``; ``deepspeed.zero.Init`` off DeepSpeed).

A model too big for one rank cannot be built whole and sharded afterwards. Inside ``PartitionedBuild`` each
parameter is partitioned as it is registered: every rank keeps rank 0's values (one broadcast, as
DeepSpeed's ``zero.Init`` does) of an equal 1/N slice of it, and the parameter's own data becomes a
*placeholder*: a tensor of the parameter's shape, dtype and device whose strides are all zero over a one-element
storage. Shape, dtype and numel read true, so module code keeps working, and the memory is one element.

Initialisation after registration (``reset_parameters``, a parent's ``init.normal_``, Hugging Face's
``post_init``) writes through: a TorchFunctionMode sees every torch call inside the block, and one that reads or
writes a partitioned parameter (or an alias of it, ``p.data``) runs on the parameter gathered whole; if it wrote,
rank 0's result is partitioned again (so every rank holds the same model whatever its random state). Only one
parameter is whole at a time. A view of a placeholder with another shape (``p.data[0]``) cannot be followed and is
refused with the way out (``GatheredParameters``/``gathered``); outside the block a write to a placeholder fails
in torch itself (overlapping memory), never silently.

``prepare`` at ZeRO stage 3 builds each unit's shard from the parts (zero_unit.py, one parameter whole at a time);
any other prepare makes the parameters whole first (``materialize``). Every call here is collective over the
build's communicator: every rank builds the same model in the same order, as DeepSpeed requires too.
"""

from __future__ import annotations

import contextlib
import weakref
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

from unidist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from unidist.comm.protocol import Comm

__all__ = ["PartitionedBuild", "comm_of", "gathered", "is_partitioned", "lightly", "materialize", "partition_module",
           "take", "writes"]


@dataclass
class _Part:
    """This rank's slice of one partitioned parameter (padded to ``chunk``) and the placeholder standing in."""

    comm: Comm
    shape: torch.Size
    chunk: int
    data: torch.Tensor
    placeholder: torch.Tensor


_ATTR = "_unidist_zero_init_part"  # a partitioned parameter's _Part, on the parameter (dies with it)
_BY_STORAGE: dict[int, weakref.ref[torch.nn.Parameter]] = {}  # a placeholder's storage -> its parameter
_HELD: set[int] = set()  # ids of the parameters ``gathered`` holds whole now

# calls that read no values: they run on the placeholder itself (its shape, dtype and device are the parameter's)
_T: Any = torch.Tensor  # its properties' descriptors (typed stubs see values)
_LOOKS = frozenset({
    *(getattr(_T, name).__get__ for name in ("shape", "dtype", "device", "ndim", "data", "requires_grad", "is_leaf",
                                              "grad", "layout", "grad_fn", "is_cuda")),
    _T.size, _T.dim, _T.numel, _T.nelement, _T.detach, _T.is_floating_point, _T.is_complex, _T.requires_grad_,
    _T.__hash__, _T.element_size, _T.get_device, _T.register_hook,
})


_SET_DATA = _T.data.__set__


def _placeholder(p: torch.nn.Parameter, shape: torch.Size, old: torch.Tensor | None = None) -> torch.Tensor:
    """A tensor of ``shape`` in ``p``'s dtype and device over one element (every stride zero), known as ``p``'s
    (an alias of it leads back to ``p``); ``old``, the one it replaces, is forgotten."""
    if old is not None:
        _BY_STORAGE.pop(old.untyped_storage().data_ptr(), None)
    holder = torch.empty(1, dtype=p.dtype, device=p.device).as_strided(shape, (0,) * len(shape))
    _BY_STORAGE[holder.untyped_storage().data_ptr()] = weakref.ref(p)
    return holder


def is_partitioned(p: torch.Tensor) -> bool:
    """Whether ``p`` is a parameter built partitioned and not made whole since."""
    return isinstance(p, torch.nn.Parameter) and getattr(p, _ATTR, None) is not None


def writes(t: torch.Tensor) -> int:
    """How many times ``t`` was written in place: torch's version counter. It has no public getter:
    ``Tensor._version`` is what autograd's in-place check compares (``torch.autograd.graph.increment_version`` is
    its public writer), and only its changing matters here, never its value."""
    return int(t._version)


def comm_of(p: torch.nn.Parameter) -> Comm:
    """The communicator partitioned parameter ``p`` was built over (each of its ranks holds 1/size of it)."""
    return _part(p).comm


def _part(p: torch.nn.Parameter) -> _Part:
    part: _Part = getattr(p, _ATTR)
    return part


def _owner(t: torch.Tensor) -> torch.nn.Parameter | None:
    """The partitioned parameter ``t`` is, or aliases whole (``p.data``, ``p.detach()``); a view of another shape
    is refused. A parameter ``gathered`` holds whole is its own data meanwhile: None."""
    if is_partitioned(t):
        return None if id(t) in _HELD else t  # type: ignore[return-value]
    if t.numel() == 0 or not _BY_STORAGE or any(t.stride()):
        return None
    ref = _BY_STORAGE.get(t.untyped_storage().data_ptr())
    p = ref() if ref is not None else None
    if p is None or not is_partitioned(p):
        return None
    if t.shape != p.shape:
        raise InvalidArgumentError(
            f"a view of shape {tuple(t.shape)} of a parameter of shape {tuple(p.shape)} built partitioned: its "
            "values are spread over the ranks. Write the whole parameter (init.normal_(p), p.copy_(...)), or make it "
            "whole first: with unidist.train.zero_init.gathered([p], modifier_rank=0) (compat: "
            "deepspeed.zero.GatheredParameters)")
    return p


def _full(p: torch.nn.Parameter, part: _Part, into: torch.Tensor | None = None) -> torch.Tensor:
    """The parameter whole, in its present dtype and device (one allgather of the parts), in ``into`` (a flat
    buffer of the part's dtype and device, at least chunk x ranks long) where given."""
    comm = part.comm
    if comm.size == 1:
        flat = part.data
    else:
        need = part.chunk * comm.size
        flat = into[:need] if into is not None else \
            torch.empty(need, dtype=part.data.dtype, device=part.data.device)
        comm.allgather(part.data, out=flat)
    n = part.shape.numel()
    return flat[:n].view(part.shape).to(device=p.device, dtype=p.dtype, copy=comm.size == 1)


def _keep_slice(part: _Part, full: torch.Tensor, rank: int) -> None:
    """``part.data`` = this rank's slice of ``full`` (rank 0's values: broadcast before), zero-padded."""
    flat = full.reshape(-1)
    n = flat.numel()
    lo = min(rank * part.chunk, n)
    hi = min(lo + part.chunk, n)
    part.data.zero_()
    part.data[: hi - lo] = flat[lo:hi]


def _partition(p: torch.nn.Parameter, comm: Comm) -> None:
    """Rank 0's values of ``p`` everywhere, this rank keeping its slice; ``p`` then holds a placeholder (the one
    it had, so aliases taken of it before still lead here)."""
    with torch.no_grad():
        full = p.detach().contiguous()
        if comm.size > 1:
            comm.broadcast_(full, 0)
        chunk = -(-full.numel() // comm.size)
        old: _Part | None = getattr(p, _ATTR, None)
        if old is not None and old.placeholder.dtype == full.dtype and old.placeholder.device == full.device:
            holder = old.placeholder
        else:
            holder = _placeholder(p, p.shape, old.placeholder if old is not None else None)
        if old is not None and old.data.dtype == full.dtype and old.chunk == chunk and old.comm is comm:
            data = old.data  # written again: the slice goes where it was (no new allocation to fragment the heap)
        else:
            data = torch.empty(chunk, dtype=full.dtype, device=full.device)
        part = _Part(comm, p.shape, chunk, data, holder)
        _keep_slice(part, full, comm.rank)
    p.data = holder
    setattr(p, _ATTR, part)


def partition_module(module: torch.nn.Module, comm: Comm) -> int:
    """Partition an already built module's parameters (collective); returns how many were."""
    count = 0
    for p in module.parameters():
        if p.numel() and not is_partitioned(p):
            _partition(p, comm)
            count += 1
    return count


def take(p: torch.nn.Parameter) -> torch.Tensor:
    """The parameter's whole value (collective), and it is no longer partitioned here: its holder owns it now
    (a ZeRO unit's shard). ``p`` keeps its placeholder until the caller gives it data."""
    part = _part(p)
    delattr(p, _ATTR)
    _BY_STORAGE.pop(part.placeholder.untyped_storage().data_ptr(), None)
    return _full(p, part)


def materialize(params: Iterable[torch.nn.Parameter]) -> int:
    """Make each partitioned parameter of ``params`` whole again (collective); returns how many were."""
    count = 0
    for p in params:
        if is_partitioned(p):
            p.data = take(p)
            count += 1
    return count


@contextlib.contextmanager
def gathered(params: Iterable[torch.nn.Parameter], modifier_rank: int | None = None) -> Iterator[None]:
    """The partitioned parameters of ``params`` whole inside the block; after it, ``modifier_rank``'s values
    (None: the block only read them, and what it wrote is dropped, as DeepSpeed's ``GatheredParameters``).
    Inside a build too: while held here, the write-through leaves them alone (``_HELD``)."""
    held = [(p, _part(p)) for p in dict.fromkeys(params) if is_partitioned(p)]
    _HELD.update(id(p) for p, _ in held)
    try:
        for p, part in held:
            p.data = _full(p, part)
        yield
    finally:
        for p, part in held:
            if modifier_rank is None:
                p.data = part.placeholder
                continue
            if part.comm.size > 1 and modifier_rank != 0:  # _partition spreads rank 0's: bring the modifier's there
                with torch.no_grad():
                    part.comm.broadcast_(p.data, modifier_rank)
            _partition(p, part.comm)
        _HELD.difference_update(id(p) for p, _ in held)


@contextlib.contextmanager
def lightly(model: torch.nn.Module) -> Iterator[None]:
    """Inside, ``model``'s partitioned parameters hold empty tensors, so ``model.to(dtype or device)`` costs
    nothing for them; after, each gets a placeholder in its new dtype and device (the parts are cast when
    gathered)."""
    held = [(p, _part(p)) for p in model.parameters() if is_partitioned(p)]
    for p, _ in held:
        p.data = torch.empty(0, dtype=p.dtype, device=p.device)
    try:
        yield
    finally:
        for p, part in held:
            part.placeholder = _placeholder(p, part.shape, part.placeholder)
            p.data = part.placeholder


class _WriteThrough(TorchFunctionMode):
    """Runs a torch call that touches a partitioned parameter on the parameter made whole (see the module).

    A call that returns a view of the whole value (``p[pad]``, ``p.view(...)``) leaves that value alive in the
    caller's hands: ``views`` remembers whose it is, so a later write through such a view
    (``init.zeros_(p[pad])``) is partitioned again too, as long as a view made here lives.
    """

    def __init__(self) -> None:
        super().__init__()
        # a whole value's storage -> its parameter, the whole's dtype, and the views handed out (weakly: while one
        # lives the storage does, so its address names no other tensor)
        self.views: dict[int, tuple[weakref.ref[torch.nn.Parameter], torch.dtype, list[weakref.ref[torch.Tensor]]]]
        self.views = {}
        # the buffer the first whole value of a call is gathered into, kept from call to call: initialising a model
        # gathers every parameter once or more, and a new buffer each time fragments glibc's heap (GPT-2 medium
        # built by 2 ranks peaked at 1.46x the model's bytes that way, above the whole build's 1.19x; 0.93x
        # reusing one, as DeepSpeed's zero.Init: benchmarks/partitioned_build.py)
        self.scratch: torch.Tensor | None = None

    def _scratch(self, part: _Part) -> torch.Tensor | None:
        """A flat buffer for ``part``'s whole value: the kept one, grown when too small."""
        if part.comm.size == 1:
            return None
        need = part.chunk * part.comm.size
        got = self.scratch
        if got is None or got.dtype != part.data.dtype or got.device != part.data.device or got.numel() < need:
            self.scratch = None  # freed before the bigger one is made
            got = self.scratch = torch.empty(need, dtype=part.data.dtype, device=part.data.device)
        return got

    def _view_of(self, t: torch.Tensor) -> tuple[torch.nn.Parameter, torch.Tensor] | None:
        """(parameter, its whole value) if ``t`` views a whole value handed out earlier."""
        if not self.views or isinstance(t, torch.nn.Parameter):
            return None
        ptr = t.untyped_storage().data_ptr()
        entry = self.views.get(ptr)
        if entry is None:
            return None
        p = entry[0]()
        if p is None or not is_partitioned(p) or all(ref() is None for ref in entry[2]):
            del self.views[ptr]
            return None
        strides = [1] * p.dim()  # contiguous, as _full makes the whole value
        for i in range(p.dim() - 2, -1, -1):
            strides[i] = strides[i + 1] * p.shape[i + 1]
        whole = torch.empty(0, dtype=entry[1], device=t.device).set_(t.untyped_storage(), 0, p.shape, strides)
        return p, whole

    def _hand_out(self, p: torch.nn.Parameter, whole: torch.Tensor, result: Any) -> None:
        ptr = whole.untyped_storage().data_ptr()
        out = [r for r in tree_flatten(result)[0] if isinstance(r, torch.Tensor) and r.numel()
               and r.untyped_storage().data_ptr() == ptr]
        if out:
            if self.scratch is not None and self.scratch.untyped_storage().data_ptr() == ptr:
                self.scratch = None  # handed out: the next whole value goes elsewhere
            if len(self.views) > 64:  # forget the values no view of which lives
                self.views = {k: v for k, v in self.views.items() if any(ref() is not None for ref in v[2])}
            entry = self.views.setdefault(ptr, (weakref.ref(p), whole.dtype, []))
            entry[2].extend(weakref.ref(r) for r in out)

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func in _LOOKS:
            return func(*args, **kwargs)
        if func == _SET_DATA:  # p.data = value: the new value, partitioned again (its placeholder: nothing to do)
            target, value = args
            func(target, value)
            if is_partitioned(target) and id(target) not in _HELD and value is not _part(target).placeholder:
                _partition(target, _part(target).comm)
            return None
        leaves, _ = tree_flatten((args, kwargs))
        hit: dict[torch.nn.Parameter, None] = {}
        seen: dict[torch.nn.Parameter, tuple[torch.Tensor, list[tuple[torch.Tensor, int]]]] = {}
        for t in leaves:
            if isinstance(t, torch.Tensor):
                p = _owner(t)
                if p is not None:
                    hit[p] = None
                    continue
                view = self._view_of(t)
                if view is not None:  # a view of a whole value: the call runs on it as it is
                    seen.setdefault(view[0], (view[1], []))[1].append((t, writes(t)))
        if not hit and not seen:
            return func(*args, **kwargs)
        wholes = {p: _full(p, _part(p), self._scratch(_part(p)) if i == 0 else None) for i, p in enumerate(hit)}
        holders = {_part(p).placeholder.untyped_storage().data_ptr(): w for p, w in wholes.items()}
        for p, w in wholes.items():
            p.data = w
        before = {p: (writes(p), writes(w)) for p, w in wholes.items()}

        def swap(t: Any) -> Any:  # an alias of a placeholder (p.data taken before): the whole value instead
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter) and t.numel() and \
                    not any(t.stride()):
                return holders.get(t.untyped_storage().data_ptr(), t)
            return t

        result = None
        try:
            result = func(*tree_map(swap, args), **tree_map(swap, kwargs))
            return result
        finally:
            for p, w in wholes.items():
                part = _part(p)
                if (writes(p), writes(w)) != before[p]:  # written: rank 0's result, partitioned again
                    _partition(p, part.comm)
                else:
                    p.data = part.placeholder
                self._hand_out(p, w, result)
            for p, (w, used) in seen.items():
                if any(writes(t) != v for t, v in used):  # written through a view: partitioned again
                    part = _part(p)
                    with torch.no_grad():
                        if part.comm.size > 1:
                            part.comm.broadcast_(w, 0)
                        _keep_slice(part, w.to(part.data.dtype), part.comm.rank)
                self._hand_out(p, w, result)


class PartitionedBuild:
    """Parameters registered inside the block are partitioned over ``comm`` as they are built (see the module).

    Args:
        comm: the ranks sharing each parameter (the world, or prepare's data-parallel group).
        enabled: False builds whole (the block does nothing).
    """

    def __init__(self, comm: Comm, enabled: bool = True) -> None:
        self.comm, self.enabled = comm, enabled
        self._hooks: list[Any] = []
        self._mode: _WriteThrough | None = None

    def _registered(self, module: torch.nn.Module, name: str, param: Any) -> None:
        if isinstance(param, torch.nn.Parameter) and param.numel() and not is_partitioned(param):
            _partition(param, self.comm)

    def _child(self, module: torch.nn.Module, name: str, child: Any) -> None:
        """A submodule made without registering its parameters (``copy.deepcopy`` of a layer, as
        ``nn.TransformerEncoder`` clones its layers): partitioned when a parent takes it."""
        if isinstance(child, torch.nn.Module):
            partition_module(child, self.comm)

    def __enter__(self) -> PartitionedBuild:
        if self.enabled:
            hooks = torch.nn.modules.module
            self._hooks = [hooks.register_module_parameter_registration_hook(self._registered),
                           hooks.register_module_module_registration_hook(self._child)]
            self._mode = _WriteThrough()
            self._mode.__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)  # type: ignore[no-untyped-call]
            self._mode = None
        for hook in self._hooks:
            hook.remove()
        self._hooks = []
