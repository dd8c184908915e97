"""``unidist bench step``: one training step of GPT-2 through unidist at every ZeRO stage, beside the engines' own
paths, in one run: what the wrapper costs.

    python -m unidist.bench.step                                              # one process: against plain torch
    torchrun --standalone --nproc_per_node 2 -m unidist.bench.step            # against DDP and FSDP2 too
    deepspeed --num_gpus 2 unidist/bench/step.py                              # against raw deepspeed.initialize
    unidist bench step -n 2 --backend torch -- --layers 12 --width 768        # GPT-2 small

The model is GPT-2 from its config (``unidist.bench.gpt``; ``--hf`` takes transformers' ``GPT2LMHeadModel``), AdamW,
``--batch`` sequences of ``--seq`` tokens per rank, float32 or ``--precision bf16-mixed`` (autocast, on the GPU).
Columns, each the same model, optimizer and batch, where this launch can run them:

- ``plain``: the model and its optimizer, nothing else (no communication: at N ranks each rank alone);
- ``ddp``: ``DistributedDataParallel`` (torch.distributed: the torch or deepspeed backend);
- ``fsdp2``: ``fully_shard`` on every block and the root (torch.distributed);
- ``ds-zS``: the engine's own training engine at stage S, where the backend's record has one (``raw_engine``, in
  columns its ``raw.trainer_column`` names): DeepSpeed's ``deepspeed.initialize`` with the config unidist generates;
- ``unidist-zS``: ``mgr.prepare(model, opt, zero_stage=S)``, ``mgr.backward``, ``opt.step``, ``opt.zero_grad``;
- ``unidist-zS-offload`` (``--offload``, on a GPU): the same with ``offload="cpu"`` (the optimizer on the host).

Step time: the slowest rank's median over ``--rounds`` interleaved rounds of ``--steps`` steps (noise hits every
column alike). Peak memory: what the column's own construction and warm-up steps add at their peak (CUDA's peak
allocation on a GPU; on the CPU the peak resident set, reset through /proc/self/clear_refs): its parameters,
gradients, optimizer state and activations. Ratios: each unidist stage against plain, against DDP (stage 0),
FSDP2 (stage 3) and DeepSpeed's own engine at the same stage. Rank 0 prints the table and the machine.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run by path (the deepspeed launcher starts scripts): import this tree's unidist
    import sys as _sys
    from pathlib import Path as _Path

    _sys.path[0] = str(_Path(__file__).resolve().parents[2])

import argparse
import gc
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist import registry
from unidist.bench.gpt import GPT2, GPT2Config
from unidist.bench.machine import line as machine_line
from unidist.bench.timing import per_unit_rounds, slowest
from unidist.errors import InvalidArgumentError

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["main"]

Step = Callable[[], None]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m unidist.bench.step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--width", type=int, default=256)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--batch", type=int, default=8, help="sequences per rank")
    p.add_argument("--stages", default="0,1,2,3", help="unidist's (and DeepSpeed's) ZeRO stages to run")
    p.add_argument("--columns", default="", help="only these columns (comma-separated), default all that run here")
    p.add_argument("--precision", default="32", choices=("32", "bf16-mixed"))
    p.add_argument("--hf", action="store_true", help="transformers' GPT2LMHeadModel instead of unidist.bench.gpt")
    p.add_argument("--steps", type=int, default=3, help="timed steps per column and round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--offload", action="store_true", help="also unidist at stages 1-3 with offload='cpu' (a GPU)")
    p.add_argument("--json", type=Path, help="write the rows and the machine here (rank 0)")
    return p


def _model(args: argparse.Namespace) -> torch.nn.Module:
    torch.manual_seed(0)
    if not args.hf:
        return GPT2(GPT2Config(n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab=args.vocab,
                               n_positions=max(args.seq, 64)))
    import transformers

    class HF(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.m = transformers.GPT2LMHeadModel(transformers.GPT2Config(
                n_layer=args.layers, n_embd=args.width, n_head=args.heads, vocab_size=args.vocab,
                n_positions=max(args.seq, 64), resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))

        def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids, labels=labels).loss  # type: ignore[no-any-return]
    return HF()


class Peak:
    """What a column adds at its peak: CUDA's peak allocation above what was allocated before it, or on the CPU
    the peak resident set (Linux's VmHWM, reset by writing 5 to /proc/self/clear_refs) above the resident set
    before it."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        if device.type == "cpu":
            _mmap_threshold(64 * 1024)


    @staticmethod
    def _status(field: str) -> int:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
        return 0

    def start(self) -> None:
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.reset_peak_memory_stats(self.device)
            self.base = torch.cuda.memory_allocated(self.device)
            return
        self.base = self._status("VmRSS")
        try:
            Path("/proc/self/clear_refs").write_text("5")
        except OSError:  # not Linux, or not allowed: the lifetime peak then (an upper bound)
            pass

    def added(self) -> int:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return int(torch.cuda.max_memory_allocated(self.device)) - self.base
        return self._status("VmHWM") - self.base


def _mmap_threshold(nbytes: int) -> None:
    """glibc serves large blocks from its heap once frees have raised its dynamic mmap threshold (up to 32 MiB), and
    a heap keeps freed memory: a later column then reuses an earlier one's and its resident set does not grow. While
    the peaks are measured the threshold is 64 KiB (every tensor of that size or more its own mapping, returned to the
    system when freed, so each column's peak resident set counts its own tensors); while the steps are timed, 32 MiB
    (a long-running process's steady state: no fresh mapping, so no page faults, per step)."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    if name:
        try:
            ctypes.CDLL(name).mallopt(-3, nbytes)  # M_MMAP_THRESHOLD
        except (OSError, AttributeError):  # not glibc: the peaks are then lower bounds (memory reused)
            pass


def _own(mgr: Manager) -> str | None:
    """The name of the engine's own training engine's columns (``ds``), None where its record has no such engine."""
    record = registry.get(mgr.backend)
    return record.raw.trainer_column if record.raw.trainer is not None else None


def _columns(mgr: Manager, args: argparse.Namespace) -> list[str]:
    stages = [int(s) for s in args.stages.split(",") if s.strip()]
    dist = torch.distributed.is_available() and torch.distributed.is_initialized()
    own = _own(mgr)
    cols = ["plain", *(["ddp", "fsdp2"] if dist else []),
            *([f"{own}-z{s}" for s in stages] if own is not None else []),
            *(f"unidist-z{s}" for s in stages)]
    if args.offload:
        if mgr.device.type != "cuda":
            raise SystemExit("bench step --offload: the parameters are on the CPU here, so offload moves nothing; "
                             "run it where the ranks have GPUs")
        cols += [f"unidist-z{s}-offload" for s in stages if s]
    if args.columns:
        wanted = [c.strip() for c in args.columns.split(",") if c.strip()]
        unknown = [c for c in wanted if c not in cols]
        if unknown:
            raise SystemExit(f"bench step: {', '.join(unknown)} cannot run here (backend {mgr.backend}); "
                             f"this run has {', '.join(cols)}")
        cols = wanted
    return cols


def _build(mgr: Manager, name: str, args: argparse.Namespace, ids: torch.Tensor) -> Step:
    """One column's step: forward, backward, optimizer step, gradients cleared."""
    model = _model(args).to(mgr.device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    autocast = torch.autocast(mgr.device.type, dtype=torch.bfloat16, enabled=args.precision == "bf16-mixed")
    if name.startswith("unidist-z"):
        prepared, popt = mgr.prepare(model, opt, zero_stage=_stage(name), precision=args.precision,
                                     offload="cpu" if name.endswith("-offload") else None)

        def unidist_step() -> None:
            mgr.backward(prepared(ids, ids))
            popt.step()
            popt.zero_grad()
        return unidist_step
    if (own := _own(mgr)) is not None and name.startswith(f"{own}-z"):
        return _engine_own(mgr, model, opt, _stage(name), args, ids)
    if name == "ddp":
        model = torch.nn.parallel.DistributedDataParallel(model)
    elif name == "fsdp2":
        from torch.distributed.fsdp import fully_shard

        for block in _blocks(model):
            fully_shard(block)
        fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # over the sharded parameters

    def step() -> None:
        with autocast:
            loss = model(ids, ids)
        loss.backward()
        opt.step()
        opt.zero_grad()
    return step


def _stage(column: str) -> int:
    """The ZeRO stage of an engine's own ``ds-zS`` or a ``unidist-zS[-offload]`` column."""
    return int(column.split("-z")[1][0])


def _blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    inner = getattr(model, "m", None)
    blocks: torch.nn.ModuleList = inner.transformer.h if inner is not None else model.h  # type: ignore[assignment]
    return list(blocks)


def _engine_own(mgr: Manager, model: torch.nn.Module, opt: torch.optim.Optimizer, stage: int, args: argparse.Namespace,
               ids: torch.Tensor) -> Step:
    """The engine's own training engine, made as its record says (DeepSpeed: ``deepspeed.initialize`` with the
    config ``prepare`` would give it for this stage)."""
    make = registry.get(mgr.backend).raw.trainer
    if make is None:
        raise InvalidArgumentError(f"the {mgr.backend} backend has no engine of its own to compare with")
    engine = make(mgr, model, opt, stage, args.precision)

    def engine_step() -> None:
        engine.backward(engine(ids, ids))
        engine.step()
    return engine_step


def run(mgr: Manager, args: argparse.Namespace) -> list[dict[str, Any]]:
    gen = torch.Generator().manual_seed(1000 + mgr.rank)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=gen).to(mgr.device)
    peak = Peak(mgr.device)
    steps: dict[str, Step] = {}
    memory: dict[str, int] = {}
    first = _build(mgr, "plain", args, ids)  # untimed, unmeasured: the allocator's and the kernels' first use is
    for _ in range(max(args.warmup, 1)):     # no column's cost (the first column measured would pay for it)
        first()
    del first
    for name in _columns(mgr, args):
        peak.start()
        steps[name] = _build(mgr, name, args, ids)
        for _ in range(max(args.warmup, 1)):
            steps[name]()
        memory[name] = peak.added()
    if mgr.device.type == "cpu":
        _mmap_threshold(32 * 2**20)
    nothing: Step = lambda: None  # noqa: E731
    sync: Step = (lambda: torch.cuda.synchronize(mgr.device)) if mgr.device.type == "cuda" else nothing

    def timed(fn: Step) -> Step:
        def unit() -> None:
            fn()
            sync()
        return unit
    med = slowest(mgr, per_unit_rounds(mgr, {n: (nothing, timed(f), nothing) for n, f in steps.items()},
                                       iters=args.steps, rounds=args.rounds, warmup=0))
    peaks = mgr.allgather_object(memory)
    rows = []
    own = _own(mgr)
    for name, seconds in med.items():
        row: dict[str, Any] = {"column": name, "step_ms": seconds * 1e3,
                               "peak_mb": max(p[name] for p in peaks) / 2**20}
        if name.startswith("unidist-z"):
            stage = str(_stage(name))
            for base in ("plain", *(["ddp"] if stage == "0" else []), *(["fsdp2"] if stage == "3" else []),
                         *([f"{own}-z{stage}"] if own is not None else [])):
                if base in med:
                    row[f"vs_{base.split('-')[0]}"] = seconds / med[base]
                    row[f"mem_vs_{base.split('-')[0]}"] = memory[name] / max(memory[base], 1)
        rows.append(row)
    return rows


def table(rows: list[dict[str, Any]], mgr: Manager, args: argparse.Namespace) -> str:
    params = sum(p.numel() for p in _model(args).parameters())
    head = (f"bench step: backend={mgr.backend} launcher={mgr.launch.launcher} ranks={mgr.size} device="
            f"{mgr.device.type}; GPT-2 {args.layers}x{args.width} ({params / 1e6:.1f} M parameters), AdamW, "
            f"{args.batch}x{args.seq} tokens per rank, precision {args.precision}; slowest rank's median of "
            f"{args.rounds} interleaved rounds of {args.steps} steps")
    own = _own(mgr)
    ratio_cols = [c for c in ("vs_plain", "vs_ddp", "vs_fsdp2", *([f"vs_{own}"] if own is not None else []))
                  if any(c in r for r in rows)]
    lines = ["| column | step ms | peak MB | " + " | ".join(f"time {c[3:]}" for c in ratio_cols) + " | "
             + " | ".join(f"memory {c[3:]}" for c in ratio_cols) + " |",
             "|---" * (3 + 2 * len(ratio_cols)) + "|"]
    for r in rows:
        cells = [r["column"], f"{r['step_ms']:.1f}", f"{r['peak_mb']:.0f}"]
        cells += [f"{r[c]:.3f}x" if c in r else "" for c in ratio_cols]
        cells += [f"{r['mem_' + c]:.2f}x" if c in r else "" for c in ratio_cols]
        lines.append("| " + " | ".join(cells) + " |")
    return head + "\n\n" + "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(unidist.script_args(argv))
    with unidist.init() as mgr:
        rows = run(mgr, args)
        if mgr.is_main:
            print(machine_line() + "\n", flush=True)
            print(table(rows, mgr, args), flush=True)
            if args.json:
                args.json.write_text(json.dumps({"machine": machine_line(), "args": vars(args) | {"json": None},
                                                 "rows": rows}, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
