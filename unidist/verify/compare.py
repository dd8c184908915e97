"""Comparing fingerprints (``unidist.train.fingerprint``): each launch against the one-process run, step by step.

Quantities compared at every step: the loss (relative difference), the gradient norm before clipping (relative),
and the parameters: for each one, its norm's relative difference and its sum's difference over its norm, the
largest over all parameters (so a change confined to one small bias is not lost in the whole model's norm). Exact
facts: the rows the ranks saw, the batch digest, skipped steps, the number of steps.

Tolerances follow the precision in use (``TOLERANCES``): float32 on N ranks sums in another order than one
process does, which moves the last bits (about 1e-7 relative per operation; after hundreds of Adam steps of a small
model the figures measured here stay under 1e-5); bf16 and fp16 round each rank's smaller batch differently (a
bf16 mantissa has 8 bits: 4e-3 relative per rounding), so their tolerance is wider.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["TOLERANCES", "Divergence", "Run", "StepDiff", "compare", "read"]

# precision mode -> the largest relative difference that still counts as the same training
TOLERANCES = {"32": 1e-4, "bf16-mixed": 5e-2, "fp16-mixed": 2e-2, "bf16-true": 1e-1}
_TINY = 1e-12


@dataclass
class Run:
    """One launch's fingerprint: its header and its steps (one dict per optimizer step)."""

    label: str
    header: dict[str, Any]
    steps: list[dict[str, Any]]


def read(path: str | Path, label: str) -> Run:
    """A fingerprint file as a Run; an InvalidArgumentError if it is not one."""
    lines = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
    if not lines or "unidist_fingerprint" not in lines[0]:
        raise InvalidArgumentError(f"{path} is not a unidist fingerprint (its first line is no header)")
    return Run(label, lines[0], lines[1:])


@dataclass
class StepDiff:
    """The differences of one step of a launch from the reference (relative; None where not comparable)."""

    step: int
    loss: float | None
    grad_norm: float | None
    params: float | None
    param: str | None  # the parameter that differs most


@dataclass
class Divergence:
    """Where a launch first leaves the tolerance: the step, the quantity, the parameter, the causes that fit."""

    step: int
    quantity: str
    value: float | None
    param: str | None
    causes: list[str] = field(default_factory=list)


def _rel(a: float | None, b: float | None) -> float | None:
    if a is None or b is None:
        return None if a is None and b is None else math.inf
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    return abs(a - b) / max(abs(b), _TINY)


def _params(a: dict[str, list[float]], b: dict[str, list[float]]) -> tuple[float | None, str | None]:
    worst, name = 0.0, None
    extra = sorted(set(a) - set(b))
    if extra:  # trained here, absent from the reference: a model that differs with the launch
        return math.inf, extra[0]
    for n, (norm_b, sum_b) in b.items():
        if n not in a:
            return math.inf, n
        norm_a, sum_a = a[n]
        d = max(abs(norm_a - norm_b), abs(sum_a - sum_b)) / max(norm_b, _TINY)
        if not math.isfinite(d) or d > worst:
            worst, name = (d if math.isfinite(d) else math.inf), n
    return worst, name


def step_diffs(run: Run, ref: Run) -> list[StepDiff]:
    """Each common step's differences from the reference."""
    out = []
    for s, r in zip(run.steps, ref.steps, strict=False):
        pd, pname = _params(s.get("params", {}), r.get("params", {}))
        out.append(StepDiff(s["step"], _rel(s.get("loss"), r.get("loss")),
                            _rel(s.get("grad_norm"), r.get("grad_norm")), pd, pname))
    return out


def tolerance(ref: Run, given: float | None = None) -> float:
    """The tolerance for this reference's precision (``given`` overrides it)."""
    if given is not None:
        return given
    return TOLERANCES.get(str(ref.header.get("precision", "32")), TOLERANCES["32"])


def compare(run: Run, ref: Run, tol: float) -> Divergence | None:
    """The first step where ``run`` leaves ``ref`` (None: they agree on every common step, and have as many)."""
    diffs = step_diffs(run, ref)
    for (s, r), d in zip(zip(run.steps, ref.steps, strict=False), diffs, strict=True):
        if s.get("rows") != r.get("rows"):
            return Divergence(d.step, "rows", float(s.get("rows") or 0), None, causes(run, ref, d.step, "rows"))
        if bool(s.get("skipped")) != bool(r.get("skipped")):
            return Divergence(d.step, "skipped", None, None, causes(run, ref, d.step, "skipped"))
        for quantity, value in (("loss", d.loss), ("grad_norm", d.grad_norm), ("params", d.params)):
            if value is not None and value > tol:
                return Divergence(d.step, quantity, value, d.param if quantity == "params" else None,
                                  causes(run, ref, d.step, quantity))
    if len(run.steps) != len(ref.steps):
        step = min(len(run.steps), len(ref.steps)) + 1
        return Divergence(step, "steps", float(len(run.steps)), None,
                          [f"this launch made {len(run.steps)} optimizer steps and the one-process run "
                           f"{len(ref.steps)}: the number of steps depends on the world size (an epoch of "
                           "len(data) // per-rank batch steps, or a sampler that drops or pads rows)"])
    return None


