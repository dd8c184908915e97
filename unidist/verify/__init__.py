"""``unidist verify SCRIPT [ARGS...]``: does the script train the same under every launcher and engine?

It runs the script under several launches (``launches.py``), each writing a training fingerprint
(``unidist.train.fingerprint``: one line per optimizer step, from inside, nothing in the script changes), then
compares every launch with the one-process run step by step (``compare.py``) and prints a table (``report.py``).
On the first step a launch leaves the tolerance it names the launch, the step, the quantity, the parameter that
differs most and the known causes that fit. Exit status: 0 when every launch agrees, 1 when one diverges, 2 when
a launch failed (its output's tail is printed) or nothing could be compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unidist.errors import UnidistError
from unidist.verify import compare, report
from unidist.verify.launches import Launch, LaunchCommand, default_launches, parse_launch, run

__all__ = ["add_arguments", "main"]

EXIT_AGREE, EXIT_DIVERGED, EXIT_FAILED = 0, 1, 2


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``unidist verify``'s options."""
    p.add_argument("script", help="the training script (written for unidist, unidist.compat.horovod or "
                                  "unidist.compat.deepspeed)")
    p.add_argument("args", nargs=argparse.REMAINDER, help="arguments for the script")
    p.add_argument("--launch", action="append", default=None, metavar="COMMAND",
                   help="a launch to compare with the one-process run, e.g. 'mpiexec -n 4' or "
                        "'UNIDIST_BACKEND=horovod mpiexec -n 2' (repeatable; default: every usable launcher at "
                        "2 ranks)")
    p.add_argument("-n", "--nprocs", type=int, default=2, help="ranks of each default launch (default 2)")
    p.add_argument("--tolerance", type=float, default=None,
                   help="the largest relative difference that agrees (default: from the precision, "
                        + ", ".join(f"{k}: {v:g}" for k, v in compare.TOLERANCES.items()) + ")")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each launch may take (default 600)")
    p.add_argument("--out-dir", default=None, help="keep the fingerprints here (default: a temporary directory)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="the loss curves overlaid (needs matplotlib)")


def _launches(ns: argparse.Namespace, launch_command: LaunchCommand, usable: Sequence[str], gpu: bool
              ) -> list[Launch]:
    if ns.launch:
        made = [Launch("python", [sys.executable, ns.script, *ns.args]),
                *(parse_launch(text, ns.script, ns.args) for text in ns.launch)]
    else:
        made = default_launches(ns.script, ns.args, usable, launch_command, gpu, ns.nprocs)
    seen: dict[str, int] = {}
    for launch in made:  # one label, one fingerprint file, per launch: "mpiexec-2", "mpiexec-2.2", ...
        seen[launch.label] = seen.get(launch.label, 0) + 1
        if seen[launch.label] > 1:
            launch.label = f"{launch.label}.{seen[launch.label]}"
    return made


def _usable() -> tuple[list[str], bool]:
    """The backends with a launcher ``unidist info --check`` finds usable here, and whether there is a GPU."""
    from unidist import doctor

    found = doctor.check(os.environ)
    return list(found["usable_launched"]), bool(found["machine"].get("gpus"))


def main(ns: argparse.Namespace, launch_command: LaunchCommand) -> int:
    """Run, compare, report; the exit status (see the module docstring).

    Args:
        ns: the parsed options (``add_arguments``).
        launch_command: ``unidist launch``'s command builder, handed over by the CLI.
    """
    if not Path(ns.script).is_file():
        print(f"unidist verify: no script {ns.script!r}", file=sys.stderr)
        return EXIT_FAILED
    try:
        usable, gpu = ([], False) if ns.launch else _usable()
        launches = _launches(ns, launch_command, usable, gpu)
    except UnidistError as err:
        print(f"unidist verify: {err}", file=sys.stderr)
        return EXIT_FAILED
    out_dir = Path(ns.out_dir or tempfile.mkdtemp(prefix="unidist-verify-"))
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k not in ("UNIDIST_FINGERPRINT", "UNIDIST_BACKEND")}
    outcomes = []
    for launch in launches:
        if not ns.json:
            print(f"running {launch.label}: {' '.join(launch.argv)}", file=sys.stderr, flush=True)
        outcomes.append(run(launch, out_dir / f"{launch.label}.jsonl", env, ns.timeout))
    result = report.build(outcomes, ns.tolerance)
    result["fingerprints"] = str(out_dir)
    if ns.plot:
        result["plot"] = report.plot(result, ns.plot)
    if ns.json:
        print(json.dumps(_finite(result), indent=2, default=_plain, allow_nan=False))
    else:
        print("\n".join(report.lines(result)))
    return {"agree": EXIT_AGREE, "diverged": EXIT_DIVERGED}.get(result["verdict"], EXIT_FAILED)


def _plain(obj: Any) -> Any:
    return str(obj)


def _finite(obj: Any) -> Any:
    """``obj`` with inf and nan as the strings "inf", "-inf", "nan": strict JSON (jq, JSON.parse) has neither."""
    if isinstance(obj, float) and not math.isfinite(obj):
        return str(obj)
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite(v) for v in obj]
    return obj
