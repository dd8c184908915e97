"""What ``unidist verify`` says: the comparison as data (``--json``), as a table, and as a picture.

The table has one row per launch and one column per sampled step (at most ``COLUMNS``, the first and the last
always among them): each cell is the largest relative difference of the loss, the gradient norm and the
parameters at that step against the one-process run; then the worst of each quantity over all steps, and the
verdict. Below it, for a launch that diverged, where and why; for one that failed, its output's tail.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict
from typing import Any

from unidist.errors import InvalidArgumentError
from unidist.verify import compare
from unidist.verify.launches import Outcome

__all__ = ["COLUMNS", "build", "lines", "plot"]

COLUMNS = 8


def _sampled(n: int) -> list[int]:
    """Up to COLUMNS step numbers from 1 to n, evenly, the first and last included."""
    if n <= COLUMNS:
        return list(range(1, n + 1))
    return sorted({1 + round(i * (n - 1) / (COLUMNS - 1)) for i in range(COLUMNS)})


def build(outcomes: Sequence[Outcome], tolerance: float | None) -> dict[str, Any]:
    """The comparison of every launch with the first (the one-process run), as plain data."""
    launches: list[dict[str, Any]] = []
    runs: dict[str, compare.Run] = {}
    for o in outcomes:
        entry: dict[str, Any] = {"label": o.launch.label, "argv": o.launch.argv, "env": o.launch.env,
                                 "returncode": o.returncode, "seconds": round(o.seconds, 1)}
        if o.returncode != 0 or not o.fingerprint.exists():
            why = "no fingerprint written (did the script call mgr.prepare?)" if o.returncode == 0 else "failed"
            entry.update(status="failed", why=why, tail=o.tail)
        else:
            try:
                runs[o.launch.label] = compare.read(o.fingerprint, o.launch.label)
                entry["status"] = "ran"
            except (InvalidArgumentError, ValueError) as err:
                entry.update(status="failed", why=str(err), tail=o.tail)
        launches.append(entry)
    ref_label = outcomes[0].launch.label if outcomes else None
    ref = runs.get(ref_label or "")
    tol = compare.tolerance(ref, tolerance) if ref is not None else tolerance
    for entry in launches[1:]:
        run = runs.get(entry["label"])
        if run is None or ref is None or entry["status"] == "failed":
            continue
        diffs = compare.step_diffs(run, ref)
        entry["steps"] = len(run.steps)
        entry["diffs"] = [asdict(d) for d in diffs]
        entry["worst"] = compare.worst(diffs)
        found = compare.compare(run, ref, tol or 0.0)
        entry["status"] = "diverged" if found else "agrees"
        entry["divergence"] = asdict(found) if found else None
    if ref is not None:
        launches[0].update(status="reference", steps=len(ref.steps), precision=ref.header.get("precision"))
    statuses = [e["status"] for e in launches]
    if ref is None or "failed" in statuses or len(launches) < 2:
        verdict = "failed"
    else:
        verdict = "diverged" if "diverged" in statuses else "agree"
    curves = {label: [s.get("loss") for s in r.steps] for label, r in runs.items()}
    return {"verdict": verdict, "tolerance": tol, "reference": ref_label, "launches": launches, "loss": curves}


def _fmt(v: float | None) -> str:
    if v is None:
        return "-"
    if math.isinf(v):
        return "inf"
    return "0" if v == 0 else f"{v:.1e}"


def _cell(d: dict[str, Any]) -> float | None:
    vals = [v for v in (d["loss"], d["grad_norm"], d["params"]) if v is not None]
    return max(vals) if vals else None


def lines(result: dict[str, Any]) -> list[str]:
    """The report's text: the table, then what diverged or failed, then one verdict line."""
    entries = result["launches"]
    ref = entries[0] if entries else {}
    n = max([e.get("steps", 0) for e in entries] or [0])
    cols = _sampled(n)
    out = [f"unidist verify: {len(entries)} launches against {result['reference']} ({ref.get('steps', '?')} steps, "
           f"precision {ref.get('precision', '?')}, tolerance {_fmt(result['tolerance'])})",
           "", "largest relative difference from the one-process run (loss, gradient norm, parameters) at step:", ""]
    head = ["launch", *[str(c) for c in cols], "loss", "grad norm", "params", "verdict"]
    out.append("| " + " | ".join(head) + " |")
    out.append("|" + "---|" * len(head))
    for e in entries:
        by_step = {d["step"]: d for d in e.get("diffs", [])}
        cells = [_fmt(_cell(by_step[c])) if c in by_step else "" for c in cols]
        worst = e.get("worst") or {}
        verdict = e["status"]
        if e["status"] == "diverged":
            verdict = f"diverged at step {e['divergence']['step']} ({e['divergence']['quantity']})"
        out.append("| " + " | ".join([e["label"], *cells, _fmt(worst.get("loss")), _fmt(worst.get("grad_norm")),
                                      _fmt(worst.get("params")), verdict]) + " |")
    for e in entries:
        if e["status"] == "diverged":
            d = e["divergence"]
            what = d["quantity"] + (f" (most: {d['param']})" if d.get("param") else "")
            value = f", {_fmt(d['value'])}" if d.get("value") is not None and d["quantity"] not in ("rows", "steps") \
                else ""
            out += ["", f"{e['label']}: leaves the one-process run at step {d['step']}: {what}{value}"]
            out += [f"  - likely: {c}" for c in d["causes"]]
        elif e["status"] == "failed":
            out += ["", f"{e['label']}: {e.get('why')} (exit {e['returncode']}): {' '.join(e['argv'])}"]
            out += ["  " + line for line in (e.get("tail") or "").splitlines()]
    verdict = {"agree": "every launch trains the same as one process",
               "diverged": "a launch trains differently (above)",
               "failed": "a launch failed, or nothing could be compared (above)"}[result["verdict"]]
    out += ["", f"verdict: {verdict}"]
    if result.get("plot"):
        out.append(f"loss curves: {result['plot']}")
    return out


def plot(result: dict[str, Any], path: str) -> str | None:
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
