"""``--locate``: the first module and phase where a diverging launch leaves the rounding envelope.

Verify re-runs the one-process run, its rounding re-runs and the launch up to the launch's first diverging step
with ``UNIDIST_FINGERPRINT_LOCATE`` (unidist/train/probes.py: per-module statistics of every step, each rank's share
combined), then walks that step in the order it ran and names the first place whose difference from the reference
exceeds the factor times the envelope (what the rounding re-runs differ by there):

1. the data: the rows and the batch's digest;
2. forward: each module's output, in the order the modules finished;
3. backward: the gradient each module's backward handed its input, in the order they ran;
4. the parameter gradients each rank computed, combined (the mean the reduction should produce);
5. gradient reduction: the global gradient norm after the reduction, before clipping;
6. clipping: the coefficient the clipping applied;
7. optimizer step: the learning rates, then the parameters after the step.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from unidist.verify.compare import clip_coefficient, data_differs
from unidist.verify.envelope import Envelope, param_diff, rel
from unidist.verify.runs import Run

__all__ = ["PHASES", "Location", "locate"]

PHASES = ("data", "forward", "backward", "parameter gradients", "gradient reduction", "clipping", "optimizer step")


@dataclass
class Location:
    """Where a launch first leaves the envelope at ``step`` (``phase`` None: nothing did on the re-run)."""

    step: int
    phase: str | None
    where: str | None
    value: float | None
    bound: float | None
    said: str


def _spread_diff(a: Sequence[float] | None, b: Sequence[float] | None, apart: int) -> float:
    """Statistics ``[sum or mean, its squares, ...]`` against the reference's: the first's difference over the root
    of the second, the second's relative difference (halved: a norm's), and entry ``apart`` (a value kept apart,
    compared by its relative difference)."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    out = 0.0
    if b[1] > 0:
        out = max(abs(a[0] - b[0]) / math.sqrt(b[1]), abs(a[1] - b[1]) / (2 * b[1]))
    elif a[1] > 0:
        return math.inf
    mine, theirs = (a[apart], b[apart]) if len(a) > apart and len(b) > apart else (0.0, 0.0)
    if mine != theirs:
        out = max(out, abs(mine - theirs) / abs(theirs) if theirs else math.inf)
    return out


