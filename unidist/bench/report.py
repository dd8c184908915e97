"""``report``: run ``all`` under every launcher, then rewrite benchmarks/RESULTS.md and the plot; ``plot``.

    python -m unidist.bench report --bin mpi=.tox/py/bin --bin torch=.tox/torch/bin ...   (benchmarks/regenerate.sh)
    python -m unidist.bench report --render-only          # tables and plot again from results/*.json
    python -m unidist.bench report --render-only --against OTHER   # and what moved from OTHER's results
    python -m unidist.bench plot results/*.json -o bw.png  # one line per run

Each run is one launch of ``python -m unidist.bench all --compare`` (collectives, gradsync, train) on
``-n`` ranks, with the launcher spelled as ``unidist launch`` spells it (``unidist.launch.LAUNCHERS``), the
programs and interpreter taken from the ``--bin`` directory of its engine (each engine may live in its own
virtual environment), ``PYTHONPATH`` pointing at this copy of unidist (the tree is measured, not an
installed copy), and ``OMP_NUM_THREADS`` = cores / ranks unless set (torchrun sets 1, mpiexec nothing:
without this the launchers would differ in threads, not in communication). Runs go one after the other;
a failed run is reported and the others still rendered. The rendering goes between the ``generated``
markers of RESULTS.md; text outside them is kept. Then it prints which figures moved beyond the noise since
the result set that was there before the runs (read before they overwrite it), or since ``--against DIR``'s
(``unidist.bench.drift`` says how rows match and what the noise is).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unidist import registry
from unidist.bench import drift
from unidist.bench.output import Column, fmt, human_bytes, label, load, markdown, plot_bandwidth

__all__ = ["add_arguments", "machine_cells", "main", "render", "runs"]

BEGIN, END = "<!-- generated: begin -->", "<!-- generated: end -->"
QUICK = ["--sizes", "8,4K", "--rounds", "2", "--warmup", "1", "--budget", "0.01", "--scale", "0.05", "--iters", "1",
         "--steps", "1", "--batch", "4", "--image-size", "32"]
SUMMARY_SIZES = (8, 64 << 10, 1 << 20, 16 << 20, 128 << 20)
_LAUNCH_VARS = ("UNIDIST_", "PMI_", "PMIX_", "OMPI_", "MPI_LOCAL", "HYDRA_", "HOROVOD_", "SLURM_", "TORCHELASTIC_")
_LAUNCH_NAMES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "LOCAL_SIZE", "CROSS_RANK", "GROUP_RANK",
                 "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Run:
    """One launch: its name (the JSON file's stem), the launcher family that starts it, the backend (whose
    ``--bin`` directory provides the programs), and extra environment."""

    name: str
    launcher: str
    backend: str
    env: Mapping[str, str] = field(default_factory=dict)


def runs() -> tuple[Run, ...]:
    """Every registered launch with a benchmark run name (``Launch.bench``), in the records' order."""
    import torch

    gpu = torch.cuda.is_available()
    return tuple(Run(lch.bench, lch.launcher, rec.name, lch.environment(gpu))
                 for rec in registry.records() for lch in rec.launches if lch.bench)


def add_arguments(sub: Any) -> None:
    p = sub.add_parser("report", help="run every launcher, rewrite RESULTS.md and the plot",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=Path("benchmarks"),
                   help="RESULTS.md and collectives.png here, JSON and logs under results/ (default: benchmarks)")
    p.add_argument("--bin", action="append", default=[], metavar="ENGINE=DIR",
                   help=f"directory with python and the launcher for an engine "
                        f"({', '.join(dict.fromkeys(r.backend for r in runs()))}); default: beside this interpreter")
    p.add_argument("--runs", default=",".join(r.name for r in runs()), help="which runs, comma-separated")
    p.add_argument("-n", "--nprocs", type=int, default=2)
    p.add_argument("--render-only", action="store_true", help="no runs: render from the JSON files there")
    p.add_argument("--against", type=Path, metavar="DIR",
                   help="compare the figures with this result set (its *.json or DIR/results/*.json; e.g. another "
                        "machine's) instead of the one there before the runs")
    p.add_argument("--noise", type=float, default=drift.NOISE,
                   help="relative change below which a figure has not moved (default: %(default)s)")
    p.add_argument("--quick", action="store_true", help="tiny sizes (a smoke of the pipeline; needs --out-dir)")
    p.add_argument("--timeout", type=float, default=3600, help="seconds per run")
    p.epilog = "Options after -- go to every run's `all` (e.g. -- --max-size 32M --rounds 7)."
    p_plot = sub.add_parser("plot", help="bandwidth against size from --json files, one line per run")
    p_plot.add_argument("files", nargs="+", type=Path)
    p_plot.add_argument("-o", "--out", type=Path, required=True, help="the PNG to write")
    p_plot.add_argument("--metric", choices=("busbw_GBps", "algbw_GBps"), default="busbw_GBps")


