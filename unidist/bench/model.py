"""``model``: a cost model of the collectives, fitted to this machine, checked, and projected to 1024 ranks.

    python -m unidist.bench model --measure --out-dir benchmarks/model     # measure 2, 3, 4 ranks, then model
    python -m unidist.bench model benchmarks/model/*.json                  # model from existing JSON files
    unidist bench model -- benchmarks/model/*.json

Reads ``collectives --json`` files (any launcher, any rank count). Per engine (a run's label: backend and
launcher) it fits the Hockney/Thakur-Rabenseifner-Gropp parameters of ``costmodel.py`` by non-negative least
squares on relative error, on the ``--fit-ranks`` measurements (default: 2 ranks only, so the 3- and 4-rank
rows test how the formulas scale rather than being fitted). It prints markdown: the fitted parameters, the
prediction beside every measurement with its error (the target is 25%), the worst error per engine and rank
count, and the projected gradient-sync time of ResNet-50 and GPT-2 (fp32, 25 MiB fused buckets) for 8 to
1024 ranks on stated networks and on this machine's own fitted values. ``--column raw`` (default) models the
engine's own calls, whose algorithms are documented; ``--column unidist`` models unidist's calls (on mpi,
large allreduces are chunked to stay in cache: not an MPICH algorithm; the second regime absorbs it).
"""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path
from typing import Any

from unidist import registry
from unidist.bench import costmodel
from unidist.bench.costmodel import Link, Params
from unidist.errors import InvalidArgumentError

__all__ = ["NETWORKS", "WORKLOADS", "add_arguments", "main", "project", "samples"]

BUCKET = 25 << 20
WORKLOADS = {"ResNet-50": 25_557_032 * 4, "GPT-2": 124_439_808 * 4}  # fp32 gradient bytes (real_models.py's shapes)
NETWORKS = {  # name: (alpha s, beta s/B); gamma is this machine's (a CPU adds the buckets)
    "InfiniBand HDR-like (25 GB/s per link, 5 us)": (5e-6, 1 / 25e9),
    "10 Gb/s Ethernet (1.25 GB/s, 50 us)": (50e-6, 1 / 1.25e9),
}
PROJECT_RANKS = tuple(2 ** k for k in range(3, 11))
ALLREDUCE_ALGS = ("ring", "rabenseifner", "recursive_doubling")


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("model", help="fit a latency/bandwidth cost model, check it, project to 1024 ranks",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="*", type=Path, help="collectives --json files (with --measure: none)")
    p.add_argument("--column", choices=("raw", "unidist"), default="raw",
                   help="model the engine's own calls (raw, default) or unidist's")
    p.add_argument("--fit-ranks", default="2", help="rank counts whose rows the fit uses (default 2; 'all')")
    p.add_argument("--policy", choices=("known", "min"), default="known",
                   help="algorithm per size: the one the engine is documented to run (known), or the fastest")
    p.add_argument("--cores", type=int, help="cores the ranks shared (default: as the runs recorded; 0: model "
                                             "one core per rank)")
    p.add_argument("--reference", help="the engine whose gamma and fitted values the projection uses "
                                       "(default: the one whose backend comes first in the registry's order "
                                       "of preference: mpi's, among unidist's)")
    p.add_argument("--json", type=Path, help="also write parameters, predictions and projections here")
    p.add_argument("--measure", action="store_true", help="first run the measurements (model_measure.py)")
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks/model"), help="--measure writes JSON here")
    p.add_argument("--runs", default="mpi,torch", help="--measure: report's run names, comma-separated")
    p.add_argument("--ranks", default="2,3,4", help="--measure: rank counts")
    p.add_argument("--bin", action="append", default=[], metavar="ENGINE=DIR", help="--measure: as report --bin")
    p.add_argument("--timeout", type=float, default=900, help="--measure: seconds per launch")
    p.add_argument("--wait-quiet", type=float, default=120,
                   help="--measure: seconds to wait for an idle machine before each launch (default 120)")
    p.epilog = "With --measure, options after -- go to every collectives run (-- --budget 0.2 --rounds 7)."


Samples = dict[str, list[costmodel.Sample]]


def gamma_of(docs: list[dict[str, Any]]) -> tuple[Params, str]:
    """The reduction cost: from the ``gamma`` rows among ``docs`` (``--measure`` writes gamma.json), else
    measured here and now (said in the returned note, since the JSON files may come from another machine)."""
    from unidist.bench.model_measure import gamma_params, local_gamma

    rows = [r for d in docs for r in d["rows"] if r.get("bench") == "gamma"]
    note = "from gamma.json"
    if not rows:
        rows, note = local_gamma(), "measured now on this host (no gamma.json among the files)"
    g, g_mem, split = gamma_params(rows)
    return Params(gamma=g, gamma_mem=g_mem, gamma_cache=split), note