def _forward_diff(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """A module's output ``[mean, mean square, count, mean of the 0-dimensional outputs]``: the counts are not
    compared (a tensor alike on every rank is counted once per rank)."""
    return _spread_diff(a, b, 3)


def _module_diff(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """A module's input gradient ``[row-wise sum, row-wise squares, replicated sum]``."""
    return _spread_diff(a, b, 2)


def _grad_diff(a: Sequence[float] | None, b: Sequence[float] | None) -> float:
    """A parameter's gradient ``[sum, projection, squares]``: the linear statistics' difference over its norm."""
    if a is None or b is None:
        return 0.0 if a is None and b is None else math.inf
    d = max(abs(a[0] - b[0]), abs(a[1] - b[1]))
    if d == 0:
        return 0.0
    return d / math.sqrt(b[2]) if b[2] > 0 else math.inf


class _Walk:
    """Compares one entry of the step's probes (or a figure) with its envelope."""

    def __init__(self, step: int, launch: dict[str, Any], ref: dict[str, Any], perturbed: list[dict[str, Any]],
                 env: Envelope) -> None:
        self.step, self.launch, self.ref, self.perturbed, self.env = step, launch, ref, perturbed, env

    def bound(self, values: list[float]) -> float:
        return self.env.factor * max([self.env.floor, *[v for v in values if math.isfinite(v)]])

    def entries(self, phase: str, key: str, diff: Callable[[Any, Any], float]) -> Location | None:
        theirs: Mapping[str, Any] = (self.ref.get("probes") or {}).get(key) or {}
        mine: Mapping[str, Any] = (self.launch.get("probes") or {}).get(key) or {}
        for name, value in theirs.items():
            d = diff(mine.get(name), value)
            b = self.bound([diff(((p.get("probes") or {}).get(key) or {}).get(name), value) for p in self.perturbed])
            if d > b:
                return Location(self.step, phase, name, d, b, "")
        return None

    def figure(self, phase: str, d: float, values: list[float | None]) -> Location | None:
        b = self.bound([v for v in values if v is not None])
        return Location(self.step, phase, None, d, b, "") if d > b else None


def locate(launch: Run, ref: Run, perturbed: Sequence[Run], step: int, env: Envelope) -> Location:
    """Walk step ``step`` of the re-runs (see the module docstring); the first place that leaves the envelope."""
    i = step - 1
    if i >= len(launch.steps) or i >= len(ref.steps):
        return Location(step, None, None, None, None, f"the re-runs did not reach step {step}")
    s, r = launch.steps[i], ref.steps[i]
    ps = [p.steps[i] for p in perturbed if i < len(p.steps)]
    walk = _Walk(step, s, r, ps, env)
    if s.get("rows") != r.get("rows") or data_differs(s, r):
        return _said(Location(step, "data", None, None, None, ""), s, r)
    for phase, key, diff in (("forward", "forward", _forward_diff), ("backward", "backward", _module_diff),
                             ("parameter gradients", "grads", _grad_diff)):
        found = walk.entries(phase, key, diff)
        if found is not None:
            return _said(found, s, r)
    found = walk.figure("gradient reduction", rel(s.get("grad_norm"), r.get("grad_norm")) or 0.0,
                        [rel(p.get("grad_norm"), r.get("grad_norm")) for p in ps])
    if found is not None:
        return _said(found, s, r)
    ca = clip_coefficient(launch.header.get("clip"), s.get("grad_norm"))
    cb = clip_coefficient(ref.header.get("clip"), r.get("grad_norm"))
    found = walk.figure("clipping", rel(ca, cb) or 0.0,
                        [rel(clip_coefficient(ref.header.get("clip"), p.get("grad_norm")), cb) for p in ps])
    if found is not None:
        return _said(found, s, r)
    if s.get("lr") != r.get("lr"):
        return _said(Location(step, "optimizer step", "learning rates", None, None, ""), s, r)
    beyond = []  # every parameter changes in the step: the one furthest beyond its bound says most
    for name, value in (r.get("params") or {}).items():
        if env.rounding_driven(name, i):
            continue
        d = param_diff((s.get("params") or {}).get(name), value)
        b = walk.bound([param_diff((p.get("params") or {}).get(name), value) for p in ps])
        if d > b:
            beyond.append((d / b, name, d, b))
    if beyond:
        _, name, d, b = max(beyond)
        return _said(Location(step, "optimizer step", name, d, b, ""), s, r)
    return Location(step, None, None, None, None,
                    f"nothing leaves the envelope at step {step} on the re-run: the divergence did not repeat (a "
                    "launch that differs from run to run: see the causes)")


def _said(loc: Location, s: Mapping[str, Any], r: Mapping[str, Any]) -> Location:
    figures = f" ({loc.value:.2g} against a bound of {loc.bound:.2g})" if loc.value is not None and loc.bound else ""
    what = {
        "data": f"the data of step {loc.step}: {s.get('rows')} rows with digest {s.get('digest', 0.0):.9g}, the "
                f"one-process run {r.get('rows')} rows with digest {r.get('digest', 0.0):.9g}",
        "forward": f"the forward of {loc.where}: its output{figures}",
        "backward": f"the backward of {loc.where}: the gradient it hands its input{figures}",
        "parameter gradients": f"the gradient of {loc.where} as the ranks computed it, before the reduction{figures}",
        "gradient reduction": f"the gradient reduction: every module and every rank's gradient agree, the reduced "
                              f"gradient's norm does not{figures}",
        "clipping": f"the clipping: the gradient norm agrees, the coefficient the clipping applied does not{figures}",
        "optimizer step": (f"the optimizer step: the learning rates differ ({s.get('lr')} here, {r.get('lr')} in the "
                           "one-process run)" if loc.where == "learning rates" else
                           f"the optimizer step: every gradient and the clipping agree, {loc.where} after the step "
                           f"does not{figures} (the optimizer's settings: a weight decay, momentum or learning rate "
                           "that depends on the world size)"),
    }[loc.phase or "data"]
    loc.said = f"step {loc.step}, {what}"
    return loc