def bins(specs: list[str]) -> dict[str, Path]:
    """``--bin ENGINE=DIR`` options as {engine: directory holding its python and launcher}."""
    found: dict[str, Path] = {}
    for spec in specs:
        engine, sep, where = spec.partition("=")
        if not sep:
            raise SystemExit(f"--bin {spec!r}: expected ENGINE=DIR")
        found[engine] = Path(where).resolve()
    return found


def command(run: Run, bindir: Path, n: int, rest: list[str]) -> list[str]:
    """The launch of ``python -m unidist.bench all`` (by script path, as the deepspeed launcher needs)."""
    from unidist.launch import family
    from unidist.net import free_port

    fam = family(run.launcher)
    if fam is None or fam.command is None:
        raise SystemExit(f"run {run.name!r}: launcher family {run.launcher!r} has no command line")
    program = next((str(bindir / p) for p in fam.command.programs if (bindir / p).exists()),
                   fam.command.programs[0])
    script = str(Path(__file__).resolve().with_name("__main__.py"))
    return fam.command.argv(program, n, str(bindir / "python"), free_port(), [script, "all", *rest])


def run_env(run: Run, n: int) -> dict[str, str]:
    """The environment of one run's launch: this tree first on PYTHONPATH, no variables of an outer launcher
    (they would make the benchmark think it is already inside a job), the run's own variables."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(_LAUNCH_VARS) and k not in _LAUNCH_NAMES}
    root = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [os.environ.get("PYTHONPATH")])])
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // n)))
    env["PYTHONUNBUFFERED"] = "1"
    env.update(run.env)
    return env


def run_all(args: argparse.Namespace) -> list[str]:
    """Launch each chosen run; returns the names that failed."""
    dirs = bins(args.bin)
    results = args.out_dir / "results"
    results.mkdir(parents=True, exist_ok=True)
    chosen = [r.strip() for r in args.runs.split(",") if r.strip()]
    known = {r.name: r for r in runs()}
    failed = []
    extra = list(getattr(args, "bench_args", []))
    for name in chosen:
        if name not in known:
            raise SystemExit(f"unknown run {name!r}; use {', '.join(known)}")
        run = known[name]
        bindir = dirs.get(run.backend, Path(sys.executable).parent)
        rest = ["--compare", "--json", str((results / f"{name}.json").resolve()), *(QUICK if args.quick else []),
                *extra]
        argv = command(run, bindir, args.nprocs, rest)
        print(f"== {name}: {' '.join(argv)}", flush=True)
        start = time.perf_counter()
        with open(results / f"{name}.log", "w") as log:
            try:
                code = subprocess.run(argv, env=run_env(run, args.nprocs), stdout=log, stderr=subprocess.STDOUT,
                                      timeout=args.timeout, check=False).returncode
            except subprocess.TimeoutExpired:
                code = -1
        print(f"   exit {code} after {time.perf_counter() - start:.0f} s (log: {results / f'{name}.log'})",
              flush=True)
        if code != 0:
            failed.append(name)
    return failed


def _nearest(sizes: list[int], target: int) -> int:
    return min(sizes, key=lambda s: abs(s - target))


def _cell(value: Any) -> str:
    return "-" if value is None else str(value)


def _rows(docs: list[dict[str, Any]], bench: str) -> list[dict[str, Any]]:
    return [{**r, "run": label(d["meta"])} for d in docs for r in d["rows"] if r.get("bench") == bench]


def _find(rows: list[dict[str, Any]], **match: Any) -> list[dict[str, Any]]:
    return [r for r in rows if all(r.get(k) == v for k, v in match.items())]


def targets(docs: list[dict[str, Any]]) -> list[dict[str, str]]:
    """Issues 13's and 25's targets beside what the runs measured (only those the runs can show)."""
    coll, grad, train = (_rows(docs, b) for b in ("collectives", "gradsync", "train"))
    out: list[dict[str, str]] = []
    for size in (32 << 20, 128 << 20):
        for r in _find(coll, backend="mpi", op="allreduce", bytes=size):
            if r.get("ratio"):
                speedup = 1 / r["ratio"]
                out.append({"target": f"mpi allreduce {human_bytes(size)}: raw MPICH time / unidist >= 3x",
                            "measured": f"{speedup:.2f}x", "met": "yes" if speedup >= 3 else "no"})
    for r in _find(coll, backend="mpi", op="allreduce", bytes=8):
        if r.get("raw_time_us"):
            ratio = r["time_us"] / r["raw_time_us"]
            out.append({"target": "mpi allreduce 8 B: unidist / raw mpi4py <= 1.3 (watchdog on)",
                        "measured": f"{ratio:.2f} ({r['time_us']:.2f} vs {r['raw_time_us']:.2f} us)",
                        "met": "yes" if ratio <= 1.3 else "no"})
    for run in dict.fromkeys(r["run"] for r in coll):
        big = [r for r in _find(coll, run=run) if r["bytes"] >= 64 << 10 and r.get("ratio")]
        if big:
            worst = max(big, key=lambda r: r["ratio"])
            out.append({"target": f"{run}: unidist/raw <= 1.05 from 64 KiB up (worst case)",
                        "measured": f"{worst['ratio']:.2f} ({worst['op']}, {human_bytes(worst['bytes'])})",
                        "met": "yes" if worst["ratio"] <= 1.05 else "no"})
    for run in dict.fromkeys(r["run"] for r in grad):
        for model in ("resnet50", "gpt2"):
            fused = _find(grad, run=run, model=model, method="fused")
            if fused and fused[0].get("ratio") is not None:
                ratio = fused[0]["ratio"]
                name = {"resnet50": "ResNet-50", "gpt2": "GPT-2"}[model]
                out.append({"target": f"{run}: {name} gradient sync (prepare's default) / raw per-tensor <= 0.7",
                            "measured": f"{ratio:.2f}", "met": "yes" if ratio <= 0.7 else "no"})
    ddp = _find(train, backend="torch", impl="ddp")
    mpi = _find(train, backend="mpi", impl="unidist")
    if ddp and mpi:
        ratio = mpi[0]["samples_per_s"] / ddp[0]["samples_per_s"]
        out.append({"target": "train: unidist on mpi >= 1.5x torch DDP (gloo, torchrun) samples/s",
                    "measured": f"{ratio:.2f}x", "met": "yes" if ratio >= 1.5 else "no"})
    return out


def machine_cells(run_meta: dict[str, Any]) -> dict[str, str]:
    """The Runs table's machine columns; ``not recorded`` for JSON files written before meta["machine"]."""
    m = run_meta.get("machine")
    if not m:
        cpus = run_meta.get("cpus")
        return {"cpu_model": "not recorded", "cores": "-" if cpus is None else str(cpus), "thp": "not recorded",
                "copy": "not recorded"}
    cores = str(m.get("cpus"))
    if m.get("cpus_usable") not in (None, m.get("cpus")):
        cores += f" ({m['cpus_usable']} usable)"
    copy = "not measured"
    if m.get("copy_GBps"):
        copy = f"{m['copy_GBps']:.1f}"
        if m.get("copy_huge_share") is not None:
            copy += f" ({m['copy_huge_share']:.0%} huge pages)"
    return {"cpu_model": str(m.get("cpu_model")), "cores": cores, "thp": str(m.get("thp")), "copy": copy}