def samples(docs: list[dict[str, Any]], column: str = "raw") -> tuple[Samples, dict[str, str | None]]:
    """Measurements per engine label (op, ranks, bytes, seconds) from ``collectives`` rows, and each label's
    engine kind (``costmodel.engine_kind``: None where its backend's record documents none). ``column``: "raw"
    (the engine's call) or "unidist". Files that are not measurements (this command's own ``--json``,
    ``gamma.json``) are passed over, so a directory's ``*.json`` can be given."""
    from unidist.bench.output import label

    key = "raw_time_us" if column == "raw" else "time_us"
    out: Samples = {}
    kinds: dict[str, str | None] = {}
    for doc in docs:
        if "meta" not in doc or "backend" not in doc["meta"]:
            continue
        name = label({k: v for k, v in doc["meta"].items() if k != "label"})
        kinds[name] = costmodel.engine_kind(doc["meta"]["backend"], doc["meta"]["launcher"])
        for r in doc["rows"]:
            if r.get("bench") == "collectives" and r.get(key) and r["op"] in costmodel.ALGORITHMS:
                out.setdefault(name, []).append((r["op"], int(r["ranks"]), float(r["bytes"]), r[key] * 1e-6))
    if not out:
        raise InvalidArgumentError(f"no collectives rows with {key} in the given files: write them with "
                                   "`python -m unidist.bench collectives --compare --json FILE` (or use --measure)")
    return out, kinds


def _fit_ranks(text: str, data: Samples) -> set[int]:
    if text.strip() == "all":
        return {s[1] for rows in data.values() for s in rows}
    try:
        return {int(r) for r in text.split(",") if r.strip()}
    except ValueError:
        raise InvalidArgumentError(f"--fit-ranks {text!r}: give rank counts (2 or 2,3) or 'all'") from None


def fit_all(data: Samples, kinds: dict[str, str | None], ranks: set[int], policy: str, gamma: Params,
            cores: int = 0) -> dict[str, Params]:
    """One ``Params`` per engine, fitted on its rows at ``ranks`` with the reduction cost ``gamma`` (and
    ``cores`` shared, see ``costmodel.coefficients``). Under ``policy="known"`` an engine whose algorithms no
    record documents is refused (an InvalidArgumentError naming it): fitting it with another library's choices
    would print a model of an engine that is not the one measured."""
    unknown = [name for name in data if kinds.get(name) is None]
    if unknown and policy == "known":
        raise InvalidArgumentError(
            f"model: {', '.join(unknown)}: no documented collective algorithms (the backend's registration record, "
            "unidist.registry.RawEngine.algorithms, names none for that launcher, or the backend is not registered "
            "here); model it with --policy min (the fastest formula at each size), or leave its files out")
    out = {}
    for name, rows in data.items():
        mine = [s for s in rows if s[1] in ranks]
        if not mine:
            raise InvalidArgumentError(f"{name}: no rows at {sorted(ranks)} ranks to fit; measured at "
                                       f"{sorted({s[1] for s in rows})} (use --fit-ranks)")
        out[name] = costmodel.fit(mine, kinds[name], gamma, policy=policy, cores=cores)
    return out


def check(data: Samples, kinds: dict[str, str | None], params: dict[str, Params], policy: str, cores: int = 0
          ) -> list[dict[str, Any]]:
    """Every measurement beside its prediction: one dict per (engine, op, ranks, bytes)."""
    out = []
    for name, rows in data.items():
        for op, p, n, seconds in rows:
            pred, alg = costmodel.predict(params[name], kinds[name], op, p, n, policy, cores)
            out.append({"engine": name, "op": op, "ranks": p, "bytes": n, "measured_us": seconds * 1e6,
                        "predicted_us": pred * 1e6, "error": pred / seconds - 1, "algorithm": alg})
    return out


def allreduce_time(params: Params, p: int, nbytes: float, algorithm: str) -> float:
    """Seconds of one allreduce of ``nbytes`` on ``p`` ranks by ``algorithm`` under ``params``."""
    return params.time("allreduce", costmodel.coefficients("allreduce", algorithm, p, nbytes), nbytes)


def project(params: Params, total_bytes: float, p: int, bucket: float = BUCKET) -> dict[str, float]:
    """Gradient-sync seconds of ``total_bytes`` in ``bucket``-byte fused allreduces on ``p`` ranks, per
    allreduce algorithm (full buckets plus the remainder, one after the other: no overlap with backward)."""
    full, rest = divmod(total_bytes, bucket)
    return {alg: full * allreduce_time(params, p, bucket, alg) + (allreduce_time(params, p, rest, alg) if rest else 0)
            for alg in ALLREDUCE_ALGS}


