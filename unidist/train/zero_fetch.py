"""ZeRO-3's parameter fetching: every unit gathered wherever its parameters are read, and freed when nobody is.

A unit (zero_unit.py's ``Unit``: the flattened parameters of one module, or of a whole block, which its forward
then holds gathered for all of its children) is all-gathered before the forward of every
module that *reads* one of its parameters, and freed when the last of those forwards has returned. Reading a
parameter is not the same as owning it: ``nn.MultiheadAttention`` reads ``out_proj.weight`` inside its own forward
and never calls ``out_proj``; a tied language-model head reads the embedding's weight; user code reads a child's
parameters from the parent's forward. Gathering only around the owner's forward (what unidist did until it
failed with ``mat2 must be a matrix, got 1-D tensor`` on torch's own attention) cannot see these.

So the readers are learned by watching. Until the first optimizer step every training forward of the model runs
under a ``TorchFunctionMode`` (and so does the first forward of each other kind: eval, no_grad) that sees each
torch call's arguments: a parameter whose unit is not gathered is gathered on
the spot, and the module running at that moment (the innermost one whose forward has not returned) is recorded as
a reader of its unit. From then on each module's pre-forward hook gathers exactly the units it was seen to read
(and its own), with no per-call cost beyond the hooks. DeepSpeed asks users to declare such parameters
(``deepspeed.zero.register_external_parameter``); :meth:`Fetcher.add_reader` is the same declaration here, for a
read the first step did not make.

Units are reference-counted: a unit read by a parent and by the child it calls stays gathered until both have
returned, and ``gathered()``/``accumulate()`` blocks hold theirs until they end. Backward gathers a module's units
again from a hook on its outputs (autograd reaches a module's backward through its outputs), and the optimizer
frees them once their gradients have been reduced (:meth:`done`).
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch.overrides import TorchFunctionMode

import unidist.tree as tree

__all__ = ["Fetched", "Fetcher"]


class Fetched(Protocol):
    """What the fetcher needs of a ZeRO unit."""

    params: list[torch.nn.Parameter]

    def gather(self) -> None: ...

    def prefetch(self) -> None: ...

    def release(self) -> None: ...


class Fetcher:
    """The stage-3 hooks of one model; see the module docstring.

    Args:
        model: the prepared module (its every submodule is hooked).
        unit_of: the unit a parameter belongs to (None: not sharded, e.g. frozen).
        held_by: units a module's forward reads besides its own parameters' (a block's: its subtree's parameters).
        prefetch: start gathering the next unit (in the first training forward's order) when a module gathers
            its own, and in backward the one before: where collectives move while the process computes.
    """

    def __init__(self, model: torch.nn.Module, unit_of: Callable[[torch.Tensor], Fetched | None],
                 held_by: Mapping[torch.nn.Module, Sequence[Fetched]] | None = None, prefetch: bool = False) -> None:
        self._unit_of = unit_of
        self._prefetch = prefetch
        # the units in the order the first training forward gathered them (learned until its step), and each one's
        # place in it once learned
        self._order: list[Fetched] = []
        self._place: dict[int, int] | None = None
        self._users: dict[int, int] = {}  # id(unit) -> forwards, gathered() and accumulate() blocks holding it
        # module -> the units its forward reads: its own parameters' from the start, the rest as they are seen
        self.readers: weakref.WeakKeyDictionary[torch.nn.Module, list[Fetched]] = weakref.WeakKeyDictionary()
        self._frames: list[tuple[torch.nn.Module, list[Fetched]]] = []  # forwards running now, innermost last
        self._watch = _Reads(self)  # the tracing mode
        # the kinds of forward already watched: (training, grad enabled) of the outermost module. A training forward
        # is watched until the first optimizer step; any other kind once (the first eval forward under no_grad
        # takes other paths: TransformerEncoderLayer's fast path reads its children's weights itself)
        self._watched: set[tuple[bool, bool]] = set()
        self._kind: tuple[bool, bool] | None = None  # the kind of the outermost forward running now
        self._busy = False  # inside a gather or a release: the mode passes those calls through
        self.hooks: list[Any] = []
        # dynamo must not trace the parameter swap. torch.compiler.disable is applied here rather than on the methods
        # because it imports torch._dynamo (about 1.7 s and sympy per rank): applied at class definition it made every
        # process that loads the training layer pay it; here only a ZeRO-3 prepare does, which finds it loaded already
        # (a torch optimizer's constructor loads it)
        disable: Callable[[Callable[..., None]], Callable[..., None]] = torch.compiler.disable
        pre, post = disable(self._pre), disable(self._post)
        for module in model.modules():
            own = [u for p in module.parameters(recurse=False) if (u := unit_of(p)) is not None]
            own += (held_by or {}).get(module, ())
            self.readers[module] = list({id(u): u for u in own}.values())
            self.hooks += [module.register_forward_pre_hook(pre), module.register_forward_hook(post, always_call=True)]

    # ------------------------------------------------------------------ who holds what
    def acquire(self, units: Iterable[Fetched]) -> None:
        """Gather ``units`` (those not gathered yet) and count one more holder of each."""
        self._busy = True
        try:
            for u in units:
                self._users[id(u)] = self._users.get(id(u), 0) + 1
                u.gather()
        finally:
            self._busy = False

    def let_go(self, units: Iterable[Fetched]) -> None:
        """One holder fewer of each of ``units``; a unit nobody holds is freed."""
        self._busy = True
        try:
            for u in units:
                left = self._users.get(id(u), 0) - 1
                if left > 0:
                    self._users[id(u)] = left
                    continue
                self._users.pop(id(u), None)
                u.release()
        finally:
            self._busy = False

    def done(self, unit: Fetched) -> None:
        """The unit's gradients are reduced: free it, unless a forward or a block still holds it."""
        if not self._users.get(id(unit)):
            self._busy = True
            try:
                unit.release()
            finally:
                self._busy = False

    def add_reader(self, module: torch.nn.Module, param: torch.Tensor) -> None:
        """Declare that ``module``'s forward reads ``param`` (as ``deepspeed.zero.register_external_parameter``),
        for a read the first step did not show."""
        unit = self._unit_of(param)
        if unit is not None and module in self.readers and all(u is not unit for u in self.readers[module]):
            self.readers[module].append(unit)

    def stop_tracing(self) -> None:
        """The first step is over: from now on training forwards' hooks gather what they were seen to read."""
        self._watched.add((True, True))
        if self._place is None:
            self._place = {id(u): i for i, u in enumerate(self._order)}

    def _learn(self, units: Iterable[Fetched]) -> None:
        """The first training forward: note the order units are first gathered in."""
        if self._place is None and self._kind == (True, True):
            known = {id(u) for u in self._order}
            self._order += [u for u in units if id(u) not in known]

    def _prefetch_from(self, units: list[Fetched], step: int) -> None:
        """Start gathering the unit after (``step`` 1, forward) or before (-1, backward) ``units`` in the learned
        order. Every rank runs the same hooks in the same order, so every rank starts the same gathers."""
        place = self._place
        if place is None or not units or not torch.is_grad_enabled():
            return
        at = [place[id(u)] for u in units if id(u) in place]
        if not at:
            return
        i = (max(at) + 1) if step > 0 else (min(at) - 1)
        if 0 <= i < len(self._order):
            self._busy = True
            try:
                self._order[i].prefetch()
            finally:
                self._busy = False

    # ------------------------------------------------------------------ the hooks
    def _pre(self, module: torch.nn.Module, args: Any) -> None:
        units = list(self.readers.get(module, ()))
        if not self._frames:
            self._kind = (module.training, torch.is_grad_enabled())
            if self._kind not in self._watched:
                self._watch.__enter__()
        self._frames.append((module, units))
        self.acquire(units)
        if self._prefetch:
            self._learn(units)
            if module.training:
                self._prefetch_from(units, 1)

    def _post(self, module: torch.nn.Module, args: Any, out: Any) -> None:
        if not self._frames or self._frames[-1][0] is not module:
            return  # a forward that started before the hooks existed
        _, units = self._frames.pop()
        if out is None:
            _explain(module)
        if units and torch.is_grad_enabled():
            for t in tree.tensors(out):
                if t.requires_grad:
                    t.register_hook(lambda grad, units=units: self._regather(units))  # type: ignore[no-untyped-call,misc]
        self.let_go(units)
        if not self._frames and self._watch.active:
            self._watch.__exit__(None, None, None)
            if self._kind != (True, True):
                self._watched.add(self._kind)  # type: ignore[arg-type]

    def _regather(self, units: list[Fetched]) -> None:
        """Backward is about to reach the module whose outputs these are: its units must be whole again."""
        self._busy = True
        try:
            for u in units:
                u.gather()
        finally:
            self._busy = False
        if self._prefetch:
            self._prefetch_from(units, -1)

    def seen(self, t: torch.Tensor) -> None:
        """The tracing mode saw ``t`` used: if it is a sharded parameter, the running module reads its unit."""
        if self._busy or not self._frames:
            return
        unit = self._unit_of(t)
        if unit is None:
            return
        module, units = self._frames[-1]
        if any(u is unit for u in units):
            return
        units.append(unit)  # released by this forward's post hook, with the rest
        if self._prefetch:
            self._learn([unit])
        known = self.readers.setdefault(module, [])
        if all(u is not unit for u in known):
            known.append(unit)
        self.acquire([unit])

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        self.hooks.clear()


_NOTE = "unidist ZeRO-3:"  # how the note begins


def _explain(module: torch.nn.Module) -> None:
    """A forward is failing (torch calls an ``always_call`` hook with no result only then): if it read a parameter
    nobody gathered, the error says so; the note is added once, by the innermost module."""
    err = sys.exc_info()[1]
    # the note once: an outer module's hook finds it among the error's notes (PEP 678's ``__notes__``)
    if err is None or not hasattr(err, "add_note") or any(
            isinstance(n, str) and n.startswith(_NOTE) for n in getattr(err, "__notes__", ())):
        return
    err.add_note(
        f"{_NOTE} if {type(module).__name__}'s forward read a parameter of another module that was not "
        "seen doing so during the first training step (or the first forward of its kind, eval or no_grad), that "
        "parameter was still a freed shard (an empty tensor). Declare the read with opt.add_reader(module, parameter) "
        "(opt: what prepare returned), or run that kind of forward once before it matters, or use zero_stage=2.")


class _Reads(TorchFunctionMode):
    """Sees every torch call made inside the model's forwards during the first step (see the module docstring)."""

    def __init__(self, fetcher: Fetcher) -> None:
        super().__init__()
        self.fetcher = fetcher
        self.active = False

    def __enter__(self) -> _Reads:
        self.active = True
        super().__enter__()  # type: ignore[no-untyped-call]
        return self

    def __exit__(self, *exc: Any) -> None:
        self.active = False
        super().__exit__(*exc)  # type: ignore[no-untyped-call]

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func not in _METADATA:
            for t in tree.tensors((args, kwargs)):
                if isinstance(t, torch.nn.Parameter):
                    self.fetcher.seen(t)
        return func(*args, **kwargs)


# Questions about a parameter, not reads of its values: they neither gather its unit nor make the asking module a
# reader (Hugging Face's ``self.dtype`` asks the first parameter's dtype from the top-level module: that must not
# keep the embedding whole for the whole forward; a hook that checks ``weight.numel()`` must see what is there).
# A freed parameter answers dtype, device and flags as the whole one does; its shape is the placeholder's (empty).
_METADATA = frozenset({
    *(getattr(torch.Tensor, name).__get__ for name in ("dtype", "device", "requires_grad", "is_leaf", "layout",
                                                        "is_cuda", "is_sparse", "is_meta", "is_quantized", "grad_fn",
                                                        "shape", "ndim", "nbytes", "itemsize")),
    torch.Tensor.is_floating_point, torch.Tensor.is_complex, torch.Tensor.get_device, torch.Tensor.numel,
    torch.Tensor.dim, torch.Tensor.size, torch.Tensor.element_size, torch.Tensor.stride, torch.Tensor.is_contiguous,
})
