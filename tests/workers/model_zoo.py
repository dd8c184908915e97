"""The model zoo (tests/zoo/) under any launcher: N ranks on B/N rows against one process, per model, stage, precision.

For each cell of ``--cells`` (``sample``: tests/zoo/matrix.py's plan for this backend; ``all``: every cell), with
``mgr.prepare(model, opt, zero_stage=s, precision=p, sync_batchnorm=...)`` and STEPS steps of the uniform loop:

- ``diff``: max |w - w_one_process| over every parameter and floating buffer of ``full_state_dict`` (reference.py
  says what one process computes); ``ints_equal``: integer buffers (BatchNorm's counters) equal;
- ``spread``: the largest difference across ranks of the same (0.0: every parameter and buffer identical);
- ``out_type``/``ref_type`` and ``out_floats``: the output keeps its type, and its floating tensors' dtypes;
- ``frozen_moved`` (frozen parameters bit-identical: 0.0) and ``frozen_state`` (their optimizer state entries: 0);
- ``never_moved``: a parameter no forward reads, against its initial value (0.0); ``tied``: tied names still one
  tensor;
- float32 cells: a checkpoint saved here is loaded into a fresh model prepared at the next stage: ``roundtrip``
  (max |w - saved|, 0.0) and whether the tied names are still one tensor there;
- unidist's ZeRO-3: ``gathered_peak`` and ``param_total``: the most parameter bytes whole at once during the steps
  after the first (``gathered_first``: during the first, which learns the reads and the gradients' order), against
  the trainable parameters' bytes (what stage 0 holds whole all the time).

``--outputs``: one forward per precision mode (32, bf16-mixed, fp16-mixed, bf16-true) at stages 0 and 3, of GPT-2
and of a model returning a frozen dataclass that holds a namedtuple and a dict (``outputs/<model>/<stage>/<mode>``:
the type that came back and its floating dtypes). A refused model records ``refused``: its error's type and
message. ``--resume-from DIR`` then loads the checkpoints
another launch saved in DIR into models prepared two stages on (``resume/<model>/<stage>``: max |w - saved|, tied
names, spread): a checkpoint moves across backends, world sizes and stages. Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the zoo

from zoo import matrix
from zoo.models import Entry, available, frozen_names, lookup, rows
from zoo.reference import on, reference

import unidist


def _floats(out: Any) -> list[str]:
    from unidist.tree import tensors

    return sorted({str(t.dtype) for t in tensors(out) if t.is_floating_point()})


def _watch_gathers(opt: Any) -> dict[str, int]:
    """Count the parameter bytes unidist's ZeRO-3 holds whole at once (its units' gather and release)."""
    seen = {"now": 0, "peak": 0, "first": 0}
    for unit in getattr(opt, "units", []):
        size = unit.chunk * unit.dp.size * unit.shard.element_size()
        gather, release = unit.gather, unit.release

        def g(unit: Any = unit, size: int = size, gather: Any = gather) -> None:
            if unit.full is None:
                seen["now"] += size
                seen["peak"] = max(seen["peak"], seen["now"])
            gather()

        def r(unit: Any = unit, size: int = size, release: Any = release) -> None:
            if unit.full is not None:
                seen["now"] -= size
            release()
        unit.gather, unit.release = g, r
    return seen


def _diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> tuple[float, bool]:
    worst, ints = 0.0, True
    for k, w in want.items():
        if w.is_floating_point():
            worst = max(worst, float((got[k].float() - w.float()).abs().max()) if w.numel() else 0.0)
        else:
            ints = ints and bool(torch.equal(got[k].cpu(), w))
    return worst, ints


def _spread(mgr: Any, state: dict[str, torch.Tensor]) -> float:
    flat = torch.cat([t.reshape(-1).double().cpu() for t in state.values()]).to(mgr.device)
    return float((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max())


def _tied(entry: Entry, module: torch.nn.Module) -> bool:
    return all(lookup(module, a) is lookup(module, b) for a, b in entry.tied)


def train(mgr: Any, entry: Entry, stage: int, precision: str, where: Path) -> dict[str, Any]:
    model = entry.build()
    total = sum(p.numel() * p.element_size() for p in model.parameters() if p.requires_grad)
    frozen = frozen_names(model)
    start = {k: v.detach().clone() for k, v in model.state_dict().items()}
    opt = entry.optimizer(model)
    frozen_ids = [i for i, p in enumerate(p for g in opt.param_groups for p in g["params"]) if not p.requires_grad]
    try:
        prepared, popt = mgr.prepare(model, opt, zero_stage=stage, precision=precision,
                                     sync_batchnorm=entry.sync_batchnorm)
    except unidist.UnidistError as err:
        return {"refused": f"{type(err).__name__}: {err}"}
    watched = _watch_gathers(popt) if stage == 3 else None
    out_type, floats, tied = "", [], True
    for step in range(matrix.STEPS):
        loss, out = entry.loss(prepared, on(rows(entry.batch(step), mgr.rank, mgr.size), mgr.device), step)
        if step == 0:
            out_type, floats = type(out).__name__, _floats(out)
        mgr.backward(loss)
        popt.step()
        popt.zero_grad()
        tied = tied and _tied(entry, mgr.unwrap(prepared))  # after every step
        if watched is not None and step == 0:  # the first step learns the reads and the gradients' order
            watched["first"], watched["peak"] = watched["peak"], watched["now"]
    gathered = dict(watched) if watched is not None else None  # before full_state_dict gathers everything
    full = {k: v.cpu() for k, v in mgr.full_state_dict(prepared).items()}
    module = mgr.unwrap(prepared)
    state = mgr.full_optimizer_state_dict(popt)["state"]
    result: dict[str, Any] = {
        "out_type": out_type, "out_floats": floats, "spread": _spread(mgr, full),
        # against the start as the model holds it (a bfloat16 model's: rounded once, before any step)
        "frozen": frozen, "frozen_moved": max((float((full[k] - start[k].to(full[k].dtype)).abs().max())
                                              for k in frozen), default=0.0),
        "frozen_state": sum(1 for i in frozen_ids if state.get(i)),
        "never_moved": max((float((full[k] - start[k].to(full[k].dtype)).abs().max()) for k in full
                            if k.startswith(entry.never_used)), default=0.0) if entry.never_used else 0.0,
        "tied": tied and _tied(entry, module),
    }
    if gathered is not None and getattr(popt, "units", None):
        result["gathered_first"], result["gathered_peak"] = gathered["first"], gathered["peak"]
        result["param_total"] = total  # the trainable parameters' bytes: what stage 0 holds whole all the time
    if precision == "32":
        # into the next stage (a model refused at other stages: the same one)
        result["roundtrip"] = _roundtrip(mgr, entry, prepared, popt, full, stage if entry.refused else (stage + 1) % 4,
                                         where)
    if hasattr(popt, "remove_hooks"):
        popt.remove_hooks()
    result["_full"] = full
    return result


def _roundtrip(mgr: Any, entry: Entry, prepared: Any, popt: Any, saved: dict[str, torch.Tensor], stage: int,
               where: Path) -> dict[str, Any]:
    """Save to ``where``, load into a fresh model prepared at ``stage``: the same weights, tied names still tied."""
    mgr.save_checkpoint(where, prepared, popt)
    exported = None
    if mgr.rank == 0:  # what another launch resuming this checkpoint must find (--resume-from)
        torch.save({k: v.cpu() for k, v in saved.items()}, f"{where}.full.pt")
        # `unidist checkpoint export`: the shards this launch wrote, as one file safetensors' own reader loads
        from safetensors.torch import load_file

        from unidist.checkpoint import tool

        out = tool.export(tool.Opened(where), f"{where}.safetensors", progress=lambda *_: None)
        got = load_file(out)
        exported = _diff(got, saved) if sorted(got) == sorted(saved) else (float("inf"), False)
    model = entry.build()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)  # a different start: only the checkpoint can make it equal
    fresh, fopt = mgr.prepare(model, entry.optimizer(model), zero_stage=stage, sync_batchnorm=entry.sync_batchnorm)
    mgr.load_checkpoint(where, fresh, fopt)
    got = {k: v.cpu() for k, v in mgr.full_state_dict(fresh).items()}
    out = {"stage": stage, "diff": _diff(got, saved)[0], "tied": _tied(entry, mgr.unwrap(fresh)),
           "export": mgr.broadcast_object(exported, 0)}
    if hasattr(fopt, "remove_hooks"):
        fopt.remove_hooks()
    return out


def resume(mgr: Any, zoo: dict[str, Entry], source: Path) -> dict[str, Any]:
    """Every checkpoint another launch saved in ``source`` (``ckpt-<model>-<stage>``), loaded here into a fresh model
    prepared two stages on: max |w - what was saved| and whether the tied names are still one tensor."""
    out: dict[str, Any] = {}
    for full in sorted(source.glob("ckpt-*.full.pt")):
        name, stage = full.name[len("ckpt-"):-len(".full.pt")].rsplit("-", 1)
        entry, at = zoo[name], (int(stage) + 2) % 4
        model = entry.build()
        with torch.no_grad():
            for p in model.parameters():
                p.add_(1.0)
        fresh, fopt = mgr.prepare(model, entry.optimizer(model), zero_stage=at, sync_batchnorm=entry.sync_batchnorm)
        mgr.load_checkpoint(source / full.name[:-len(".full.pt")], fresh, fopt)
        got = {k: v.cpu() for k, v in mgr.full_state_dict(fresh).items()}
        diff, ints = _diff(got, torch.load(full))
        out[f"resume/{name}/{stage}"] = {"stage": at, "diff": diff, "ints_equal": ints,
                                         "tied": _tied(entry, mgr.unwrap(fresh)), "spread": _spread(mgr, got)}
        if hasattr(fopt, "remove_hooks"):
            fopt.remove_hooks()
    return out


class Nested(torch.nn.Module):
    """Returns what unidist must hand back as it came: a frozen dataclass holding a namedtuple, a dict and an int
    tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> Any:
        from zoo.models import Frozen, Pair

        h = self.lin(x)
        return Frozen(Pair(h, {"half": h[:, :2], "ids": torch.arange(2)}))


