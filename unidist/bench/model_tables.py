"""The markdown tables of ``model``: fitted parameters, prediction against measurement, worst errors, and the
projection. Kept apart from ``model.py`` so that the fitting and the formatting can each be read alone;
every table is what ``model`` prints and what benchmarks/MODEL.md quotes.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from unidist.bench.costmodel import Params
from unidist.bench.output import Column, human_bytes, markdown

__all__ = ["checks_md", "nominal", "params_md", "projection_md", "runs_md", "summary_md"]

TARGET = 0.25
BUCKET = 25 << 20
_SHORT = {"ring": "ring", "rabenseifner": "rab", "recursive_doubling": "rd", "recursive_halving": "rh",
          "binomial": "binom", "scatter_allgather": "sc+ag", "pairwise": "pair", "bruck": "bruck"}


def _s(v: Any) -> str:
    return str(v)


def _ps(seconds_per_byte: float) -> str:
    """Seconds per byte as ps/B and the rate it means."""
    if seconds_per_byte <= 0:
        return "0"
    return f"{seconds_per_byte * 1e12:.1f} ps/B ({1e-9 / seconds_per_byte:.2f} GB/s)"


def params_md(params: dict[str, Params], kinds: dict[str, str | None]) -> str:
    """One row per engine and collective: alpha (us), beta up to and above the cache split; gamma below. An engine
    whose algorithms no record documents (modelled with ``--policy min``) says ``unknown``."""
    rows = []
    for name, p in params.items():
        for op, link in p.links.items():
            one = math.isinf(link.split)
            rows.append({"engine": name, "kind": kinds[name] or "unknown", "op": op, "alpha": f"{link.alpha * 1e6:.2f}",
                         "beta": _ps(link.beta), "split": "-" if one else human_bytes(link.split),
                         "alpha_big": "-" if one else f"{link.alpha_big * 1e6:.2f}",
                         "beta_big": "-" if one else _ps(link.beta_big)})
    cols: list[Column] = [("engine", "engine", _s), ("kind", "algorithms of", _s), ("op", "op", _s),
                          ("alpha", "alpha us", _s), ("beta", "beta", _s), ("split", "above", _s),
                          ("alpha_big", "alpha us", _s), ("beta_big", "beta", _s)]
    any_p = next(iter(params.values()))
    split = "" if math.isinf(any_p.gamma_cache) else (f" up to {human_bytes(any_p.gamma_cache)}, "
                                                      f"{_ps(any_p.gamma_mem)} above")
    return markdown(cols, rows) + f"\n\ngamma (every engine; a local float32 add): {_ps(any_p.gamma)}{split}."


def nominal(nbytes: float) -> int:
    """The size a row was asked for: allgather, reduce_scatter and alltoall round to whole float32 chunks
    per rank (asked 8 B, 1 KiB: 12 B and 1020 B on 3 ranks), so rows of one size line up across rank counts."""
    return 8 if nbytes <= 16 else 1 << round(math.log2(nbytes))


def checks_md(rows: list[dict[str, Any]]) -> str:
    """Measured / predicted us (error) per engine, op and (nominal) size, one column per rank count."""
    ranks = sorted({r["ranks"] for r in rows})
    table: dict[tuple[str, str, int], dict[str, Any]] = {}
    for r in rows:
        size = nominal(r["bytes"])
        cell = table.setdefault((r["engine"], r["op"], size),
                                {"engine": r["engine"], "op": r["op"], "size": human_bytes(size), "algs": []})
        cell[str(r["ranks"])] = f"{r['measured_us']:.1f} / {r['predicted_us']:.1f} ({r['error']:+.0%})" + (
            "" if abs(r["error"]) <= TARGET else " **x**")
        cell["algs"].append(_SHORT.get(r["algorithm"], r["algorithm"]))
    for cell in table.values():
        cell["alg"] = "/".join(dict.fromkeys(cell.pop("algs")))
    cols: list[Column] = [("engine", "engine", _s), ("op", "op", _s), ("size", "size", _s),
                          ("alg", "algorithm", _s), *((str(p), f"{p} ranks: measured / predicted", _s) for p in ranks)]
    return markdown(cols, table.values()) + (
        "\n\n**x**: off by more than 25%. Sizes are nominal (at 3 ranks allgather, reduce_scatter and alltoall "
        "move whole float32 chunks per rank: 12 B, 1020 B, ...; the model uses the exact bytes). Algorithms: rd "
        "recursive doubling, rab Rabenseifner, rh recursive halving, binom binomial tree, pair pairwise exchange.")


def summary_md(rows: list[dict[str, Any]]) -> str:
    """Per engine and rank count: cells within 25%, median and worst absolute error (which cell)."""
    out = []
    for engine in dict.fromkeys(r["engine"] for r in rows):
        for p in sorted({r["ranks"] for r in rows if r["engine"] == engine}):
            mine = [r for r in rows if r["engine"] == engine and r["ranks"] == p]
            worst = max(mine, key=lambda r: abs(r["error"]))
            ok = sum(abs(r["error"]) <= TARGET for r in mine)
            out.append({"engine": engine, "ranks": p, "ok": f"{ok} of {len(mine)}",
                        "median": f"{statistics.median(abs(r['error']) for r in mine):.0%}",
                        "worst": f"{worst['error']:+.0%} ({worst['op']}, {human_bytes(nominal(worst['bytes']))})"})
    return markdown([("engine", "engine", _s), ("ranks", "ranks", _s), ("ok", "within 25%", _s),
                     ("median", "median abs. error", _s), ("worst", "worst error", _s)], out)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3g}" if seconds < 1 else f"{seconds * 1e3:,.0f}"


def projection_md(proj: dict[str, dict[str, dict[int, dict[str, float]]]], nets: dict[str, Params]) -> str:
    """One table per network: rows are rank counts, columns each workload's time per algorithm and the best."""
    parts = []
    for net, per_workload in proj.items():
        prm = nets[net]
        workloads = list(per_workload)
        ranks = sorted({p for per in per_workload.values() for p in per})
        rows = []
        for p in ranks:
            row: dict[str, Any] = {"ranks": p}
            for wl in workloads:
                times = per_workload[wl][p]
                best = min(times, key=lambda a: times[a])
                row.update({f"{wl}:{a}": _ms(t) for a, t in times.items()})
                row[f"{wl}:best"] = f"{_ms(times[best])} ({_SHORT.get(best, best)})"
            rows.append(row)
        algs = list(next(iter(next(iter(per_workload.values())).values())))
        cols: list[Column] = [("ranks", "ranks", _s)]
        for wl in workloads:
            cols += [(f"{wl}:{a}", f"{wl} {_SHORT.get(a, a)}", _s) for a in algs]
            cols.append((f"{wl}:best", f"{wl} best", _s))
        link = prm.links["allreduce"]
        head = (f"**{net}**: at 25 MiB alpha {link.alpha_at(BUCKET) * 1e6:.2f} us, beta {_ps(link.beta_at(BUCKET))}, "
                f"gamma {_ps(prm.gamma_mem)}")
        parts.append(head + "\n\n" + markdown(cols, rows))
    return "\n\n".join(parts)


def runs_md(runs: list[dict[str, Any]]) -> str:
    """Each launch of ``--measure``: when, how long, the load around it, and whether it started quiet."""
    return markdown([("run", "run", _s), ("date", "ended (UTC)", _s), ("seconds", "s", lambda v: f"{v:.0f}"),
                     ("load_before", "load before", lambda v: f"{v:.2f}"),
                     ("load_after", "load after", lambda v: f"{v:.2f}"),
                     ("quiet_at_start", "idle at start", lambda v: "yes" if v else "no"), ("exit", "exit", _s)], runs)
