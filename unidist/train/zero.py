"""ZeRO stages 1-3 (Rajbhandari et al. 2020) on any communicator, written once on its collectives.

Parameters are flattened into units, as FSDP's FlatParameter: one unit per gradient bucket (stages 1 and 2,
reverse registration order, as DDP) or, at stage 3, per block (``blocks``: each layer of a ModuleList or
Sequential, as FSDP2 wraps them) and per other module that owns parameters, each within one param group, dtype
and device. A unit is padded to N equal chunks and rank r owns chunk r: its *shard*, the one
tensor per unit the user's optimizer (same class, same param_group settings, rewritten in place to hold the
shards) steps. So every rank keeps optimizer state for 1/N of the parameters.

- stage 1: after backward, each unit's gradient is reduce-scattered; each rank steps its shard; the updated
  shards are all-gathered into the full parameters (which are views into the unit's flat buffer).
- stage 2: the reduce-scatter of a unit starts from the gradient hooks as soon as its gradients are ready
  (in unit order, overlapping the rest of backward, as the DistributedOptimizer does), and the full
  gradients are freed: each rank keeps only its gradient shard.
- stage 3: as stage 2, and each rank keeps only its parameter shard: a unit is all-gathered before the forward
  of every module that reads it (its owner, and any module seen reading it during the first step: attention
  reading ``out_proj.weight``, a tied head, a parent reading a child's weight) and again before their backward
  (a hook on their outputs), and freed when no forward holds it and its gradients are reduced (zero_fetch.py).
  Outside forward/backward, use ``gathered_parameters``.

With ``offload=True`` (``prepare(offload="cpu")``) the shards, their gradients and the optimizer state live in
CPU memory and the step runs there (offload.py, zero_unit.py); with ``master=`` they are master copies in that dtype.

With ``backward_passes_per_step=k`` the first k-1 passes accumulate full gradients locally and the k-th
reduces them, so the update equals one k-times larger batch (stage 2/3 save gradient memory on that pass).
"""

from __future__ import annotations

import contextlib
from collections import deque
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp
from unidist.request import SyncOptions
from unidist.train import zero_state
from unidist.train.fingerprint import squares
from unidist.train.gradcore import Compression, InOrder, pack
from unidist.train.offload import wait_for_copies
from unidist.train.step_window import WindowedOptimizer, clip_summed
from unidist.train.zero_fetch import Fetcher
from unidist.train.zero_layout import ZeroLayout
from unidist.train.zero_unit import Unit

if TYPE_CHECKING:
    from unidist.comm.protocol import Comm

__all__ = ["ZeroOptimizer"]

IN_FLIGHT = 2  # reduce-scatters a rank keeps running at once (each holds a unit's whole gradient until finished)