def outputs(mgr: Any, zoo: dict[str, Entry]) -> dict[str, Any]:
    """One forward per precision mode at stages 0 and 3 (GPT-2's ModelOutput where transformers is installed, and a
    nested dataclass/namedtuple/dict output): the type each came back as, and its floating dtypes (or the refusal)."""
    out: dict[str, Any] = {}
    models = {"nested": (Nested, lambda m: m(torch.randn(2, 4, device=mgr.device)))}
    if "gpt2" in zoo:
        models["gpt2"] = (zoo["gpt2"].build, lambda m: m(input_ids=torch.randint(2, 60, (2, 8), device=mgr.device)))
    for name, (build, call) in models.items():
        for precision in ("32", "bf16-mixed", "fp16-mixed", "bf16-true"):
            for stage in (0, 3):
                model = build()
                try:
                    prepared, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1),
                                                zero_stage=stage, precision=precision)
                except unidist.InvalidArgumentError as err:
                    out[f"outputs/{name}/{stage}/{precision}"] = {"refused": str(err)}
                    continue
                got = call(prepared)
                out[f"outputs/{name}/{stage}/{precision}"] = {
                    "type": type(got).__name__, "inner": type(getattr(got, "pair", None)).__name__,
                    "floats": _floats(got), "ints": sorted({str(t.dtype) for t in _all(got) if not
                                                            t.is_floating_point()})}
                if hasattr(opt, "remove_hooks"):
                    opt.remove_hooks()
    return out


