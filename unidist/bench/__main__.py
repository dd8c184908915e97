"""``python -m unidist.bench <subcommand>``: unidist's benchmarks, under any launcher.

    mpiexec -n 2 python -m unidist.bench collectives --compare --sizes 8,64K,2M
    torchrun --standalone --nproc_per_node 2 -m unidist.bench gradsync --model resnet50
    horovodrun -np 2 --gloo -H localhost:2 python -m unidist.bench train
    python -m unidist.bench report              # every launcher; rewrites benchmarks/RESULTS.md and the plot

Measuring (inside one ``unidist.init()``): ``collectives``, ``gradsync``, ``train``, and ``all`` (the three in
one launch, one JSON file: what ``report`` runs per launcher). Each prints markdown tables on rank 0 and
writes ``--json FILE``. Offline: ``plot`` (bandwidth against size from JSON files, one line per run),
``report``, and ``model`` (a latency/bandwidth cost model fitted to collectives JSON files, checked against
them and projected to 1024 ranks). The older single-purpose benchmarks are reachable here too: ``check``,
``zero``, ``checkpoint`` and ``ddp_digits`` (as ``python -m unidist.bench.check`` and so on).

This file also runs as a script path (the deepspeed launcher and ``unidist bench`` start scripts by path).
"""

from __future__ import annotations

import sys
from pathlib import Path

if __package__ in (None, ""):
    # Run by path: sys.path[0] is this directory, whose modules (train, check, ...) would shadow top-level
    # imports; put the tree this file belongs to there instead, so `import unidist` finds this very copy.
    sys.path[0] = str(Path(__file__).resolve().parents[2])

import argparse
import runpy
from collections.abc import Sequence
from typing import Any

from unidist.bench import DELEGATED, MEASURE, SUBCOMMANDS
from unidist.launch import script_args

__all__ = ["main"]

def _common(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", type=Path, help="write the rows (and the run's metadata) to this file (rank 0)")
    parser.add_argument("--label", help="name of this run in plots and reports (default: backend (launcher))")
    parser.add_argument("--rounds", type=int, default=5, help="interleaved rounds; medians over them")
    parser.add_argument("--warmup", type=int, default=3, help="untimed calls or steps before timing")
    parser.add_argument("--scale", type=float, default=1.0,
                        help="width multiplier of the gradsync and train models (tensor counts unchanged)")


def _modules() -> dict[str, Any]:
    from unidist.bench import collectives, gradsync, train

    return {"collectives": collectives, "gradsync": gradsync, "train": train}


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m unidist.bench", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="sub", required=True, metavar="{" + ",".join(SUBCOMMANDS) + "}")
    mods = _modules()
    for name in MEASURE:
        p = sub.add_parser(name, help=mods[name].__doc__.splitlines()[0],
                           description=mods[name].__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
        _common(p)
        mods[name].add_arguments(p)
    p_all = sub.add_parser("all", help="collectives, gradsync and train in one launch, one JSON file")
    _common(p_all)
    p_all.add_argument("--benches", default=",".join(MEASURE), help="which of them, comma-separated")
    for name in MEASURE:
        mods[name].add_arguments(p_all)
    from unidist.bench import model, report

    report.add_arguments(sub)
    model.add_arguments(sub)
    return parser


def measure(args: argparse.Namespace) -> int:
    """Run the chosen benchmarks in one ``unidist.init()``; rank 0 prints and writes."""
    import unidist
    from unidist.bench.output import machine_line, meta, plot_bandwidth, write_json

    mods = _modules()
    names = [b.strip() for b in args.benches.split(",") if b.strip()] if args.sub == "all" else [args.sub]
    unknown = [n for n in names if n not in mods]
    if unknown:
        raise SystemExit(f"unknown benchmark(s) {', '.join(unknown)}; use {', '.join(MEASURE)}")
    with unidist.init() as mgr:
        run_meta = meta(mgr)
        if args.label:
            run_meta["label"] = args.label
        rows: list[dict[str, Any]] = []
        for i, name in enumerate(names):
            mine = mods[name].run(mgr, args)
            rows += mine
            if mgr.is_main:
                if i == 0:  # once per run, above its tables (measured before them: output.meta)
                    print(machine_line(run_meta["machine"]) + "\n", flush=True)
                print(mods[name].table(mine, run_meta) + "\n", flush=True)
        if mgr.is_main:
            if args.json:
                write_json(args.json, run_meta, rows)
            if getattr(args, "plot", None) and "collectives" in names:
                plot_bandwidth([{"meta": run_meta, "rows": [{**r, "ranks": mgr.size} for r in rows]}],
                               Path(args.plot))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    raw = script_args() if argv is None else script_args(["unidist.bench", *argv])
    if raw[:1] and raw[0] in DELEGATED:
        # the older benchmarks parse sys.argv themselves: run them as `python -m` would
        sys.argv = [DELEGATED[raw[0]], *raw[1:]]
        runpy.run_module(DELEGATED[raw[0]], run_name="__main__", alter_sys=True)
        return 0
    rest: list[str] = []
    if raw[:1] in (["report"], ["model"]) and "--" in raw:  # options for every run's `all` (or collectives)
        cut = raw.index("--")
        raw, rest = raw[:cut], raw[cut + 1:]
    args = _parser().parse_args(raw)
    args.bench_args = rest
    if args.sub in (*MEASURE, "all"):
        return measure(args)
    if args.sub == "model":
        from unidist.bench import model

        return model.main(args)
    from unidist.bench import report

    return report.main(args)


if __name__ == "__main__":
    sys.exit(main())