def render(docs: list[dict[str, Any]]) -> str:
    """The generated part of RESULTS.md: the runs, the targets, collective summaries, gradsync and train
    tables, and every run's full collective table."""
    from unidist.bench import collectives

    goals = targets(docs)
    # a version column per package a registered backend requires (output.meta records the same ones)
    versions: list[Column] = [(pkg, pkg, str) for pkg in
                              dict.fromkeys(pkg for rec in registry.records() for pkg in rec.requires)]
    out = ["### Runs", "", markdown(
        [("run", "run", str), ("ranks", "ranks", str), ("date", "date (UTC)", str), *versions,
         ("omp_threads", "OMP threads", str), ("cpu_model", "CPU", str), ("cores", "cores", str),
         ("thp", "THP", str), ("copy", "memory GB/s", str)],
        [{**d["meta"], "run": label(d["meta"]), **machine_cells(d["meta"])} for d in docs]), ""]
    if goals:
        goal_cols: list[Column] = [("target", "target", str), ("measured", "measured", str), ("met", "met", str)]
        out += ["### Targets (issues 13 and 25)", "", markdown(goal_cols, goals), ""]
    coll = _rows(docs, "collectives")
    if coll:
        out += ["### Collectives: unidist us (unidist / raw engine)", "",
                "![bus bandwidth against message size](collectives.png)", ""]
        sizes = sorted({r["bytes"] for r in coll})
        picks = sorted({_nearest(sizes, t) for t in SUMMARY_SIZES})
        summary = []
        for (run, op) in dict.fromkeys((r["run"], r["op"]) for r in coll):
            row: dict[str, Any] = {"run": run, "op": op}
            for r in coll:
                if r["run"] == run and r["op"] == op and r["bytes"] in picks:
                    ratio = f" ({r['ratio']:.2f})" if r.get("ratio") else ""
                    row[str(r["bytes"])] = f"{r['time_us']:.1f}{ratio}"
            summary.append(row)
        cols: list[Column] = [("run", "run", str), ("op", "op", str)]
        cols += [(str(s), human_bytes(s), _cell) for s in picks]
        out += [markdown(cols, summary), ""]
        out += ["Bus bandwidth of allreduce, GB/s (raw engine in brackets):", ""]
        runs = list(dict.fromkeys(r["run"] for r in coll if r["op"] == "allreduce"))
        bw = []
        for size in sizes:
            row = {"size": human_bytes(size)}
            for r in coll:
                if r["op"] == "allreduce" and r["bytes"] == size:
                    raw = f" ({r['raw_busbw_GBps']:.3f})" if r.get("raw_busbw_GBps") else ""
                    row[r["run"]] = f"{r['busbw_GBps']:.3f}{raw}"
            bw.append(row)
        out += [markdown([("size", "size", str), *[(run, run, _cell) for run in runs]], bw), ""]
    grad = _rows(docs, "gradsync")
    if grad:
        out += ["### Gradient sync: backward + sync per step, ms", "", markdown(
            [("run", "run", str), ("model", "model", str), ("what", "method", str),
             ("unit_ms", "backward + sync ms", fmt(1)), ("sync_ms", "sync ms", fmt(1)),
             ("ratio", "sync / raw per-tensor", fmt(2))], grad), ""]
    train = _rows(docs, "train")
    if train:
        out += ["### Training throughput: resnet18 layout, 64x64 synthetic images", "", markdown(
            [("run", "run", str), ("impl", "implementation", str), ("batch_per_rank", "batch/rank", str),
             ("step_ms", "step ms", fmt(1)), ("samples_per_s", "samples/s", fmt(1)), ("vs_ddp", "vs DDP", fmt(2))],
            train), ""]
    for d in docs:
        mine = [r for r in d["rows"] if r.get("bench") == "collectives"]
        if mine:
            out += [f"<details><summary>{label(d['meta'])}: every collective and size</summary>", "",
                    collectives.table(mine, d["meta"]), "", "</details>", ""]
    return "\n".join(out).rstrip() + "\n"


