"""``gradsync``: the cost of averaging a real model's gradients, per method, on the same parameter shapes.

    mpiexec -n 2 python -m unidist.bench gradsync --model resnet50

Models (``real_models.py``): ResNet-50 (161 tensors, 25.6 M parameters) and a GPT-2-small-like transformer
(148 tensors, 124 M parameters), the sizes and tensor counts of real workloads. Methods, all timed as
backward + synchronisation (the hooks of fused methods start exchanging during backward, so backward
cannot be left out of the unit):

- ``backward``: backward alone, no communication: the baseline each method's sync cost is measured from;
- ``per_tensor``: ``mgr.allreduce_(p.grad, op="mean")`` on every gradient after backward;
- ``raw_per_tensor``: the engine's own in-place allreduce (and divide) on every gradient (``engines.py``);
- ``fused``: ``mgr.prepare(model, SGD)``, ``mgr.backward(loss)`` and ``opt.synchronize()``: what prepare gives
  by default (``reducer='auto'``); where the backend's record names an ``raw.reducer`` (deepspeed, horovod)
  also ``fused_engine`` and ``fused_unidist``, the engine's own reducer (a DeepSpeed engine's allreduce,
  ``hvd.DistributedOptimizer``) and unidist's buckets over the engine's collectives, side by side;
- ``ddp``: torch's ``DistributedDataParallel`` reducer (gloo), where torch.distributed is initialised.

Each method has its own copy of the model (hooks of one must not fire in another's backward). The forward
is ``sum((p * c).sum())`` and runs before each unit, untimed. The unit starts by clearing the previous step's
gradients, as a training loop's ``zero_grad()`` does: ``p.grad = None`` for the plain methods (free, but
backward then allocates every gradient anew), ``opt.zero_grad()`` for the fused one (which may keep its
gradients as bucket views and zero them: a real cost, so it is timed). After the unit, untimed, the fused
method's ``opt.step()`` (lr=0). Reported: ms per unit, sync ms = unit - baseline, and the ratio of each
method's sync ms to ``raw_per_tensor``'s.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from unidist import registry
from unidist.bench import engines
from unidist.bench.output import Column, fmt, markdown
from unidist.bench.real_models import MODELS, ShapeModel
from unidist.bench.timing import per_unit_rounds, slowest, spread

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["add_arguments", "engine_reducer", "run", "table"]

Method = tuple[Callable[[], Any], Callable[[], Any], Callable[[], Any]]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", choices=[*MODELS, "both"], default="both")
    parser.add_argument("--iters", type=int, default=3, help="timed units per method and round")


def _ddp_available() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _nothing() -> None:
    """No clean-up after a unit: each unit clears the gradients it will make (timed, as a loop's zero_grad)."""


def engine_reducer(backend: str) -> str | None:
    """The engine's own gradient reducer behind ``prepare(reducer='engine')``, as its record names it (None: the
    engine has none; prepare's reducer is unidist's)."""
    return registry.get(backend).raw.reducer


def fused_label(backend: str) -> str:
    if engine_reducer(backend) is not None:
        return "prepare (reducer='auto')"
    return "prepare: unidist DistributedOptimizer"


def _methods(mgr: Manager, shapes: list[tuple[str, tuple[int, ...]]], c: float
             ) -> tuple[dict[str, Method], dict[str, list[torch.nn.Parameter]], list[Any]]:
    """(before, unit, after) per method, the parameters whose gradients each method averages, and what must
    stay alive (the prepared optimizer, DDP)."""
    keep: list[Any] = []
    plain = ShapeModel(shapes).to(mgr.device)
    params = list(plain.parameters())
    owners = {"backward": params, "per_tensor": params, "raw_per_tensor": params}
    state: dict[str, torch.Tensor] = {}

    def forward(model: Callable[[float], torch.Tensor], key: str) -> Callable[[], None]:
        def run() -> None:
            state[key] = model(c)
        return run

    def backward_then(key: str, sync: Callable[[], Any] | None, owned: list[torch.nn.Parameter] = params
                      ) -> Callable[[], None]:
        def unit() -> None:
            for p in owned:
                p.grad = None
            state.pop(key).backward()  # type: ignore[no-untyped-call]
            if sync is not None:
                sync()
        return unit

    def each(fn: Callable[[torch.Tensor], Any]) -> Callable[[], None]:
        def sync() -> None:
            for p in params:
                fn(p.grad)  # type: ignore[arg-type]
        return sync

    methods: dict[str, Method] = {
        "backward": (forward(plain, "plain"), backward_then("plain", None), _nothing),
        "per_tensor": (forward(plain, "plain"), backward_then("plain", each(lambda g: mgr.allreduce_(g, op="mean"))),
                       _nothing),
    }
    raw = engines.grad_mean(mgr)
    if raw is not None:
        methods["raw_per_tensor"] = (forward(plain, "plain"), backward_then("plain", each(raw)), _nothing)

    variants = {"fused": "auto"}
    if engine_reducer(mgr.backend) is not None:
        variants.update(fused_engine="engine", fused_unidist="unidist")
    for key, reducer in variants.items():
        fused_model = ShapeModel(shapes)
        opt = torch.optim.SGD(fused_model.parameters(), lr=0.0)
        prepared, popt = mgr.prepare(fused_model, opt, reducer=reducer)
        keep += [prepared, popt]

        # a prepared model that is the engine's own training engine (DeepSpeed's) has its own backward, and
        # mgr.backward drives the one prepare made last: each variant calls its own
        own = getattr(prepared, "backward", None)
        backward = own if callable(own) else mgr.backward

        def fused_unit(key: str = key, popt: Any = popt, backward: Callable[[torch.Tensor], Any] = backward) -> None:
            popt.zero_grad()
            backward(state.pop(key))
            popt.synchronize()

        methods[key] = (forward(prepared, key), fused_unit, popt.step)
        owners[key] = list(mgr.unwrap(prepared).parameters())

    if _ddp_available():
        ddp_model = ShapeModel(shapes).to(mgr.device)
        ddp = torch.nn.parallel.DistributedDataParallel(ddp_model)
        keep.append(ddp)
        owners["ddp"] = list(ddp_model.parameters())
        methods["ddp"] = (forward(ddp, "ddp"), backward_then("ddp", None, owners["ddp"]), _nothing)
    return methods, owners, keep


def _verifier(mgr: Manager, owners: dict[str, list[torch.nn.Parameter]], c: float) -> Callable[[str], None]:
    """After a method's first unit every gradient must hold the ranks' mean of c (backward alone: this
    rank's c): a sync path that loses or double-counts gradients must not produce a fine-looking row."""
    mean = sum(range(1, mgr.size + 1)) / mgr.size

    def verify(method: str) -> None:
        want = c if method == "backward" else mean
        for p in owners[method]:
            if p.grad is None or not torch.allclose(p.grad, torch.full_like(p.grad, want)):
                got = None if p.grad is None else p.grad.reshape(-1)[:4].tolist()
                raise SystemExit(f"gradsync: method {method} left gradient {got} in a {tuple(p.shape)} parameter on "
                                 f"rank {mgr.rank}, expected {want}: not timing it")
    return verify


def run(mgr: Manager, args: argparse.Namespace) -> list[dict[str, Any]]:
    """One row per model and method."""
    rows: list[dict[str, Any]] = []
    for name in (list(MODELS) if args.model == "both" else [args.model]):
        shapes = MODELS[name](args.scale)
        nparams = sum(math.prod(s) for _, s in shapes)
        c = float(mgr.rank + 1)
        methods, owners, keep = _methods(mgr, shapes, c)
        samples = per_unit_rounds(mgr, methods, iters=args.iters, rounds=args.rounds, warmup=max(1, args.warmup),
                                  verify=_verifier(mgr, owners, c))
        med, noise = slowest(mgr, samples), spread(mgr, samples)
        base = med["backward"]
        raw_sync = med["raw_per_tensor"] - base if "raw_per_tensor" in med else None
        for method, seconds in med.items():
            sync = seconds - base
            row: dict[str, Any] = {"bench": "gradsync", "model": name, "scale": args.scale, "tensors": len(shapes),
                                   "params": nparams, "bytes": 4 * nparams, "method": method,
                                   "what": _describe(method, mgr.backend), "iters": args.iters,
                                   "rounds": args.rounds, "unit_ms": seconds * 1e3, "spread": noise[method],
                                   "sync_ms": None if method == "backward" else sync * 1e3}
            if raw_sync is not None and method != "backward" and raw_sync > 0:
                row["ratio"] = sync / raw_sync
            rows.append(row)
        for obj in keep:
            remove = getattr(obj, "remove_hooks", None)
            if callable(remove):
                remove()
        del methods, owners, keep
    return rows


def _describe(method: str, backend: str) -> str:
    return {"backward": "backward only (no communication)",
            "per_tensor": "mgr.allreduce_(grad, 'mean') per tensor",
            "raw_per_tensor": f"{engines.engine_name(backend)} allreduce per tensor",
            "fused": fused_label(backend),
            "fused_engine": f"prepare(reducer='engine'): {engine_reducer(backend)}",
            "fused_unidist": f"prepare(reducer='unidist'): unidist's buckets on {engines.engine_name(backend)}",
            "ddp": "torch DDP reducer (gloo)"}.get(method, method)


def table(rows: list[dict[str, Any]], run_meta: dict[str, Any]) -> str:
    cols: list[Column] = [("model", "model", str), ("tensors", "tensors", str),
                          ("params", "parameters", lambda v: f"{v / 1e6:.2f} M"), ("what", "method", str),
                          ("unit_ms", "backward + sync ms", fmt(2)), ("sync_ms", "sync ms", fmt(2)),
                          ("ratio", "sync / raw per-tensor", fmt(2))]
    head = (f"gradsync: backend={run_meta['backend']} launcher={run_meta['launcher']} ranks={run_meta['ranks']}, "
            f"float32, slowest rank's median of {rows[0]['rounds'] if rows else 0} interleaved rounds; "
            "sync = (backward + sync) - backward only")
    return head + "\n\n" + markdown(cols, rows)