class ZeroOptimizer(WindowedOptimizer):
    """The user's optimizer stepping this rank's shards; see the module docstring."""

    def __init__(self, dp: Comm, model: torch.nn.Module, optimizer: torch.optim.Optimizer, stage: int,
                 options: SyncOptions | None = None, offload: bool = False, master: torch.dtype | None = None
                 ) -> None:
        options = options if options is not None else SyncOptions()
        if stage not in (1, 2, 3):
            raise InvalidArgumentError(f"ZeroOptimizer(stage={stage!r}); use 1, 2 or 3 (0 is the "
                                       "DistributedOptimizer)")
        if not isinstance(optimizer, torch.optim.Optimizer):
            raise InvalidArgumentError(f"ZeroOptimizer wraps a torch.optim.Optimizer, got {type(optimizer).__name__}")
        self.options = options
        self.op, self.compression = options.op, options.compression
        self._passes, self.clip_grad_norm = options.backward_passes_per_step, options.clip_grad_norm
        self._replicas = frozenset(id(p) for p in options.clip_norm_replicas)  # counted by another rank's norm
        # nothing travels on one rank: keep full precision there
        self._compressor = Compression.of(options.compression) if dp.size > 1 else Compression.none
        super().__init__(optimizer)
        self.dp, self.stage, self.model, self.offload = dp, stage, model, offload
        self.master = master  # the shards' dtype where they are master copies (precision "bf16-master")
        # the optimizer as one process would hold it: kept to consolidate (full_optimizer_state_dict)
        self.full_groups = [list(g["params"]) for g in optimizer.param_groups]
        full_state = _full_state(optimizer)
        trainable = {id(p) for g in self.full_groups for p in g if p.requires_grad}
        self._order: InOrder[Unit] = InOrder(self._launch, lambda seen: list(dp.broadcast_object(seen, 0)))
        # stage 3: each block's units, gathered around the block's whole forward (zero_fetch.py)
        self._block_units: dict[torch.nn.Module, list[Unit]] = {}
        for unit in self._make_units(model, options.bucket_bytes, trainable):
            self._order.add(unit)
        self.units = self._order.slots
        for gi, group in enumerate(optimizer.param_groups):
            group["params"] = [u.shard for u in self.units if u.param_group == gi] + \
                [p for p in group["params"] if id(p) not in trainable]
        optimizer.state.clear()
        if full_state:
            self.load_full_state(full_state)
        self._calls = 0
        self._synced = False
        self._in_flight: deque[Unit] = deque()  # launched, not finished (_launch)
        self._hooks: list[Any] = [p.register_post_accumulate_grad_hook(self._on_grad)  # type: ignore[no-untyped-call]
                                  for u in self.units for p in u.params]
        self.fetcher: Fetcher | None = None  # stage 3: who gathers which unit (zero_fetch.py)
        if stage == 3:
            # prefetch where collectives move while the process computes (not MPI: they move only inside a wait)
            self.fetcher = Fetcher(model, self._order.slot_of, self._block_units,
                                   prefetch=dp.size > 1 and dp.overlaps)
            self._hooks += self.fetcher.hooks

    def _make_units(self, model: torch.nn.Module, limit: float, trainable: set[int]) -> list[Unit]:
        group_of = {id(p): gi for gi, g in enumerate(self.full_groups) for p in g}
        chunks: list[tuple[int, list[torch.nn.Parameter], torch.nn.Module | None]] = []
        if self.stage == 3:  # one unit per block's parameters (blocks()), else per module's own; in reverse order
            seen: set[int] = set()
            whole = blocks(model)
            inside = {id(m) for b in whole for m in b.modules() if m not in whole}
            for module in reversed(list(model.modules())):
                if id(module) in inside:
                    continue
                block = module in whole
                own = [p for p in module.parameters(recurse=block) if id(p) in trainable and id(p) not in seen]
                seen.update(id(p) for p in own)
                by_group: dict[tuple[int, torch.dtype, torch.device], list[torch.nn.Parameter]] = {}
                for p in own:
                    by_group.setdefault((group_of[id(p)], p.dtype, p.device), []).append(p)
                chunks += [(key[0], ps, module if block else None) for key, ps in by_group.items()]
            missing = trainable - seen
            if missing:
                raise InvalidArgumentError(f"zero_stage=3: {len(missing)} optimizer parameters are not in the "
                                           "model; pass the model the optimizer was built for")
        else:  # gradient buckets: reverse registration order, as backward produces them
            order = [p for g in self.full_groups for p in g if id(p) in trainable]
            chunks = [(group_of[id(ps[0])], ps, None) for ps in pack(
                order, limit, lambda p: (group_of[id(p)], p.dtype, p.device))]
        units = []
        for gi, ps, block_module in chunks:
            units.append(Unit(self.dp, ps, gi, keep_full=self.stage < 3, offloaded=self.offload, master=self.master))
            if block_module is not None:
                self._block_units.setdefault(block_module, []).append(units[-1])
        return units

    @property
    def zero_stage(self) -> int:
        return self.stage

    def add_reader(self, module: torch.nn.Module, param: torch.Tensor) -> None:
        """Stage 3: declare that ``module``'s forward reads ``param`` although the first training step did not show
        it (as ``deepspeed.zero.register_external_parameter``); its unit is then gathered around that forward.
        Reads made during the first step need no declaration (zero_fetch.py). A no-op at stages 1-2.

        Args:
            module: a submodule of the prepared model.
            param: a parameter of the prepared model.
        """
        if self.fetcher is not None:
            self.fetcher.add_reader(module, param)

    # ------------------------------------------------------------------ gradients
    def _on_grad(self, p: torch.Tensor) -> None:
        unit = self._order.ready(p)
        if len(unit.ready) < len(unit.params):
            return
        if self.fetcher is not None:  # every gradient of the unit is in: backward needs its parameters no more
            self.fetcher.done(unit)
        if not (self._sync_pass and self.stage >= 2):  # stage 1 reduces in synchronize()
            unit.ready.clear()
            return
        self._order.launch_ready()

    def _launch(self, unit: Unit) -> None:
        scale = 1.0 / self.dp.size if self.op is ReduceOp.MEAN else 1.0
        unit.launch(scale, self._compressor, free_grads=self.stage >= 2)
        unit.ready.clear()
        if self.fetcher is not None:
            self.fetcher.done(unit)
        # a launched unit holds its whole gradient in the reduce-scatter's input until finished: finish the ones
        # done, and wait for the oldest beyond IN_FLIGHT, so a step never holds every unit's full gradient at once
        # (finished at the drain, all of them were alive until the end of backward: a full gradient copy at stage 3)
        flight = self._in_flight
        flight.append(unit)
        while flight and (len(flight) > IN_FLIGHT or (flight[0].handle is None or flight[0].handle.done())):
            flight.popleft().finish()

    def synchronize(self) -> None:
        """Reduce-scatter whatever has not started yet and wait for all: shard gradients are then final."""
        self._synced = True
        self._order.drain()
        self._in_flight.clear()
        # no prefetch outlives its backward: the step changes every shard, so the next forward must gather anew (a
        # block recomputed in backward, under activation checkpointing, prefetches the block after it, already
        # reduced; bound in the next forward, that gather gave parameters from before the step). Every rank ran
        # the same hooks, so every rank drops the same gathers here.
        for unit in self.units:
            unit.drop_prefetch()
        if self.offload and self.units:  # the gradients came down without blocking: the CPU reads them next
            wait_for_copies(self.units[0].device)

    # ------------------------------------------------------------------ optimizer protocol (step_window.py)
    def _before_step(self) -> None:
        """Keep what the step must not change: the shard slices (and their per-element optimizer state) of parameters
        no rank had a gradient for. One process skips a parameter whose gradient is None; a shard is stepped whole,
        so those slices are put back after the step (Adam's step count, one per unit, still advances). One CPU
        read of the flags per step decides whether there is anything to keep."""
        self._kept: list[tuple[torch.Tensor, int, int, dict[str, torch.Tensor], torch.Tensor]] = []
        flags = [u.used for u in self.units if u.used is not None]
        if not flags or bool(torch.cat(flags).all()):
            return
        for unit in self.units:
            state = self.optimizer.state.get(unit.shard, {})
            for s, e in unit.unused_parts():
                saved = {k: v[s:e].clone() for k, v in state.items()
                         if isinstance(v, torch.Tensor) and v.shape == unit.shard.shape}
                self._kept.append((unit.shard, s, e, saved, unit.shard.detach()[s:e].clone()))

    def _after_step(self) -> None:
        with torch.no_grad():
            for shard, s, e, saved, values in getattr(self, "_kept", ()):
                shard[s:e] = values
                state = self.optimizer.state.get(shard, {})
                for k, v in saved.items():
                    state[k][s:e] = v
                for k, v in state.items():  # state the step created: a fresh one's zeros where nothing was saved
                    if k not in saved and isinstance(v, torch.Tensor) and v.shape == shard.shape:
                        v[s:e] = 0
        self._kept = []
        for unit in self.units:
            unit.refresh()
        if self.fetcher is not None:
            self.fetcher.stop_tracing()  # the first step has shown every module's reads

    def _clip(self, max_norm: float) -> float:
        """torch.nn.utils.clip_grad_norm_ over the whole model: the shards' squared norms summed over ranks."""
        grads = [u.shard.grad for u in self.units if u.shard.grad is not None]
        local = torch.stack([g.float().pow(2).sum() for g in grads]).sum() if grads else torch.zeros(())
        local = local - self._replica_squares().to(local.device)
        at = self.units[0].device if self.units else local.device  # the communication's (offload: grads on the CPU)
        extra = [] if self.options.clip_norm_group is None else [self.options.clip_norm_group]
        return clip_summed(grads, local.to(at), [self.dp, *extra], max_norm)

    def full_grad(self, param: torch.Tensor) -> torch.Tensor | None:
        """``param``'s whole averaged gradient: its unit's shards of the reduced gradient gathered (a collective:
        every rank calls it, for the same parameter)."""
        if not self._synced:
            self.synchronize()
        return self._gathered_part(param, lambda u: u.shard.grad if u.shard.grad is not None else
                                   torch.zeros_like(u.shard))

    def full_param(self, param: torch.Tensor) -> torch.Tensor:
        """``param`` as the optimizer steps it (the shards: master copies under bf16-master), gathered (a
        collective, as ``full_grad``); a parameter in no unit (frozen) as it is."""
        found = self._gathered_part(param, lambda u: u.shard)
        return found if found is not None else param.detach().clone()

    def _gathered_part(self, param: torch.Tensor, of: Callable[[Unit], torch.Tensor]) -> torch.Tensor | None:
        """``param``'s slice of its unit's flat ``of(unit)`` (a shard-sized tensor) gathered from every rank."""
        for unit in self.units:
            for i, p in enumerate(unit.params):
                if p is param:
                    shard = of(unit).detach().to(unit.device).contiguous()
                    full = torch.empty(unit.chunk * self.dp.size, dtype=shard.dtype, device=shard.device)
                    self.dp.allgather(shard, out=full)
                    start = unit.offset(i)
                    return full[start:start + unit.numels[i]].view(unit.shapes[i]).clone()
        return None

    def _replica_squares(self) -> torch.Tensor:
        """The squares of this rank's parts of ``clip_norm_replicas`` (another rank of the norm's group counts
        them): taken out of this rank's share of the norm."""
        total = torch.zeros(())
        for u in self.units if self._replicas else []:
            grad = u.shard.grad
            for i, p in enumerate(u.params):
                part = u.owned(i) if grad is not None and id(p) in self._replicas else None
                if part is not None and grad is not None:
                    s, e, at = part
                    total = total + grad[at:at + e - s].float().pow(2).sum().cpu()
        return total

    def _hold(self, on: bool) -> None:
        """Stage 3 gathers every unit once for an accumulate() block and frees them as it leaves: the
        micro-steps' forwards and backwards then communicate nothing (stage 2's memory during the block)."""
        if self.fetcher is not None:
            (self.fetcher.acquire if on else self.fetcher.let_go)(self.units)

    def _scaled_grads(self) -> list[torch.Tensor]:
        return [u.shard.grad for u in self.units if u.shard.grad is not None]

    def _fingerprint_grads(self, rank: int, size: int) -> tuple[float, bool]:
        """Each rank's shards of the gradient: disjoint parts of the global norm (see OptimizerView)."""
        return squares(self._scaled_grads()), True

    def fingerprint_parts(self, model: torch.nn.Module, rank: int, size: int
                          ) -> tuple[list[str], dict[str, tuple[int, torch.Tensor]]]:
        """This rank's shards (views), as its checkpoint layout cuts them."""
        layout = self.checkpoint_layout(model)
        return list(layout.shapes), layout.model_pieces(copy=False)

    def _agree_found_inf(self, found: torch.Tensor) -> torch.Tensor:
        """Each rank checked only its shards: inf anywhere skips the step everywhere."""
        return self.dp.allreduce(found, "max")  # type: ignore[no-any-return]

    def _clear_grads(self, set_to_none: bool) -> None:
        self.optimizer.zero_grad(set_to_none=set_to_none)
        for unit in self.units:
            for p in unit.params:
                p.grad = None

    def _added_param_group(self, group: dict[str, Any]) -> None:
        raise InvalidArgumentError("add_param_group after prepare(zero_stage>0) is not supported: the parameters "
                                   "are already sharded; add the group before prepare()")

    def checkpoint_layout(self, model: torch.nn.Module | None = None) -> ZeroLayout:
        """How this optimizer's shards map to a checkpoint's full tensors (unidist.checkpoint)."""
        if model is not None and model is not self.model:
            raise InvalidArgumentError("this ZeroOptimizer was prepared for another model; pass the model and "
                                       "optimizer prepare() returned together")
        return ZeroLayout(self)

    def held_tensors(self) -> tuple[list[torch.Tensor], list[torch.Tensor | None]]:
        """(parameters, gradients) this optimizer keeps beyond the model's own: the shards."""
        return [u.shard for u in self.units], [u.shard.grad for u in self.units]

    # ------------------------------------------------------------------ whole parameters and state
    @contextlib.contextmanager
    def gathered(self) -> Iterator[None]:
        """Full parameters inside; edits made inside (identically on every rank) are kept."""
        if self.fetcher is None:
            yield
            return
        self.fetcher.acquire(self.units)  # held: a forward inside the block frees nothing
        try:
            yield
        finally:
            for u in self.units:
                u.write_back()
            self.fetcher.let_go(self.units)

    def full_state_dict(self) -> dict[str, Any]:
        """The optimizer's ``state_dict()`` as one process holding every parameter would return it (zero_state.py)."""
        return zero_state.consolidated(self)

    def load_full_state(self, full: dict[int, dict[str, Any]]) -> None:
        """Shard a one-process optimizer state (keys: parameter indices) onto this rank's shards (zero_state.py)."""
        zero_state.shard_into(self, full)

    def __repr__(self) -> str:
        return (f"ZeroOptimizer({type(self.optimizer).__name__}, stage={self.stage}, units={len(self.units)}, "
                f"op={self.op.value}, compression={self.compression}, k={self.backward_passes_per_step}"
                f"{', offload=cpu' if self.offload else ''})")


def blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Stage 3's blocks: each child of a ``ModuleList`` or ``Sequential`` that has parameters (a transformer layer, a
    ResNet bottleneck, a layer of an MLP), outside another block. A block's parameters are one unit, gathered once
    around its whole forward, as FSDP2's ``fully_shard`` on each block: a module per unit (a LayerNorm's 2x768
    values) would pay a collective's latency for each small module, four times per step (forward and backward
    gathers, reduce-scatter, refresh)."""
    found: list[torch.nn.Module] = []
    seen: set[int] = set()

    def walk(module: torch.nn.Module) -> None:
        container = isinstance(module, (torch.nn.ModuleList, torch.nn.Sequential))
        for child in module.children():
            if container and next(child.parameters(), None) is not None:
                if id(child) not in seen:  # a block listed twice (one layer in two containers) is one block
                    seen.add(id(child))
                    found.append(child)
            else:
                walk(child)
    walk(model)
    return found


def _full_state(optimizer: torch.optim.Optimizer) -> dict[int, dict[str, Any]]:
    """The optimizer's existing state by parameter index (empty for a fresh optimizer)."""
    params = [p for g in optimizer.param_groups for p in g["params"]]
    return {i: dict(optimizer.state[p]) for i, p in enumerate(params) if optimizer.state.get(p)}
