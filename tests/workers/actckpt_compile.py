"""Activation checkpointing and torch.compile under any launcher (issue 20, parts 4 and 5).

Parts (``--parts``, comma separated):
- ``ckpt``: a residual MLP whose two blocks run through ``torch.utils.checkpoint.checkpoint`` (use_reentrant
  True and False, and without), prepared at ZeRO stage 0, 2 and 3 (DeepSpeed: its engine's ZeRO). Per mode and
  stage: max |w - one plain-torch process on the full batch without checkpointing|, max |w - the same stage
  without checkpointing|, the first step's gradient norm, the spread across ranks, and the activation bytes the
  first forward saved for backward (``saved_tensors_hooks``, parameters not counted, each storage once), and
  how many block layers ran again during backward (recomputes) starting from a released (empty) weight.
- ``pipe``: the same model cut into two Pipeline stages (2 ranks; block i checkpointed inside stage i), gpipe
  and 1f1b, each mode: this rank's stage against the same layers of the dense model trained by plain torch.
- ``compile``: the model (no checkpointing) under ``torch.compile`` before ``prepare`` and after, at ZeRO
  stage 0, 2 and 3, against eager at the same stage and against plain torch; dynamo's graph and op counts
  (``--compile-backend``, default aot_eager). A refusal is recorded with its error type.
Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import common  # tests/workers/common.py: this script's directory is on sys.path
import torch
from torch.utils.checkpoint import checkpoint

import unidist
from unidist.parallel import Pipeline

STEPS, BATCH, IN, WIDTH, OUT = 4, 16, 32, 64, 8
MODES = ("none", "reentrant", "nonreentrant")
STAGES = (0, 2, 3)
COMPILE_BACKEND = "aot_eager"  # AOTAutograd's joint forward/backward graphs, no codegen (see the README)
COMPILER = {"backend": COMPILE_BACKEND}  # --compile-backend


def _block() -> torch.nn.Sequential:
    return torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Tanh(), torch.nn.Linear(WIDTH, WIDTH),
                               torch.nn.Tanh())


def _run(block: torch.nn.Module, h: torch.Tensor, mode: str) -> torch.Tensor:
    """h + block(h), the block through checkpoint() in the checkpointing modes."""
    if mode == "none":
        return h + block(h)
    return h + checkpoint(block, h, use_reentrant=mode == "reentrant")  # type: ignore[no-any-return]


class Net(torch.nn.Module):
    def __init__(self, mode: str = "none") -> None:
        super().__init__()
        torch.manual_seed(7)
        self.mode = mode
        self.stem = torch.nn.Linear(IN, WIDTH)
        self.blocks = torch.nn.ModuleList([_block(), _block()])
        self.head = torch.nn.Linear(WIDTH, OUT)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.stem(x))
        for block in self.blocks:
            h = _run(block, h, self.mode)
        return self.head(h)  # type: ignore[no-any-return]


class Stage(torch.nn.Module):
    """Pipeline stage i of Net: stage 0 = stem + block 0, stage 1 = block 1 + head (the dense model's layers)."""

    def __init__(self, net: Net, index: int, mode: str) -> None:
        super().__init__()
        self.index, self.mode = index, mode
        self.block = net.blocks[index]
        self.edge = net.stem if index == 0 else net.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.index == 0:
            return _run(self.block, torch.tanh(self.edge(x)), self.mode)
        return self.edge(_run(self.block, x, self.mode))  # type: ignore[no-any-return]


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, IN, generator=g) * 3, torch.randn(BATCH, OUT, generator=g) * 10