def write_results(out_dir: Path, docs: list[dict[str, Any]]) -> Path:
    """Replace the generated part of RESULTS.md (the whole file if it has no markers) and redraw the plot."""
    md = out_dir / "RESULTS.md"
    body = f"{BEGIN}\n{render(docs)}{END}"
    text = md.read_text() if md.exists() else ""
    if BEGIN in text and END in text:
        head, _, rest = text.partition(BEGIN)
        text = head + body + rest.partition(END)[2]
    else:
        text = f"# Benchmark results\n\n{body}\n"
    md.write_text(text)
    if any(r.get("bench") == "collectives" for d in docs for r in d["rows"]):
        plot_bandwidth(docs, out_dir / "collectives.png")
    return md


def main(args: argparse.Namespace) -> int:
    if args.sub == "plot":
        plot_bandwidth(load(args.files), args.out, metric=args.metric)
        print(f"wrote {args.out}")
        return 0
    if args.quick and args.out_dir == Path("benchmarks"):
        raise SystemExit("report --quick writes smoke figures: give another --out-dir than benchmarks")
    if args.against is not None and not args.against.is_dir():
        raise SystemExit(f"--against {args.against}: not a directory")
    # the set to compare with, read before the runs overwrite it (the committed one, unless --against)
    previous = drift.load_dir(args.against if args.against is not None else args.out_dir)
    failed = [] if args.render_only else run_all(args)
    order = {r.name: i for i, r in enumerate(runs())}
    files = sorted((args.out_dir / "results").glob("*.json"), key=lambda p: (order.get(p.stem, 99), p.stem))
    if not files:
        raise SystemExit(f"no results in {args.out_dir / 'results'}")
    docs = load(files)
    md = write_results(args.out_dir, docs)
    print(f"wrote {md} from {len(files)} runs" + (f"; FAILED: {', '.join(failed)}" if failed else ""))
    current = {p.stem: d for p, d in zip(files, docs, strict=True)}
    if previous and (args.against is not None or not args.render_only):
        print("\n" + drift.render(drift.compare(previous, current, noise=args.noise), previous, current), end="")
    return 1 if failed else 0