def networks(reference: Params, name: str) -> dict[str, Params]:
    """The stated networks (their alpha and beta, this machine's memory-regime gamma) and ``reference``'s
    own fitted allreduce values (``name``), as allreduce-only ``Params`` with one regime."""
    out = {net: Params({"allreduce": Link(a, b, b)}, gamma=reference.gamma_mem, gamma_mem=reference.gamma_mem)
           for net, (a, b) in NETWORKS.items()}
    out[f"this machine: {name}, fitted"] = reference
    return out


def render(kinds: dict[str, str | None], params: dict[str, Params], rows: list[dict[str, Any]], reference: str,
           fit_ranks: set[int], column: str, policy: str, gamma_note: str, cores: int,
           runs: list[dict[str, Any]] | None = None) -> tuple[str, dict[str, Any]]:
    """The markdown report and its JSON form; ``runs``: ``measure.json``'s rows (each launch's load)."""
    from unidist.bench.model_tables import checks_md, params_md, projection_md, runs_md, summary_md

    nets = networks(params[reference], reference)
    proj = {net: {wl: {p: project(prm, nbytes, p) for p in PROJECT_RANKS} for wl, nbytes in WORKLOADS.items()}
            for net, prm in nets.items()}
    text = "\n\n".join([
        *(["### Measurement runs (1-minute load average before and after each launch)", runs_md(runs)]
          if runs else []),
        f"### Fitted parameters ({column} calls; fitted on {', '.join(map(str, sorted(fit_ranks)))} ranks; "
        f"algorithms: {policy}; gamma {gamma_note}; "
        + (f"ranks share {cores} cores)" if cores else "one core per rank)"), params_md(params, kinds),
        "### Prediction against measurement (us; error = predicted / measured - 1)", checks_md(rows),
        "### Worst error per engine and rank count", summary_md(rows),
        f"### Projected gradient sync, ms per step (fp32 gradients in 25 MiB fused buckets, no overlap; "
        f"gamma and 'this machine' from {reference})",
        projection_md(proj, nets)])
    doc = {"column": column, "policy": policy, "fit_ranks": sorted(fit_ranks), "cores": cores,
           "params": {k: _jsonable(v) for k, v in params.items()},
           "kinds": kinds, "checks": rows,
           "projection": {net: {wl: {str(p): v for p, v in per.items()} for wl, per in wls.items()}
                          for net, wls in proj.items()}}
    return text + "\n", doc


def _jsonable(params: Params) -> dict[str, Any]:
    """``Params`` as JSON (infinity, "one regime", as null)."""
    def num(v: float) -> float | None:
        return None if math.isinf(v) else v
    return {"links": {op: {**vars(link), "split": num(link.split)} for op, link in params.links.items()},
            "gamma": params.gamma, "gamma_mem": params.gamma_mem, "gamma_cache": num(params.gamma_cache)}


def _default_reference(params: dict[str, Params], docs: list[dict[str, Any]]) -> str:
    """The engine the projection uses unless ``--reference`` names one: the fitted label whose backend comes first
    in the records' order of preference (``unidist.registry``: the mpi backend among unidist's), a backend not
    registered here last; the first label among equals."""
    from unidist.bench.output import label

    backend = {label({k: v for k, v in d["meta"].items() if k != "label"}): d["meta"]["backend"]
               for d in docs if "backend" in d.get("meta", {})}
    order = {name: i for i, name in enumerate(registry.names())}
    return min(params, key=lambda name: order.get(backend.get(name, ""), len(order)))


def main(args: argparse.Namespace) -> int:
    """Measure if asked, fit, check, project, print (and write ``--json``)."""
    from unidist.bench.output import load

    files = list(args.files)
    if args.measure:
        from unidist.bench.model_measure import measure

        files += measure(args)
    if not files:
        raise InvalidArgumentError("model: give collectives JSON files, or --measure to make them")
    docs = load(files)
    data, kinds = samples(docs, args.column)
    gamma, gamma_note = gamma_of(docs)
    ranks = _fit_ranks(args.fit_ranks, data)
    cores = args.cores if args.cores is not None else min(
        (int(d["meta"]["cpus"]) for d in docs if d.get("meta", {}).get("cpus")), default=0)
    params = fit_all(data, kinds, ranks, args.policy, gamma, cores)
    reference = args.reference or _default_reference(params, docs)
    if reference not in params:
        raise InvalidArgumentError(f"--reference {reference!r}: not among {', '.join(params)}")
    rows = check(data, kinds, params, args.policy, cores)
    runs = [r for d in docs for r in d.get("rows", []) if r.get("bench") == "measure"]
    text, doc = render(kinds, params, rows, reference, ranks, args.column, args.policy, gamma_note, cores, runs)
    print(text, flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1) + "\n")
    return 0