def causes(run: Run, ref: Run, step: int, quantity: str) -> list[str]:
    """The known causes that fit what differs (most specific first)."""
    s, r = run.steps[step - 1], ref.steps[step - 1]
    h, hr = run.header, ref.header
    out = []
    if h.get("precision") != hr.get("precision"):
        out.append(f"a precision mode that means different things: this launch trains in {h.get('precision')!r}, "
                   f"the reference in {hr.get('precision')!r} (an engine's own fp16/bf16 section, or "
                   "UNIDIST_PRECISION set for one launcher only)")
    if h.get("clip") != hr.get("clip"):
        g = s.get("grad_norm")
        over = f" (the gradient norm at step {step} was {g:.4g})" if isinstance(g, float) else ""
        out.append(f"gradient clipping that only this launch does: it clips the gradient norm at {h.get('clip')}"
                   f"{over}, the reference at {hr.get('clip')} (an engine config passed on one backend only, or an "
                   "engine default that changes the math: DeepSpeed's own defaults to gradient_clipping: 1.0; pass "
                   "clip_grad_norm= to prepare on every backend instead)")
    if h.get("accumulation") != hr.get("accumulation"):
        out.append(f"a different accumulation: {h.get('accumulation')} backward passes a step here, "
                   f"{hr.get('accumulation')} in the reference")
    rows, ref_rows = s.get("rows") or 0, r.get("rows") or 0
    if rows != ref_rows:
        world = int(h.get("dp") or h.get("world") or 1)
        why = ("each rank training on every row: no mgr.shard/ShardSampler, or a batch size meant per rank, not "
               "global" if ref_rows and rows == world * ref_rows else
               "a sampler that pads or drops rows so that they split evenly over the ranks (torch's "
               "DistributedSampler repeats rows to pad the last batch), or a per-rank batch size")
        out.append(f"a different effective batch: the ranks together saw {rows} rows in step {step}, the "
                   f"one-process run {ref_rows} ({why})")
    elif not rows and not ref_rows and step == 1 and quantity in ("grad_norm", "params"):
        out.append("a different effective batch or different data: the gradient differs at the first step (this "
                   "script's rows are not recorded: hvd.DistributedOptimizer is given parameters, not the model; a "
                   "batch size per rank, as in Horovod's examples, makes the global batch grow with the ranks)")
    elif abs((s.get("inputs") or 0.0) - (r.get("inputs") or 0.0)) > 1e-6 * max(1.0, abs(r.get("inputs") or 0.0)):
        out.append(f"a data order that depends on the rank or the world size: the rows of step {step} are not the "
                   "one-process run's (a shuffle seeded with the rank, a sampler whose order depends on the number "
                   "of ranks)")
    if bool(s.get("skipped")) != bool(r.get("skipped")):
        which = "this launch" if s.get("skipped") else "the one-process run"
        out.append(f"an fp16 overflow seen on only part of the data: {which} skipped step {step} (inf/nan in the "
                   "gradient) and the other did not: a loss or activation that overflows with some ranks' rows, or "
                   "a skip decided per rank")
    if s.get("lr") != r.get("lr"):
        out.append(f"different learning rates at step {step}: {s.get('lr')} here, {r.get('lr')} in the reference "
                   "(a schedule or LR scaled by the world size)")
    if not out and step == 1 and quantity == "loss":
        out.append("different starting weights or labels: step 1's rows are the same but its loss is not (a seed "
                   "that depends on the rank, weights initialised after prepare, labels not sharded like inputs)")
    if not out and "horovod" in (h.get("api"), hr.get("api")):
        out.append("different data or starting weights (a Horovod-API script's fingerprint has no loss and no rows: "
                   "hvd.DistributedOptimizer is given parameters, not the model): a data order or shard that "
                   "depends on the rank or the world size, a batch size per rank, or weights not broadcast")
    if not out:
        out.append("nondeterministic kernels or a reduction order that moves the last bits further than the "
                   "tolerance: the difference starts small and grows; if that is expected here, raise --tolerance, "
                   "or use torch.use_deterministic_algorithms(True)")
    return out


def worst(diffs: Sequence[StepDiff]) -> dict[str, float | None]:
    """The largest difference of each quantity over the steps."""
    def top(vals: list[float | None]) -> float | None:
        known = [v for v in vals if v is not None]
        return max(known) if known else None
    return {"loss": top([d.loss for d in diffs]), "grad_norm": top([d.grad_norm for d in diffs]),
            "params": top([d.params for d in diffs])}
