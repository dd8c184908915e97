"""Why a launch left the one-process run: the causes that the evidence supports, strongest first.

Each cause is named only on evidence: a checkpoint the launch loaded (its fingerprint records it, and which launch
wrote it), an exact fact that differs (the clipping, the precision, the accumulation, the rows, the batch's digest,
the learning rates, a skipped step, the starting weights), random ops seen inside the model, every launch agreeing
with the others while all leave one process at step 1 (then what differs is one process against N: random draws per
rank, or a batch split under low precision), a second run of the same launch that differs from its first
(nondeterministic kernels: never said without that re-run), a difference that starts within rounding and grows
(said only when it does). When none fits, verify says what it ruled out and where ``--locate`` looks.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field

from unidist.precisions import MODES
from unidist.verify.compare import Divergence, StepDiff, data_differs
from unidist.verify.envelope import Envelope
from unidist.verify.locate import Location
from unidist.verify.runs import Run, sites

__all__ = ["Evidence", "causes", "random_summary"]

_DROPOUT = ("dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
            "feature_dropout", "scaled_dot_product_attention", "multi_head_attention_forward")


@dataclass
class Evidence:
    """What verify learned beyond one launch's fingerprint."""

    random: dict[str, int] = field(default_factory=dict)  # the reference's random calls, by "site:op"
    random_mode: str = "keep"  # the reference's UNIDIST_FINGERPRINT_RANDOM: off, count (keep: not counted)
    peers_agree: bool = False  # the launches agree with one another and all leave the reference at step 1
    # label -> how far a second run lands from its first: (largest relative difference, largest share of the bound)
    rerun: dict[str, tuple[float, float]] = field(default_factory=dict)
    # per launch: the checkpoint paths saved by the runs before it in this verify -> which run saved each
    writers: dict[str, dict[str, str]] = field(default_factory=dict)


def _in_model(calls: Mapping[str, int]) -> dict[str, dict[str, int]]:
    from unidist.train.random_ops import OUTSIDE

    return {op: {site: n for site, n in where.items() if site != OUTSIDE}
            for op, where in sites(calls).items() if any(site != OUTSIDE for site in where)}


def random_summary(calls: Mapping[str, int], limit: int = 3) -> str:
    """``dropout at transformer.drop, ... (40 calls); ...`` for each op seen inside the model, then the draws made
    outside it (data loading, initialisation: alike on every rank when every rank makes the same calls), or
    "none"."""
    from unidist.train.random_ops import OUTSIDE

    parts, outside = [], 0
    for op, where in sorted(sites(calls).items()):
        outside += where.pop(OUTSIDE, 0)
        if not where:
            continue
        names = sorted(where, key=lambda s: -where[s])
        shown = ", ".join(names[:limit]) + (f" and {len(names) - limit} more" if len(names) > limit else "")
        parts.append(f"{op} at {shown} ({sum(where.values())} calls)")
    if outside:
        parts.append(f"{outside} draw{'s' if outside != 1 else ''} outside the model (data loading, "
                     "initialisation)")
    return "; ".join(parts) if parts else "none"


def _loaded(run: Run, ref: Run, ev: Evidence) -> str | None:
    mine = [os.path.normpath(e["path"]) for e in run.loads()]
    theirs = [os.path.normpath(e["path"]) for e in ref.loads()]
    if not mine or mine == theirs:
        return None
    path = mine[0]
    before = ev.writers.get(run.label, {})
    writer = before.get(path) or next((lab for p, lab in before.items() if path.startswith(p + os.sep)), None)
    by = f", which the launch {writer} wrote earlier in this verify" if writer else ""
    return (f"this launch resumed from a checkpoint: it loaded {path} after {run.loads()[0].get('after_step', 0)} "
            f"steps{by}, and the one-process run " + ("loaded none" if not theirs else f"loaded {theirs[0]}") +
            ": the launches are not independent; give the script a checkpoint directory of its own per run (a "
            "relative path: verify starts each launch in a working directory of its own), or start without one")


def _facts(run: Run, ref: Run, div: Divergence) -> list[str]:
    h, hr = run.header, ref.header
    i = max(div.step, 1) - 1
    s = run.steps[i] if i < len(run.steps) else {}
    r = ref.steps[i] if i < len(ref.steps) else {}
    out = []
    if h.get("precision") != hr.get("precision"):
        out.append(f"a precision mode that means different things: this launch trains in {h.get('precision')!r}, "
                   f"the reference in {hr.get('precision')!r} (an engine's own fp16/bf16 section, or "
                   "UNIDIST_PRECISION set for one launcher only)")
    if h.get("clip") != hr.get("clip"):
        g = s.get("grad_norm")
        over = f" (the gradient norm at step {div.step} was {g:.4g})" if isinstance(g, float) else ""
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
        out.append(f"a different effective batch: the ranks together saw {rows} rows in step {div.step}, the "
                   f"one-process run {ref_rows} ({why})")
    elif data_differs(s, r):
        out.append(f"a data order that depends on the rank or the world size: the rows of step {div.step} are not "
                   "the one-process run's (a shuffle seeded with the rank, a sampler whose order depends on the "
                   "number of ranks)")
    if bool(s.get("skipped")) != bool(r.get("skipped")):
        which = "this launch" if s.get("skipped") else "the one-process run"
        out.append(f"an fp16 overflow seen on only part of the data: {which} skipped step {div.step} (inf/nan in "
                   "the gradient) and the other did not: a loss or activation that overflows with some ranks' rows, "
                   "or a skip decided per rank")
    if s.get("lr") != r.get("lr"):
        mine, theirs = list(s.get("lr") or []), list(r.get("lr") or [])
        world = int(h.get("dp") or h.get("world") or 1)
        scaled = bool(theirs) and len(mine) == len(theirs) and all(
            b and abs(a / b - world) < 1e-9 * world for a, b in zip(mine, theirs, strict=True))
        why = f"exactly {world} times, the number of ranks: a learning rate scaled by the world size, as Horovod's " \
            "examples do" if scaled and world > 1 else "a schedule or a learning rate that depends on the world size"
        out.append(f"different learning rates at step {div.step}: {mine} here, {theirs} in the reference ({why})")
    if div.quantity == "start":
        out.append(f"different starting weights ({div.param} differs before the first step): weights initialised "
                   "with a seed that depends on the rank or the world size and not broadcast, or changed after prepare")
    return out


