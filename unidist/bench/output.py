"""What the benchmarks write: markdown tables on rank 0, JSON files, and the bandwidth plot.

Tables are markdown so that what a run prints can be pasted into benchmarks/RESULTS.md unchanged (the
``report`` command does exactly that from the JSON files). A JSON file is ``{"meta": {...}, "rows": [...]}``:
``meta`` says where and how the run was made (backend, launcher, ranks, versions, host, command line, and the
machine: CPU, THP, a measured copy bandwidth), and
every row repeats ``bench``, ``backend``, ``launcher`` and ``ranks`` so rows from several files can be
mixed. matplotlib is imported only to plot.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import platform
import sys
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from unidist.bench.machine import line as machine_line
from unidist.bench.machine import version as _version

if TYPE_CHECKING:
    from unidist.managers.base import Manager

__all__ = ["Column", "human_bytes", "label", "load", "machine_line", "markdown", "meta", "plot_bandwidth",
           "write_json"]

Column = tuple[str, str, Callable[[Any], str]]  # (row key, header, formatter of the value)


def meta(mgr: Manager) -> dict[str, Any]:
    """Where and how this run was made: enough to tell two JSON files apart and to reproduce them, and
    ``machine`` (``unidist.bench.machine``: CPU, THP, measured copy bandwidth, ...) to tell two machines
    apart. The bandwidth is measured on rank 0 only, the rank that writes the JSON (why: machine.py)."""
    import unidist
    from unidist.bench.machine import machine

    launch = unidist.detect(os.environ)
    return {
        "backend": mgr.backend, "launcher": launch.launcher, "ranks": mgr.size,
        "unidist": unidist.__version__,
        **{pkg: _version(pkg) for record in unidist.registry.records() for pkg in record.requires},
        "python": platform.python_version(), "host": platform.node(), "cpus": os.cpu_count(),
        "omp_threads": os.environ.get("OMP_NUM_THREADS", ""),
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "argv": sys.argv,
        "machine": machine(bandwidth=bool(getattr(mgr, "is_main", True))),
    }


def label(run_meta: dict[str, Any]) -> str:
    """``backend (launcher)``: horovod under horovodrun and under mpiexec are different lines."""
    return str(run_meta.get("label") or f"{run_meta['backend']} ({run_meta['launcher']})")


def human_bytes(n: float) -> str:
    """A byte count as a label that is exact: the largest binary unit in which it is a number of at most three
    decimals (``8 B``, ``1.5 KiB``, ``2 MiB``), else all its bytes (``4,194,300 B``: 4 MiB of float32 cut to
    whole chunks for 3 ranks, which ``4 MiB`` would misstate). A fractional count (a fitted size) keeps four
    significant digits."""
    if not float(n).is_integer():
        for unit in ("B", "KiB", "MiB", "GiB"):
            if abs(n) < 1024 or unit == "GiB":
                return f"{n:.4g} {unit}"
            n /= 1024
    whole = int(n)
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(whole) >= size and round(whole / size, 3) * size == whole:
            return f"{whole / size:g} {unit}"
    return f"{whole:,} B"


def fmt(digits: int) -> Callable[[Any], str]:
    """A formatter with ``digits`` decimals that prints missing or non-finite values as ``-``."""
    def show(value: Any) -> str:
        if value is None or (isinstance(value, float) and not math.isfinite(value)):
            return "-"
        return f"{value:.{digits}f}" if isinstance(value, float) else str(value)
    return show


def markdown(columns: Sequence[Column], rows: Iterable[dict[str, Any]]) -> str:
    """A markdown table of the given columns (a missing key prints ``-``)."""
    lines = ["| " + " | ".join(header for _, header, _ in columns) + " |",
             "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join("-" if row.get(key) is None else show(row[key]) for key, _, show in columns)
                     + " |")
    return "\n".join(lines)


def write_json(path: Path, run_meta: dict[str, Any], rows: list[dict[str, Any]]) -> None:
    """``{"meta", "rows"}``, every row carrying the run's bench-independent keys; written atomically (a
    half-written file would break ``report``)."""
    common = {k: run_meta[k] for k in ("backend", "launcher", "ranks")}
    doc = {"meta": run_meta, "rows": [{**common, **row} for row in rows]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def load(paths: Iterable[Path]) -> list[dict[str, Any]]:
    """The JSON documents, in the order given. A file that is missing or not a benchmark's JSON ends the
    command with a line saying which and how to make one, not a traceback."""
    docs = []
    for p in map(Path, paths):
        if not p.is_file():
            raise SystemExit(f"{p}: no such results file; a benchmark writes one with --json, e.g. "
                             f"`unidist bench collectives -n 2 --backend mpi -- --json {p}`")
        try:
            doc = json.loads(p.read_text())
        except ValueError as exc:
            raise SystemExit(f"{p}: not a benchmark's JSON ({exc})") from None
        if not isinstance(doc, dict) or "rows" not in doc:
            raise SystemExit(f"{p}: not a benchmark's JSON (no 'rows'); --json FILE of a benchmark writes one")
        docs.append(doc)
    return docs


def plot_bandwidth(docs: Sequence[dict[str, Any]], out: Path, *, metric: str = "busbw_GBps") -> None:
    """Bus bandwidth against message size, one panel per collective, one line per run (backend and
    launcher); the raw engine's call dashed in the same colour where it was measured. Log axes: sizes span
    eight decades and bandwidths three."""
    import matplotlib  # type: ignore[import-not-found, unused-ignore]

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # type: ignore[import-not-found, unused-ignore]

    from unidist.bench.engines import OPS

    rows = [(label(d["meta"]), r) for d in docs for r in d["rows"] if r.get("bench") == "collectives"]
    ops = [op for op in OPS if any(r["op"] == op for _, r in rows)]
    if not ops:
        raise SystemExit("plot: no collectives rows in the given JSON files")
    cols = min(3, len(ops))
    nrows = math.ceil(len(ops) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.8 * nrows), squeeze=False)
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    labels = list(dict.fromkeys(lab for lab, _ in rows))
    for ax, op in zip(axes.flat, ops, strict=False):
        for i, lab in enumerate(labels):
            mine = sorted((r for lb, r in rows if lb == lab and r["op"] == op), key=lambda r: r["bytes"])
            colour = colours[i % len(colours)]
            for key, style, suffix in ((metric, "-", ""), ("raw_" + metric, "--", " raw")):
                pts = [(r["bytes"], r[key]) for r in mine if r.get(key) and r[key] > 0]
                if pts:
                    ax.plot(*zip(*pts, strict=True), style, color=colour, marker=".", label=lab + suffix)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_title(op)
        ax.set_xlabel("bytes")
        ax.set_ylabel(metric.replace("_GBps", " GB/s"))
        ax.grid(True, which="both", alpha=0.3)
    for ax in list(axes.flat)[len(ops):]:
        ax.set_visible(False)
    handles, names = axes.flat[0].get_legend_handles_labels()
    fig.legend(handles, names, loc="lower center", ncol=min(4, max(1, len(names))), fontsize="small")
    ranks = sorted({r["ranks"] for _, r in rows})
    fig.suptitle(f"unidist collectives ({'/'.join(map(str, ranks))} ranks; dashed: the engine's own call)")
    fig.tight_layout(rect=(0, 0.06 + 0.02 * math.ceil(len(names) / 4), 1, 0.97))
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110)
    plt.close(fig)
