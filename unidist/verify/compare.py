"""A launch against the one-process run, step by step, within the rounding envelope (envelope.py).

Exact facts first, each a divergence of its own when it differs: the starting weights (before step 1), and at each
step the rows the ranks saw, which rows (the batch's digest), a skipped step, the learning rates, and the
clipping's effect (the coefficient ``min(1, clip / norm)`` each run applied). Then the figures, in the order a step
computes them: the loss, the gradient norm before clipping, each parameter after the step; each is compared with
its own bound (the envelope times the factor). A parameter that is rounding-driven (envelope.py) and beyond its
bound is listed, not decisive.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from unidist.verify.envelope import Envelope, param_diff, rel
from unidist.verify.runs import Run

__all__ = ["Divergence", "StepDiff", "clip_coefficient", "compare", "data_differs", "step_diffs", "worst"]


@dataclass
class StepDiff:
    """One step of a launch against the reference: each figure's difference beside its bound, the parameter that
    came nearest its bound (or went furthest beyond), the largest ratio of difference to bound over the deciding
    figures, and the rounding-driven parameters that went beyond theirs."""

    step: int
    loss: float | None
    loss_bound: float | None
    grad_norm: float | None
    grad_norm_bound: float | None
    params: float | None
    params_bound: float | None
    param: str | None
    ratio: float | None
    noise: list[str] = field(default_factory=list)


@dataclass
class Divergence:
    """Where a launch first leaves the reference: the step (0: before the first, the starting weights), the
    quantity, its difference and bound, the parameter, and the causes that fit (filled in by causes.py)."""

    step: int
    quantity: str
    value: float | None
    bound: float | None
    param: str | None
    causes: list[str] = field(default_factory=list)


def _ratio(value: float | None, bound: float | None) -> float | None:
    if value is None or bound is None:
        return None
    if value == 0.0:
        return 0.0
    return value / bound if bound > 0 else math.inf


def step_diffs(run: Run, ref: Run, env: Envelope) -> list[StepDiff]:
    """Each common step's differences from the reference, beside their bounds."""
    out = []
    for i, (s, r) in enumerate(zip(run.steps, ref.steps, strict=False)):
        loss, gnorm = rel(s.get("loss"), r.get("loss")), rel(s.get("grad_norm"), r.get("grad_norm"))
        lb, gb = env.bound("loss", i), env.bound("grad_norm", i)
        mine, theirs = s.get("params") or {}, r.get("params") or {}
        best: tuple[float, str | None, float | None, float | None] = (-1.0, None, None, None)
        noise = []
        for name in sorted(set(mine) | set(theirs)):
            d = param_diff(mine.get(name), theirs.get(name))
            b = env.bound("params", i, name)
            q = _ratio(d, b) or 0.0
            if q > 1.0 and name in theirs and name in mine and env.rounding_driven(name, i):
                noise.append(name)
                continue
            if q > best[0]:
                best = (q, name, d, b)
        ratios = [x for x in (_ratio(loss, lb), _ratio(gnorm, gb), best[0] if best[1] else None) if x is not None]
        out.append(StepDiff(s["step"], loss, lb if loss is not None else None, gnorm,
                            gb if gnorm is not None else None, best[2], best[3], best[1],
                            max(ratios) if ratios else None, noise))
    return out


def clip_coefficient(clip: float | None, norm: float | None) -> float:
    """What clipping multiplied the gradient by: ``min(1, clip / norm)`` (1 without clipping or a norm)."""
    if clip is None or norm is None or not math.isfinite(norm) or norm <= 0:
        return 1.0
    return min(1.0, float(clip) / norm)


def data_differs(s: Mapping[str, Any], r: Mapping[str, Any]) -> bool:
    """Whether two steps saw other rows: the digest (a sum of each input value through a sine: each term at most 1,
    so float64 summation order moves it by far less than 1e-6 a row), or, in a fingerprint without one, the inputs'
    plain sum."""
    if "digest" in s and "digest" in r:
        return abs(float(s["digest"]) - float(r["digest"])) > 1e-6 * max(1, int(r.get("rows") or 0))
    return (rel(s.get("inputs"), r.get("inputs")) or 0.0) > 1e-6


