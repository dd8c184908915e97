"""Which figures moved beyond the noise between two result sets (``report``'s "moved beyond noise" table).

``report`` reads the committed ``results/*.json`` before its runs overwrite them and compares each new file
with the old one of the same name (the run: mpi, torch, ...); ``report --render-only --against DIR`` compares
``DIR``'s files with the current ones without running anything (two machines, two commits).

Rows match on their run, bench, ranks and identity (collectives: op, bytes, dtype; gradsync: model, scale,
method; train: impl, model, scale, batch per rank, image size). The compared figure is each bench's main one,
a time, so new/old > 1 is slower: the collective's time per call (``time_us``), gradsync's backward + sync
per step (``unit_ms``), train's step time (``step_ms``).

The noise: the rows record the median of interleaved rounds but not the rounds' spread (``timing.slowest``
keeps the medians only), so the threshold is a fixed ``NOISE`` = 10%: a figure moved when new/old > 1.10 or
< 1/1.10. Where a row carries ``spread``, the relative spread of its figure over the rounds ((max - min) /
median; a bench may add it), the threshold for that row is the largest of 10% and the two rows' spreads, so
a figure whose own rounds disagree by more is not flagged for that.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from unidist.bench.output import human_bytes, load, markdown

__all__ = ["IDENTITY", "MAIN", "NOISE", "compare", "load_dir", "render"]

NOISE = 0.10
IDENTITY: dict[str, tuple[str, ...]] = {
    "collectives": ("op", "bytes", "dtype"),
    "gradsync": ("model", "scale", "method"),
    "train": ("impl", "model", "scale", "batch_per_rank", "image_size"),
}
MAIN = {"collectives": "time_us", "gradsync": "unit_ms", "train": "step_ms"}
RAW = {"collectives": "raw_time_us"}  # the engine's own call beside it: did the machine move, or unidist?
MACHINE_KEYS = ("cpu_model", "cpus_usable", "memory_GiB", "thp", "kernel")


def load_dir(where: Path) -> dict[str, dict[str, Any]]:
    """The result set in ``where`` (its ``*.json``, or those of ``where/results``), by run name (file stem)."""
    folder = where / "results" if (where / "results").is_dir() else where
    files = sorted(folder.glob("*.json"))
    return {p.stem: doc for p, doc in zip(files, load(files), strict=True)}


def _key(row: Mapping[str, Any]) -> tuple[Any, ...] | None:
    ident = IDENTITY.get(str(row.get("bench")))
    return None if ident is None else (row["bench"], row.get("ranks"), *(row.get(k) for k in ident))


def _spread(row: Mapping[str, Any]) -> float:
    value = row.get("spread")
    return float(value) if isinstance(value, (int, float)) and math.isfinite(value) else 0.0


def _figure(row: Mapping[str, Any], key: str | None) -> float | None:
    value = row.get(key) if key else None
    return float(value) if isinstance(value, (int, float)) and value > 0 and math.isfinite(value) else None


def compare(old: Mapping[str, dict[str, Any]], new: Mapping[str, dict[str, Any]], *, noise: float = NOISE
            ) -> list[dict[str, Any]]:
    """One entry per matching row of the runs in both sets (skipping a run whose file is unchanged: it did
    not run again): its old and new main figure, ``ratio`` new/old, the ``noise`` threshold it was held to,
    and ``moved`` (``slower``, ``faster`` or empty)."""
    out: list[dict[str, Any]] = []
    for run, new_doc in new.items():
        old_doc = old.get(run)
        if old_doc is None or old_doc == new_doc:
            continue
        before = {k: r for r in old_doc["rows"] if (k := _key(r)) is not None}
        for row in new_doc["rows"]:
            key = _key(row)
            prev = before.get(key) if key is not None else None
            if prev is None:
                continue
            main = MAIN[row["bench"]]
            a, b = _figure(prev, main), _figure(row, main)
            if a is None or b is None:
                continue
            ratio = b / a
            limit = max(noise, _spread(prev), _spread(row))
            raw_a, raw_b = _figure(prev, RAW.get(row["bench"])), _figure(row, RAW.get(row["bench"]))
            out.append({
                "run": run, "bench": row["bench"], "what": row.get("op") or row.get("method") or row.get("impl"),
                "size": human_bytes(row["bytes"]) if row["bench"] == "collectives" else row.get("model"),
                "figure": main, "old": a, "new": b, "ratio": ratio, "noise": limit,
                "raw_ratio": raw_b / raw_a if raw_a and raw_b else None,
                "moved": "slower" if ratio > 1 + limit else "faster" if ratio < 1 / (1 + limit) else ""})
    return out


def _machine_diff(old: Mapping[str, Any], new: Mapping[str, Any]) -> str:
    """What differs between the two runs' machines (``not recorded`` when either has none)."""
    a, b = old.get("machine"), new.get("machine")
    if not a or not b:
        return "not recorded"
    keys = [k for k in MACHINE_KEYS if a.get(k) != b.get(k)]
    keys += [f"{k} {a['versions'].get(k)} -> {v}" for k, v in b.get("versions", {}).items()
             if a.get("versions", {}).get(k, v) != v]
    if old.get("host") != new.get("host"):
        keys.insert(0, "host")
    return ", ".join(keys) or "same"


