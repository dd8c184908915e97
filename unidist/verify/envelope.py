"""The rounding envelope: how far rounding alone moves *this* script, step by step, quantity by quantity.

Verify runs the one-process reference again with its rounding perturbed (``UNIDIST_FINGERPRINT_PERTURB``:
every module output and parameter gradient moved by one rounding error of its dtype, unidist/train/rounding.py),
``RUNS`` times with other seeds. How far those runs land from the reference, at each step, for the loss, the
gradient norm and each parameter, is the envelope: what another summation order may do to this script. A launch
agrees when each of its differences stays within ``FACTOR`` times the envelope (the largest over the perturbed runs
and over the steps so far), never below ``FLOOR_EPS`` epsilons of the compared values' dtype.

Why a measurement and not a constant: a fixed 1e-4 called a correct GPT-2 with AdamW divergent (its attention key
bias has a gradient that is zero but for rounding, and Adam turns that noise into learning-rate-sized steps), while
a weight decay scaled by the world size moves well-determined parameters by ~1e-5 a step. Per parameter, the
envelope of a well-determined weight stays near 1e-7 and that of the key bias is as large as its steps.

A parameter is *rounding-driven* at a step when rounding alone moved it at least ``NOISE_SHARE`` as far as training
moved it from its starting value (and more than the floor): its trajectory is mostly rounding, so it is reported
and cannot by itself make a launch diverge.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

from unidist.precisions import MODES
from unidist.verify.runs import Run

__all__ = ["EPS", "FACTOR", "FLOOR_EPS", "NOISE_SHARE", "RUNS", "Envelope", "measure", "param_diff", "rel"]

RUNS = 2  # perturbed one-process runs
FACTOR = 10.0  # a launch agrees within this many envelopes
FLOOR_EPS = 4  # the smallest envelope, in epsilons of the compared values' dtype
NOISE_SHARE = 0.1  # rounding-driven: rounding moved it at least this share of how far training did
# the machine epsilon of the dtype the parameters (and the loss) are kept in, per precision mode (its row's)
EPS = {name: mode.weight_eps for name, mode in MODES.items()}
_TINY = 1e-30


def rel(a: float | None, b: float | None) -> float | None:
    """The relative difference of ``a`` from ``b`` (None where neither is known; inf where one is missing or
    only one is finite)."""
    if a is None or b is None:
        return None if a is None and b is None else math.inf
    if not (math.isfinite(a) and math.isfinite(b)):
        return 0.0 if a == b or (math.isnan(a) and math.isnan(b)) else math.inf
    if a == b:
        return 0.0
    return abs(a - b) / max(abs(b), _TINY)


def param_diff(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """One parameter's difference: the largest of its norm's and its sum's difference, over its norm (so a change
    confined to a few elements is not lost); inf where one side lacks it."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    d = max(abs(a[0] - b[0]), abs(a[1] - b[1]))
    if d == 0.0:
        return 0.0
    d /= max(abs(b[0]), _TINY)
    return d if math.isfinite(d) else math.inf


@dataclass
class Envelope:
    """Per step (index 0 is step 1): the envelope of the loss, the gradient norm and each parameter, and how far
    training moved each parameter in the reference. ``fixed`` (``--tolerance``) replaces the measured bound."""

    factor: float = FACTOR
    floor: float = FLOOR_EPS * EPS["32"]
    runs: int = 0
    fixed: float | None = None
    loss: list[float] = field(default_factory=list)
    grad_norm: list[float] = field(default_factory=list)
    params: list[dict[str, float]] = field(default_factory=list)
    moved: list[dict[str, float]] = field(default_factory=list)

    def envelope(self, quantity: str, i: int, name: str | None = None) -> float:
        """The measured envelope (before the factor and the floor) of ``quantity`` at step index ``i``."""
        if self.fixed is not None:
            return self.fixed
        table: Sequence[float] | Sequence[Mapping[str, float]] = getattr(self, quantity)
        if not table:
            return 0.0
        row = table[min(i, len(table) - 1)]
        if isinstance(row, Mapping):
            return float(row.get(name or "", 0.0))
        return float(row)

    def bound(self, quantity: str, i: int, name: str | None = None) -> float:
        """The largest difference that agrees: ``fixed``, else ``factor`` times the envelope, at least the floor."""
        if self.fixed is not None:
            return self.fixed
        return self.factor * max(self.envelope(quantity, i, name), self.floor)

    def rounding_driven(self, name: str, i: int) -> bool:
        """Whether parameter ``name`` is mostly rounding at step index ``i`` (see the module docstring)."""
        if self.fixed is not None or not self.params or not self.moved:
            return False
        env = self.envelope("params", i, name)
        moved = self.moved[min(i, len(self.moved) - 1)].get(name)
        return env > self.floor and moved is not None and env >= NOISE_SHARE * moved

    def as_dict(self) -> dict[str, object]:
        return {"runs": self.runs, "factor": self.factor, "floor": self.floor, "fixed": self.fixed,
                "loss": self.loss, "grad_norm": self.grad_norm}


def _running_max(values: list[float]) -> list[float]:
    out, top = [], 0.0
    for v in values:
        top = max(top, v)
        out.append(top)
    return out


def measure(ref: Run, perturbed: Sequence[Run], factor: float = FACTOR, fixed: float | None = None) -> Envelope:
    """The envelope of ``ref`` from its perturbed re-runs (``fixed``: a constant bound instead, ``--tolerance``)."""
    floor = FLOOR_EPS * EPS.get(ref.precision, EPS["32"])
    env = Envelope(factor=factor, floor=floor, runs=len(perturbed), fixed=fixed)
    n = len(ref.steps)
    if perturbed:
        def worst(quantity: str, i: int) -> float:
            vals = [rel(p.steps[i].get(quantity), ref.steps[i].get(quantity)) for p in perturbed if i < len(p.steps)]
            known = [v for v in vals if v is not None]
            return max(known) if known else 0.0
        env.loss = _running_max([worst("loss", i) for i in range(n)])
        env.grad_norm = _running_max([worst("grad_norm", i) for i in range(n)])
        top: dict[str, float] = {}
        for i, r in enumerate(ref.steps):
            for name, value in (r.get("params") or {}).items():
                here = [param_diff(p.steps[i].get("params", {}).get(name), value) for p in perturbed
                        if i < len(p.steps)]
                top[name] = max([top.get(name, 0.0), *here])
            env.params.append(dict(top))
    base = (ref.start or {}).get("params")
    for r in ref.steps:
        now = r.get("params") or {}
        env.moved.append({k: param_diff(base.get(k), v) for k, v in now.items()} if base else {})
    return env