def _grows(diffs: list[StepDiff], div: Divergence) -> str | None:
    """"Starts small and grows", when it does: the figure's ratio to its bound was at most a quarter of the
    crossing one at step 1, and rose to the bound without a jump (the step before the crossing at least a quarter of
    it); a difference that appears at once, or is there from step 1, is not one that grows."""
    if div.step <= 2 or div.quantity not in ("loss", "grad_norm", "params"):
        return None
    series = [d.ratio or 0.0 for d in diffs[:div.step]]
    first, before, last = series[0], series[-2], series[-1]
    if last > 1.0 and 0 < first <= last / 4 and before >= last / 4:
        return (f"a difference that starts within rounding and grows: {first:.2g} of the bound at step 1, "
                f"{last:.2g} at step {div.step}: a small difference in what one step computes compounds over "
                "the steps (--locate names the first module and phase where it leaves the envelope)")
    return None


_PHASE_CAUSES = {
    "forward": "the forward of {where} computes otherwise on N ranks than in one process, with the same data and "
               "weights: an op that reads the batch's rows together (BatchNorm statistics per rank, a normalisation "
               "or a loss over the batch dimension), or random draws in it",
    "backward": "the backward of {where} computes otherwise on N ranks, with the same forward: a custom autograd "
                "function or a hook whose gradient depends on the rank or the world size",
    "parameter gradients": "the gradient of {where} as the ranks compute it, combined, is not one process's, with "
                           "every module's backward agreeing: a gradient hook or scaling that depends on the world "
                           "size",
    "gradient reduction": "the gradient reduction: every rank's gradient agrees with one process's, the reduced one "
                          "does not (a sum where a mean is wanted, a compression, a rank left out of the average)",
    "clipping": "the clipping: the gradient norm agrees, the coefficient the clipping applied does not (a clip value "
                "or norm type that differs between the launches)",
    "optimizer step": "an optimizer setting that depends on the world size: every gradient, the clipping and the "
                      "learning rates agree at step {step}, and the step moves {where} otherwise (a weight decay, a "
                      "momentum or betas scaled by the ranks, or another optimizer)",
}


def causes(run: Run, ref: Run, div: Divergence, env: Envelope, diffs: list[StepDiff], ev: Evidence,
           location: Location | None = None) -> list[str]:
    """The causes the evidence supports for ``div``, strongest first (never empty); ``location``: where the
    re-runs located it (locate.py), if they did."""
    out = []
    loaded = _loaded(run, ref, ev)
    if loaded:  # a resumed run's steps are another run's later steps: what else differs follows from that
        return [loaded]
    out += _facts(run, ref, div)
    in_model = _in_model(run.random_calls() or ev.random)
    kept = {op: w for op, w in in_model.items() if run.header.get("random") != "off" or op not in _DROPOUT}
    if kept:
        named = random_summary({f"{site}:{op}": n for op, w in kept.items() for site, n in w.items()})
        how = ("they run as written here (--keep-random)" if run.header.get("random") == "count" else
               "verify switches the dropout family off in every launch, not these")
        out.append(f"random ops that draw different numbers at different world sizes: {named}; {how}")
    if ev.peers_agree and div.step <= 1:
        low = ref.precision in MODES and MODES[ref.precision].low
        split = (f"a batch split under {ref.precision} rounding (each rank rounds its own gradient before the "
                 "average, where one process rounds the whole batch's): raise --factor or compare in float32")
        out.insert(0, "every launch agrees with the others and all leave the one-process run at step 1: what differs "
                      "is one process against N ranks" + (f": {split}" if low and not kept else "") +
                      (": the random ops below" if kept else ""))
    again, share = ev.rerun.get(run.label, (0.0, 0.0))
    if share > 1.0:
        out.append(f"nondeterministic kernels: a second run of this launch differs from its first by {again:.2g} "
                   f"(relative; {share:.2g} times the rounding bound) over the same steps; "
                   "torch.use_deterministic_algorithms(True) or a fixed reduction order makes it repeatable")
    phase = location.phase if location is not None else None
    if not out and phase in _PHASE_CAUSES and location is not None:
        out.append(_PHASE_CAUSES[phase].format(where=location.where, step=location.step))
    grows = _grows(diffs, div)
    if grows:
        out.append(grows)
    if not out:
        said = "not re-run (--locate re-runs it)" if run.label not in ev.rerun else \
            "a second run of this launch repeats its first exactly" if again == 0 else \
            f"a second run of this launch repeats its first within rounding ({share:.2g} of the bound)"
        where = "where it first leaves the envelope is located below" if location is not None else \
            "--locate names the first module and phase that leaves the envelope"
        out.append(f"a computation that differs from one process's beyond rounding: the data, the learning rates, "
                   f"the clipping and the starting weights agree; nondeterminism: {said}; {where}")
    return out