def _all(out: Any) -> list[torch.Tensor]:
    from unidist.tree import tensors

    return list(tensors(out))


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--cells", default="sample", help="sample, all, none, or model:stage:precision,...")
    parser.add_argument("--resume-from", type=Path, help="load the checkpoints another launch saved there")
    parser.add_argument("--outputs", action="store_true", help="also check the output types of every precision")
    ns = parser.parse_args(unidist.script_args())
    if torch.cuda.is_available():  # the reference runs the same kernels: make them repeatable (embedding backward)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True, warn_only=True)
    zoo = available()
    with unidist.init() as mgr:
        if ns.cells in ("sample", "all"):
            cells = matrix.plan({k: v.precisions for k, v in zoo.items()}, mgr.backend, whole=ns.cells == "all")
        elif ns.cells == "none":
            cells = []
        else:
            cells = [(m, int(s), p) for m, s, p in (c.split(":") for c in ns.cells.split(","))]
        refs: dict[tuple[str, str], tuple[dict[str, torch.Tensor], str, float]] = {}
        report: dict[str, Any] = {"_meta": {"backend": mgr.backend, "size": mgr.size, "cells": cells,
                                            "models": list(zoo)}}
        for name, stage, precision in cells:
            key = f"{name}/{stage}/{precision}"
            entry = zoo[name]
            try:
                got = train(mgr, entry, stage, precision, ns.out / f"ckpt-{name}-{stage}")
                if "refused" not in got:
                    if (name, precision) not in refs:
                        refs[(name, precision)] = reference(entry, precision, mgr.size, matrix.STEPS, mgr.device)
                    want, ref_type, norm = refs[(name, precision)]
                    got["diff"], got["ints_equal"] = _diff(got.pop("_full"), want)
                    got["ref_type"], got["first_norm"] = ref_type, norm
                report[key] = got
            except Exception as err:  # recorded; the other cells still run on every rank
                traceback.print_exc()
                report[key] = {"error": f"{type(err).__name__}: {err}"}
        if ns.resume_from is not None:
            report.update(resume(mgr, zoo, ns.resume_from))
        if ns.outputs:
            report.update(outputs(mgr, zoo))
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
