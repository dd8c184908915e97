"""What ``unidist verify`` says: the comparison as data (``--json``), as a table, and as a picture.

``build`` reads every fingerprint, measures the envelope (envelope.py) and compares each launch with the
one-process run (compare.py); ``explain`` adds the causes (causes.py) and the locations (locate.py) once verify has
made the re-runs they need. The table has one row per launch and one column per sampled step (at most ``COLUMNS``,
the first and the last always among them): each cell is the largest ratio of a difference to its bound at that
step (below 1 agrees); then each figure at its worst step, its bound beside it, and the verdict.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

from unidist.errors import InvalidArgumentError
from unidist.verify import causes as causes_
from unidist.verify import compare, envelope, runs
from unidist.verify.launches import Outcome
from unidist.verify.locate import Location

__all__ = ["COLUMNS", "Comparison", "build", "explain", "lines", "plot"]

COLUMNS = 8


@dataclass
class Comparison:
    """The runs read, the envelope, and the result as plain data (``result``: what ``--json`` prints)."""

    result: dict[str, Any]
    runs: dict[str, runs.Run] = field(default_factory=dict)
    env: envelope.Envelope = field(default_factory=envelope.Envelope)
    diffs: dict[str, list[compare.StepDiff]] = field(default_factory=dict)
    found: dict[str, compare.Divergence] = field(default_factory=dict)


def _sampled(n: int) -> list[int]:
    """Up to COLUMNS step numbers from 1 to n, evenly, the first and last included."""
    if n <= COLUMNS:
        return list(range(1, n + 1))
    return sorted({1 + round(i * (n - 1) / (COLUMNS - 1)) for i in range(COLUMNS)})


def _entry(o: Outcome, read: dict[str, runs.Run]) -> dict[str, Any]:
    entry: dict[str, Any] = {"label": o.launch.label, "argv": o.launch.argv, "env": o.launch.env,
                             "returncode": o.returncode, "seconds": round(o.seconds, 1)}
    if o.returncode != 0 or not o.fingerprint.exists():
        why = "no fingerprint written (did the script call mgr.prepare?)" if o.returncode == 0 else "failed"
        entry.update(status="failed", why=why, tail=o.tail)
        return entry
    try:
        read[o.launch.label] = runs.read(o.fingerprint, o.launch.label)
        entry["status"] = "ran"
    except (InvalidArgumentError, ValueError) as err:
        entry.update(status="failed", why=str(err), tail=o.tail)
    return entry


def build(outcomes: Sequence[Outcome], perturbed: Sequence[Outcome], tolerance: float | None,
          factor: float = envelope.FACTOR) -> Comparison:
    """Every launch (``outcomes[0]`` the one-process run) against the first, within the envelope that the rounding
    re-runs ``perturbed`` measure (``tolerance``: a fixed bound instead)."""
    read: dict[str, runs.Run] = {}
    launches = [_entry(o, read) for o in outcomes]
    rounding = [_entry(o, read) for o in perturbed]
    ref_label = outcomes[0].launch.label if outcomes else None
    ref = read.get(ref_label or "")
    out = Comparison({"verdict": "failed", "reference": ref_label, "compared": max(len(launches) - 1, 0),
                      "launches": launches, "rounding_runs": rounding}, read)
    if ref is None:
        out.result.update(envelope=None, tolerance=tolerance, loss={})
        return out
    made = [read[e["label"]] for e in rounding if e["label"] in read]
    env = out.env = envelope.measure(ref, made, factor, tolerance)
    launches[0].update(status="reference", steps=len(ref.steps), precision=ref.precision, loads=ref.loads())
    for entry in launches[1:]:
        run = read.get(entry["label"])
        if run is None or entry["status"] == "failed":
            continue
        diffs = out.diffs[run.label] = compare.step_diffs(run, ref, env)
        found = compare.compare(run, ref, env)
        entry.update(steps=len(run.steps), diffs=[asdict(d) for d in diffs], worst=compare.worst(diffs),
                     status="diverged" if found else "agrees", loads=run.loads(),
                     noise=sorted({n for d in diffs for n in d.noise}))
        if found is not None:
            out.found[run.label] = found
    statuses = [e["status"] for e in launches]
    failed = "failed" in statuses or len(launches) < 2 or (tolerance is None and bool(perturbed) and not made)
    out.result["verdict"] = "failed" if failed else "diverged" if "diverged" in statuses else "agree"
    calls = ref.random_calls()
    out.result.update(
        tolerance=tolerance, envelope={**env.as_dict(), "labels": [e["label"] for e in rounding]},
        random={"mode": ref.header.get("random", "keep"), "calls": calls, "summary": causes_.random_summary(calls)},
        noise=_noise(out), loss={label: [s.get("loss") for s in r.steps] for label, r in read.items()
                                 if label not in {e["label"] for e in rounding}})
    return out


def _noise(out: Comparison) -> dict[str, dict[str, Any]]:
    """Every parameter the envelope found rounding-driven at some step: the first such step, how far rounding and
    training had moved it by then, and the launches in which it went beyond its bound (where it was not counted)."""
    env = out.env
    said: dict[str, dict[str, Any]] = {}
    for i in range(len(env.params)):
        for name in sorted(env.params[i]):
            if name not in said and env.rounding_driven(name, i):
                said[name] = {"step": i + 1, "envelope": env.envelope("params", i, name),
                              "moved": env.moved[i].get(name) if i < len(env.moved) else None, "beyond": []}
    for label, diffs in out.diffs.items():
        for name in sorted({n for d in diffs for n in d.noise}):
            said[name]["beyond"].append(label)
    return said


def explain(out: Comparison, evidence: causes_.Evidence, locations: Mapping[str, Location]) -> None:
    """The causes of each divergence, and where the re-runs located it, into ``out.result``."""
    ref = out.runs.get(out.result["reference"] or "")
    for entry in out.result["launches"][1:]:
        found = out.found.get(entry["label"])
        if found is None or ref is None:
            continue
        found.causes = causes_.causes(out.runs[entry["label"]], ref, found, out.env, out.diffs[entry["label"]],
                                      evidence, locations.get(entry["label"]))
        entry["divergence"] = asdict(found)
        if entry["label"] in locations:
            entry["location"] = asdict(locations[entry["label"]])
    for entry in out.result["launches"][1:]:
        entry.setdefault("divergence", None)


def _fmt(v: float | None, spec: str = ".1e", missing: str = "-") -> str:
    if v is None:
        return missing
    if math.isinf(v):
        return "inf"
    return "0" if v == 0 else format(v, spec)


def _ratio(v: float | None) -> str:
    return _fmt(v, ".2g", "")


def _figure(w: Mapping[str, Any] | None) -> str:
    if not w:
        return "-"
    return f"{_fmt(w['value'])} ({_fmt(w['bound'])})" + (f" {w['param']}" if w.get("param") else "")


def _head(result: Mapping[str, Any], ref: Mapping[str, Any]) -> list[str]:
    env = result.get("envelope") or {}
    out = [f"unidist verify: {result['compared']} launch{'es' if result['compared'] != 1 else ''} compared with the "
           f"one-process run ({result['reference']}: {ref.get('steps', '?')} steps, precision "
           f"{ref.get('precision', '?')})"]
    if env.get("fixed") is not None:
        out.append(f"bound: a fixed relative difference of {_fmt(env['fixed'])} (--tolerance)")
    elif env:
        out.append(f"bound: {env['factor']:g} x the rounding envelope (how far {env['runs']} one-process runs with "
                   f"their rounding perturbed land from it, per step and figure), at least {_fmt(env['floor'])} each")
    rnd = result.get("random") or {}
    mode = rnd.get("mode", "keep")
    if mode == "off":
        out.append(f"random ops: the dropout family switched off in every launch; seen in the one-process run: "
                   f"{rnd.get('summary')} (--keep-random runs them as written)")
    elif mode == "count":
        out.append(f"random ops: run as written (--keep-random); seen in the one-process run: {rnd.get('summary')}")
    loads = [f"{e['label']} loaded {e['loads'][0]['path']}" for e in result["launches"] if e.get("loads")]
    if loads:
        out.append("checkpoints loaded: " + "; ".join(loads))
    return out


def lines(result: Mapping[str, Any]) -> list[str]:
    """The report's text: what was compared and how, the table, the rounding-driven parameters, what diverged
    (causes, location) or failed, then one verdict line."""
    entries = result["launches"]
    ref = entries[0] if entries else {}
    cols = _sampled(max([e.get("steps", 0) for e in entries] or [0]))
    out = [*_head(result, ref), "", "difference from the one-process run over its bound (the largest of the loss, the "
           "gradient norm and the parameters; below 1 agrees), at step:", ""]
    head = ["launch", *[str(c) for c in cols], "loss (bound)", "grad norm (bound)", "params (bound)", "verdict"]
    out += ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for e in entries:
        by_step = {d["step"]: d for d in e.get("diffs", [])}
        cells = [_ratio(by_step[c]["ratio"]) if c in by_step else "" for c in cols]
        worst = e.get("worst") or {}
        verdict = e["status"]
        if e["status"] == "diverged" and e.get("divergence"):
            d = e["divergence"]
            verdict = f"diverged at step {d['step']} ({d['quantity']})" if d["step"] else \
                f"diverged before step 1 ({d['quantity']})"
        out.append("| " + " | ".join([e["label"], *cells, _figure(worst.get("loss")), _figure(worst.get("grad_norm")),
                                      _figure(worst.get("params")), verdict]) + " |")
    noise = result.get("noise") or {}
    if noise:
        out += ["", "rounding-driven parameters (rounding alone moves them at least a tenth as far as training does, "
                    "so they are compared but cannot make a launch diverge by themselves):"]
        out += [f"  - {n}: from step {v['step']}, rounding moves it {_fmt(v['envelope'])}, training moved it "
                f"{_fmt(v['moved'])}" + (f"; beyond its bound in {', '.join(v['beyond'])}" if v["beyond"] else "")
                for n, v in sorted(noise.items())]
    for e in entries:
        if e["status"] == "diverged" and e.get("divergence"):
            d = e["divergence"]
            what = d["quantity"] + (f" (most: {d['param']})" if d.get("param") else "")
            value = f", {_fmt(d['value'])} against a bound of {_fmt(d['bound'])}" \
                if d.get("value") is not None and d.get("bound") is not None and \
                d["quantity"] not in ("rows", "steps", "lr", "data", "skipped") else ""
            when = f"at step {d['step']}" if d["step"] else "before the first step"
            out += ["", f"{e['label']}: leaves the one-process run {when}: {what}{value}"]
            out += [f"  - likely: {c}" for c in d["causes"]]
            if e.get("location"):
                out.append(f"  - located: {e['location']['said']}")
        elif e["status"] == "failed":
            out += ["", f"{e['label']}: {e.get('why')} (exit {e['returncode']}): {' '.join(e['argv'])}"]
            out += ["  " + line for line in (e.get("tail") or "").splitlines()]
    for e in result.get("rounding_runs") or []:
        if e["status"] == "failed":
            out += ["", f"{e['label']} (the one-process run with its rounding perturbed): {e.get('why')} (exit "
                        f"{e['returncode']})"]
            out += ["  " + line for line in (e.get("tail") or "").splitlines()]
    verdict = {"agree": "every launch trains the same as one process",
               "diverged": "a launch trains differently (above)",
               "failed": "a launch failed, or nothing could be compared (above)"}[result["verdict"]]
    out += ["", f"verdict: {verdict}"]
    if result.get("plot"):
        out.append(f"loss curves: {result['plot']}")
    return out


def plot(result: Mapping[str, Any], path: str) -> str | None:
    """The launches' loss curves overlaid, written to ``path``; None where matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    fig, ax = plt.subplots(figsize=(7, 4))
    for i, (label, losses) in enumerate(result["loss"].items()):
        xs = [k + 1 for k, v in enumerate(losses) if v is not None]
        ys = [v for v in losses if v is not None]
        ax.plot(xs, ys, label=label, linewidth=2.5 if i == 0 else 1.2, linestyle="-" if i == 0 else "--")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("loss (mean over ranks)")
    ax.set_title(f"unidist verify: {result['verdict']}")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