def _copy(doc: Mapping[str, Any]) -> str:
    m = doc["meta"].get("machine") or {}
    return f"{m['copy_GBps']:.1f}" if m.get("copy_GBps") else "not recorded"


def _g(value: float | None) -> str:
    """Three significant digits, without an exponent up to millions (times in us reach thousands)."""
    if value is None:
        return "-"
    return f"{value:.0f}" if abs(value) >= 1000 else f"{value:.3g}"


def render(entries: Iterable[dict[str, Any]], old: Mapping[str, dict[str, Any]], new: Mapping[str, dict[str, Any]]
           ) -> str:
    """Per run: how many figures matched, their median new/old, how many moved and what differs between the
    machines; then the figures that moved beyond the noise, the largest moves first."""
    rows = list(entries)
    runs = list(dict.fromkeys(e["run"] for e in rows))
    if not runs:
        return "moved beyond noise: no run in both result sets to compare"
    summary = []
    for run in runs:
        mine = [e for e in rows if e["run"] == run]
        summary.append({
            "run": run, "matched": len(mine), "median": statistics.median(e["ratio"] for e in mine),
            "slower": sum(e["moved"] == "slower" for e in mine), "faster": sum(e["moved"] == "faster" for e in mine),
            "copy": f"{_copy(old[run])} -> {_copy(new[run])}",
            "machine": _machine_diff(old[run]["meta"], new[run]["meta"])})
    moved = sorted((e for e in rows if e["moved"]), key=lambda e: (runs.index(e["run"]), -abs(math.log(e["ratio"]))))
    limits = sorted({e["noise"] for e in rows})
    noise = f"{limits[0]:.0%}" if len(limits) == 1 else f"{limits[0]:.0%} to {limits[-1]:.0%}"
    out = [f"### Moved beyond noise (new / old of each bench's main time; noise {noise}; > 1 is slower)", "",
           markdown([("run", "run", str), ("matched", "figures", str), ("median", "median new/old", _g),
                     ("slower", "slower", str), ("faster", "faster", str), ("copy", "copy GB/s old -> new", str),
                     ("machine", "machine differs in", str)], summary), ""]
    if moved:
        out += [markdown([("run", "run", str), ("bench", "bench", str), ("what", "op / method", str),
                          ("size", "size / model", str), ("figure", "figure", str), ("old", "old", _g),
                          ("new", "new", _g), ("ratio", "new/old", lambda v: f"{v:.2f}"),
                          ("raw_ratio", "raw engine new/old", lambda v: f"{v:.2f}"), ("moved", "moved", str)],
                         moved), ""]
    else:
        out += ["No figure moved beyond the noise.", ""]
    return "\n".join(out).rstrip() + "\n"