def _start(run: Run, ref: Run, env: Envelope) -> Divergence | None:
    a, b = (run.start or {}).get("params"), (ref.start or {}).get("params")
    if not a or not b:
        return None
    worst_name, worst_d = None, 0.0
    for name in sorted(set(a) | set(b)):
        d = param_diff(a.get(name), b.get(name))
        if d > worst_d:
            worst_name, worst_d = name, d
    if worst_d > env.factor * env.floor and (env.fixed is None or worst_d > env.fixed):
        return Divergence(0, "start", worst_d, env.factor * env.floor, worst_name)
    return None


def _facts(i: int, s: dict[str, Any], r: dict[str, Any], run: Run, ref: Run, env: Envelope) -> Divergence | None:
    step = s["step"]
    if s.get("rows") != r.get("rows"):
        return Divergence(step, "rows", float(s.get("rows") or 0), float(r.get("rows") or 0), None)
    if data_differs(s, r):
        return Divergence(step, "data", None, None, None)
    if bool(s.get("skipped")) != bool(r.get("skipped")):
        return Divergence(step, "skipped", None, None, None)
    lr_a, lr_b = list(s.get("lr") or []), list(r.get("lr") or [])
    if len(lr_a) != len(lr_b) or any((rel(x, y) or 0.0) > 1e-9 for x, y in zip(lr_a, lr_b, strict=False)):
        worst_lr = max((rel(x, y) or 0.0 for x, y in zip(lr_a, lr_b, strict=False)), default=math.inf)
        return Divergence(step, "lr", worst_lr, 0.0, None)
    ca = clip_coefficient(run.header.get("clip"), s.get("grad_norm"))
    cb = clip_coefficient(ref.header.get("clip"), r.get("grad_norm"))
    d = rel(ca, cb) or 0.0
    if run.header.get("clip") != ref.header.get("clip") and d > env.bound("grad_norm", i):
        return Divergence(step, "clipping", d, env.bound("grad_norm", i), None)
    return None


def compare(run: Run, ref: Run, env: Envelope) -> Divergence | None:
    """The first place ``run`` leaves ``ref`` (None: they agree on every common step, and have as many)."""
    found = _start(run, ref, env)
    if found is not None:
        return found
    for i, (s, r, d) in enumerate(zip(run.steps, ref.steps, step_diffs(run, ref, env), strict=False)):
        found = _facts(i, s, r, run, ref, env)
        if found is not None:
            return found
        for quantity, value, bound in (("loss", d.loss, d.loss_bound), ("grad_norm", d.grad_norm, d.grad_norm_bound),
                                       ("params", d.params, d.params_bound)):
            if value is not None and bound is not None and value > bound:
                return Divergence(d.step, quantity, value, bound, d.param if quantity == "params" else None)
    if len(run.steps) != len(ref.steps):
        return Divergence(min(len(run.steps), len(ref.steps)) + 1, "steps", float(len(run.steps)),
                          float(len(ref.steps)), None)
    return None


def worst(diffs: Sequence[StepDiff]) -> dict[str, Any]:
    """Each figure at the step where it came nearest its bound (or furthest beyond): ``{quantity: {"step",
    "value", "bound"[, "param"]}}``, and the largest ratio."""
    out: dict[str, Any] = {}
    for quantity in ("loss", "grad_norm", "params"):
        top: dict[str, Any] | None = None
        for d in diffs:
            value, bound = getattr(d, quantity), getattr(d, f"{quantity}_bound")
            q = _ratio(value, bound)
            if q is not None and (top is None or q > top["ratio"]):
                top = {"step": d.step, "value": value, "bound": bound, "ratio": q}
                if quantity == "params":
                    top["param"] = d.param
        out[quantity] = top
    ratios = [d.ratio for d in diffs if d.ratio is not None]
    out["ratio"] = max(ratios) if ratios else None
    return out