def make_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def reference(mode: str = "none") -> tuple[dict[str, torch.Tensor], float]:
    """One plain-torch process on the full batch."""
    model = Net(mode)
    opt = make_opt(model)
    first = 0.0
    for step in range(STEPS):
        x, y = batch(step)
        torch.nn.functional.mse_loss(model(x), y).backward()  # type: ignore[no-untyped-call]
        norm = float(torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")))
        first = first or norm
        opt.step()
        opt.zero_grad()
    return {k: v.detach().clone() for k, v in model.state_dict().items()}, first


class SavedBytes:
    """Bytes of the tensors autograd saves for backward inside the block (each storage once, parameters not
    counted). Non-reentrant checkpointing installs its own hooks inside its regions, so what it drops is not
    counted; reentrant checkpointing runs its regions under no_grad."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        self.params, self.seen, self.bytes = params, set(), 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        if ptr not in self.seen and ptr not in {p.untyped_storage().data_ptr() for p in self.params if p.numel()}:
            self.seen.add(ptr)
            self.bytes += storage.nbytes()
        return t

    def hooks(self) -> Any:
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    return common.max_diff({k.replace("_orig_mod.", ""): v for k, v in a.items()}, b)


def rows(mgr: Any) -> slice:
    per = BATCH // mgr.size
    return slice(mgr.rank * per, (mgr.rank + 1) * per)


spread = common.spread


def train_ckpt(mgr: Any, mode: str, stage: int) -> dict[str, Any]:
    model = Net(mode)
    # Registered before prepare, so it runs before ZeRO's (or DeepSpeed's) gathering pre-hook: each forward of a
    # block during backward is a recompute; at stage 3 its first Linear's weight must then still be the empty shard
    # placeholder (released after the forward), so the recompute trains right only if it gathers again. The probe
    # sits on the block, not its Linears: unidist's stage 3 gathers a block's parameters as one unit around the
    # block's forward, so inside the block they are already whole.
    in_backward: list[bool] = [False]
    recomputes: list[int] = []

    def probe(mod: torch.nn.Module, args: Any) -> None:
        if in_backward[0]:
            recomputes.append(mod[0].weight.numel())

    for block in model.blocks:
        block.register_forward_pre_hook(probe)
    model, opt = mgr.prepare(model, make_opt(model), zero_stage=stage)
    user = mgr.unwrap(model)
    counter = SavedBytes(list(user.parameters()))
    for step in range(STEPS):
        x, y = batch(step)
        if step == 0:
            with counter.hooks():
                out = model(x[rows(mgr)])
        else:
            out = model(x[rows(mgr)])
        in_backward[0] = True
        mgr.backward(torch.nn.functional.mse_loss(out, y[rows(mgr)]))
        in_backward[0] = False
        opt.step()
        opt.zero_grad()
    full = mgr.full_state_dict(model)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return {"full": full, "saved_bytes": counter.bytes, "peak_bytes": mgr.memory_stats()["peak_bytes"],
            "recomputes": len(recomputes), "recomputed_from_empty": sum(n == 0 for n in recomputes)}


def part_ckpt(mgr: Any, results: dict[str, Any]) -> None:
    ref, first = reference()
    ref_ckpt, _ = reference("nonreentrant")
    results["ckpt/_reference"] = {"first_norm": first, "plain_ckpt_vs_plain": max_diff(ref_ckpt, ref)}
    for stage in STAGES:
        base: dict[str, torch.Tensor] = {}
        for mode in MODES:
            key = f"ckpt/{mode}/stage{stage}"
            try:
                got = train_ckpt(mgr, mode, stage)
                if mode == "none":
                    base = got["full"]
                results[key] = {"diff": max_diff(got["full"], ref), "vs_none": max_diff(got["full"], base),
                                "spread": spread(mgr, got["full"]), "first_norm": first,
                                "saved_bytes": got["saved_bytes"], "peak_bytes": got["peak_bytes"],
                                "recomputes": got["recomputes"], "recomputed_from_empty": got["recomputed_from_empty"]}
            except Exception as err:  # recorded; the other variants still run on every rank
                traceback.print_exc()
                results[key] = {"error": f"{type(err).__name__}: {err}"}
            print(f"rank {mgr.rank} {key}: {results[key]}", flush=True)


def part_pipe(mgr: Any, results: dict[str, Any]) -> None:
    if mgr.size != 2:
        return
    ref, _ = reference()
    for schedule in ("gpipe", "1f1b"):
        base: dict[str, torch.Tensor] = {}
        for mode in MODES:
            key = f"pipe/{schedule}/{mode}"
            try:
                net = Net()
                stage = Stage(net, mgr.rank, mode)
                opt = make_opt(stage)
                pipe = Pipeline(stage, mgr, microbatches=4, schedule=schedule,
                                loss_fn=torch.nn.functional.mse_loss)
                for step in range(STEPS):
                    x, y = batch(step)
                    pipe.train_step(x, y)
                    opt.step()
                    opt.zero_grad()
                mine = {k: v.detach().clone() for k, v in net.state_dict().items()
                        if k.startswith(f"blocks.{mgr.rank}.") or k.startswith("stem." if mgr.rank == 0 else "head.")}
                if mode == "none":
                    base = mine
                results[key] = {"diff": max_diff(ref, mine), "vs_none": max_diff(base, mine), "params": len(mine)}
            except Exception as err:
                traceback.print_exc()
                results[key] = {"error": f"{type(err).__name__}: {err}"}
            print(f"rank {mgr.rank} {key}: {results[key]}", flush=True)


def train_compiled(mgr: Any, how: str, stage: int) -> dict[str, Any]:
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model: torch.nn.Module = Net()
    opt = make_opt(model)
    if how == "before":
        model = torch.compile(model, backend=COMPILER["backend"])  # type: ignore[assignment]
    prepared, opt = mgr.prepare(model, opt, zero_stage=stage)
    model = torch.compile(prepared, backend=COMPILER["backend"]) if how == "after" else prepared  # type: ignore[assignment]
    start = time.perf_counter()
    for step in range(STEPS):
        x, y = batch(step)
        mgr.backward(torch.nn.functional.mse_loss(model(x[rows(mgr)]), y[rows(mgr)]))
        opt.step()
        opt.zero_grad()
    seconds = time.perf_counter() - start
    full = mgr.full_state_dict(prepared)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    stats = counters["stats"]
    return {"full": full, "seconds": seconds, "graphs": int(stats["unique_graphs"]),
            "ops": int(stats["calls_captured"])}


def part_compile(mgr: Any, results: dict[str, Any]) -> None:
    ref, _ = reference()
    for stage in STAGES:
        eager: dict[str, torch.Tensor] = {}
        for how in ("eager", "before", "after"):
            key = f"compile/{how}/stage{stage}"
            try:
                got = train_compiled(mgr, how, stage) if how != "eager" else train_ckpt(mgr, "none", stage)
                if how == "eager":
                    eager = got["full"]
                results[key] = {"diff": max_diff(got["full"], ref), "vs_eager": max_diff(got["full"], eager),
                                "spread": spread(mgr, got["full"]), "seconds": got.get("seconds"),
                                "graphs": got.get("graphs"), "ops": got.get("ops")}
            except Exception as err:
                traceback.print_exc()
                results[key] = {"error": f"{type(err).__name__}: {err}", "type": type(err).__name__}
            print(f"rank {mgr.rank} {key}: {results[key]}", flush=True)


PARTS = {"ckpt": part_ckpt, "pipe": part_pipe, "compile": part_compile}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--parts", default=",".join(PARTS))
    parser.add_argument("--compile-backend", default=COMPILE_BACKEND, help="torch.compile(backend=...)")
    ns = parser.parse_args(unidist.script_args())
    COMPILER["backend"] = ns.compile_backend
    with unidist.init() as mgr:
        results: dict[str, Any] = {}
        for name in ns.parts.split(","):
            PARTS[name](mgr, results)
        results["_meta"] = {"backend": mgr.backend, "size": mgr.size, "torch": torch.__version__}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
