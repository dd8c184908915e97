"""``unidist verify SCRIPT [ARGS...]``: does the script train the same under every launcher and engine?

It runs the script as one process (the reference), then again ``envelope.RUNS`` times with its rounding perturbed
(how far rounding alone moves *this* script: the envelope), then under each launch (``launches.py``), each in a
working directory of its own (``workdirs.py``), each writing a training fingerprint (``unidist.train.fingerprint``:
one line per optimizer step, from inside, nothing in the script changes); the dropout family is switched off in all
of them unless ``--keep-random``. Each launch is compared with the reference step by step within the envelope times
a factor (``compare.py``); a divergence is explained by the evidence (``causes.py``) and, within a time budget or on
``--locate``, re-run with per-module probes to name the first module and phase that leaves the envelope
(``locate.py``). Exit status: 0 when every launch agrees, 1 when one diverges, 2 when a run failed (its output's
tail is printed), an argument is wrong, or nothing could be compared.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from unidist.errors import UnidistError
from unidist.verify import compare, envelope, report, runs
from unidist.verify.causes import Evidence
from unidist.verify.launches import Launch, LaunchCommand, Outcome, default_launches, parse_launch, run
from unidist.verify.locate import Location, locate
from unidist.verify.workdirs import Workdirs, absolute_args

__all__ = ["add_arguments", "main"]

EXIT_AGREE, EXIT_DIVERGED, EXIT_FAILED = 0, 1, 2
LOCATE_BUDGET = 120.0  # seconds of re-runs verify spends on locating a divergence without being asked


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
    p.add_argument("--factor", type=float, default=envelope.FACTOR,
                   help=f"a launch agrees within this many rounding envelopes (default {envelope.FACTOR:g})")
    p.add_argument("--tolerance", type=float, default=None,
                   help="a fixed largest relative difference instead of the measured envelope (no rounding re-runs)")
    p.add_argument("--keep-random", action="store_true",
                   help="run dropout and other random ops as written (default: the dropout family is switched off "
                        "in every launch, so that one process and N ranks compute the same thing)")
    p.add_argument("--locate", action="store_true",
                   help="re-run a diverging launch to name the first module and phase that leaves the envelope, "
                        "whatever it costs (without it: when the re-runs fit in --locate-budget)")
    p.add_argument("--locate-budget", type=float, default=LOCATE_BUDGET, metavar="SECONDS",
                   help=f"locate without --locate when the re-runs should take at most this long (default "
                        f"{LOCATE_BUDGET:g}; 0: never)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds each launch may take (default 600)")
    p.add_argument("--out-dir", default=None, help="keep the fingerprints here (default: a temporary directory)")
    p.add_argument("--keep-workdirs", action="store_true",
                   help="keep each launch's working directory (under .unidist-verify/ in the current directory)")
    p.add_argument("--json", action="store_true", help="print the comparison as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="the loss curves overlaid (needs matplotlib)")


def _checked(ns: argparse.Namespace) -> str | None:
    """What is wrong with the options, or None."""
    if not Path(ns.script).is_file():
        return f"no script {ns.script!r}"
    for name in ("factor", "tolerance", "timeout"):
        value = getattr(ns, name)
        if value is not None and not (math.isfinite(value) and value > 0):
            return f"--{name} {value!r}: give a positive number"
    if not (math.isfinite(ns.locate_budget) and ns.locate_budget >= 0):
        return f"--locate-budget {ns.locate_budget!r}: give a number of seconds, 0 or more"
    if ns.nprocs < 1:
        return f"-n {ns.nprocs}: give a number of ranks, 1 or more"
    return None


def _launches(ns: argparse.Namespace, script: str, args: Sequence[str], launch_command: LaunchCommand,
              usable: Sequence[str], gpu: bool) -> list[Launch]:
    if ns.launch:
        made = [Launch("python", [sys.executable, script, *args]),
                *(parse_launch(text, script, args) for text in ns.launch)]
    else:
        made = default_launches(script, args, usable, launch_command, gpu, ns.nprocs)
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


class _Runner:
    """Runs launches one after the other, each in its own working directory, with its own fingerprint file."""

    def __init__(self, out_dir: Path, env: dict[str, str], timeout: float, work: Workdirs, quiet: bool) -> None:
        self.out_dir, self.env, self.timeout, self.work, self.quiet = out_dir, env, timeout, work, quiet

    def __call__(self, launch: Launch, what: str = "") -> Outcome:
        if not self.quiet:
            print(f"running {launch.label}{what}: {' '.join(launch.argv)}", file=sys.stderr, flush=True)
        return run(launch, self.out_dir / f"{launch.label}.jsonl", self.env, self.timeout, self.work.make(launch.label))


def main(ns: argparse.Namespace, launch_command: LaunchCommand) -> int:
    """Run, compare, explain, report; the exit status (see the module docstring).

    Args:
        ns: the parsed options (``add_arguments``).
        launch_command: ``unidist launch``'s command builder, handed over by the CLI.
    """
    wrong = _checked(ns)
    if wrong:
        print(f"unidist verify: {wrong}", file=sys.stderr)
        return EXIT_FAILED
    started = time.monotonic()
    cwd = Path.cwd()
    script, args = str(Path(ns.script).resolve()), absolute_args(ns.args, cwd)
    try:
        usable, gpu = ([], False) if ns.launch else _usable()
        launches = _launches(ns, script, args, launch_command, usable, gpu)
    except UnidistError as err:
        print(f"unidist verify: {err}", file=sys.stderr)
        return EXIT_FAILED
    out_dir = Path(ns.out_dir or tempfile.mkdtemp(prefix="unidist-verify-")).absolute()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if not k.startswith("UNIDIST_FINGERPRINT") and k != "UNIDIST_BACKEND"}
    env["UNIDIST_FINGERPRINT_RANDOM"] = "count" if ns.keep_random else "off"
    work = Workdirs(cwd, out_dir, keep=ns.keep_workdirs)
    try:
        runner = _Runner(out_dir, env, ns.timeout, work, ns.json)
        ref = launches[0]
        first = runner(ref, " (the reference)")
        perturbed = [] if ns.tolerance is not None or first.returncode != 0 else [
            runner(ref.variant(f"{ref.label}-rounding{k}", UNIDIST_FINGERPRINT_PERTURB=str(k)),
                   " (the reference, its rounding perturbed)") for k in range(1, envelope.RUNS + 1)]
        outcomes = [first, *(runner(launch) for launch in launches[1:])]
        cmp = report.build(outcomes, perturbed, ns.tolerance, ns.factor)
        evidence = _evidence(cmp, [first, *perturbed, *outcomes[1:]])
        locations: dict[str, Location] = {}
        if cmp.found and (ns.locate or _fits(cmp, outcomes, perturbed, ns.locate_budget)):
            locations = _locate(cmp, launches, runner, evidence)
        report.explain(cmp, evidence, locations)
    finally:
        work.close()
    result = cmp.result
    result["fingerprints"] = str(out_dir)
    result["seconds"] = round(time.monotonic() - started, 1)
    if ns.plot:
        result["plot"] = report.plot(result, ns.plot)
    if ns.json:
        print(json.dumps(_finite(result), indent=2, default=_plain, allow_nan=False))
    else:
        print("\n".join(report.lines(result)))
    return {"agree": EXIT_AGREE, "diverged": EXIT_DIVERGED}.get(result["verdict"], EXIT_FAILED)


def _evidence(cmp: report.Comparison, ran: Sequence[Outcome]) -> Evidence:
    """What the causes need beyond each launch's own fingerprint: the reference's random calls, who saved which
    checkpoint before whom (``ran``: every run, in the order they ran), whether the launches agree with one another
    while all leave one process at step 1."""
    ref = cmp.runs.get(cmp.result["reference"] or "")
    ev = Evidence(random=ref.random_calls() if ref else {}, random_mode=str((ref.header if ref else {}).get(
        "random", "keep")))
    saved: dict[str, str] = {}
    for o in ran:
        run_ = cmp.runs.get(o.launch.label)
        ev.writers[o.launch.label] = dict(saved)
        for e in run_.saves() if run_ else []:
            saved[os.path.normpath(e["path"])] = o.launch.label
    compared = [cmp.runs[e["label"]] for e in cmp.result["launches"][1:] if e["status"] in ("agrees", "diverged")]
    early = [cmp.found.get(r.label) for r in compared]
    if len(compared) >= 2 and all(f is not None and f.step <= 1 for f in early):
        ev.peers_agree = all(compare.compare(r, compared[0], cmp.env) is None for r in compared[1:])
    return ev


def _fits(cmp: report.Comparison, outcomes: Sequence[Outcome], perturbed: Sequence[Outcome], budget: float) -> bool:
    """Whether locating every divergence should take at most ``budget`` seconds (the re-runs stop at the step,
    so their first runs' times bound them)."""
    ref_time = outcomes[0].seconds * (1 + len(perturbed))
    return ref_time + sum(o.seconds for o in outcomes if o.launch.label in cmp.found) <= budget


def _locate(cmp: report.Comparison, launches: Sequence[Launch], runner: _Runner, ev: Evidence
            ) -> dict[str, Location]:
    """Re-run the reference, its rounding re-runs and each diverging launch up to its first diverging step with
    per-module probes; locate each; a second run of a launch that differs from its first is nondeterminism."""
    steps = {label: f.step for label, f in cmp.found.items() if f.step >= 1 and f.quantity != "steps"}
    if not steps:
        return {}
    last = str(max(steps.values()))
    ref = launches[0]
    base = runs_of(runner(ref.variant(f"{ref.label}-locate", UNIDIST_FINGERPRINT_LOCATE=last), " (locate)"))
    perturbed = [runs_of(runner(ref.variant(f"{ref.label}-rounding{k}-locate", UNIDIST_FINGERPRINT_LOCATE=last,
                                            UNIDIST_FINGERPRINT_PERTURB=str(k)), " (locate)"))
                 for k in range(1, cmp.env.runs + 1)]
    found: dict[str, Location] = {}
    for launch in launches[1:]:
        if launch.label not in steps:
            continue
        again = runs_of(runner(launch.variant(f"{launch.label}-locate",
                                              UNIDIST_FINGERPRINT_LOCATE=str(steps[launch.label])), " (locate)"))
        if again is None or base is None:
            continue
        ev.rerun[launch.label] = _rerun_difference(cmp.runs[launch.label], again, cmp.env)
        found[launch.label] = locate(again, base, [p for p in perturbed if p is not None], steps[launch.label],
                                     cmp.env)
    return found


def runs_of(outcome: Outcome) -> runs.Run | None:
    """The run an outcome left, or None where it failed."""
    if outcome.returncode != 0 or not outcome.fingerprint.exists():
        return None
    try:
        return runs.read(outcome.fingerprint, outcome.launch.label)
    except (UnidistError, ValueError):
        return None


def _rerun_difference(first: runs.Run, again: runs.Run, env: envelope.Envelope) -> tuple[float, float]:
    """How far a second run of one launch lands from its first over the steps both made: the largest relative
    difference, and the largest as a share of the rounding bound there (the re-run carries probes, whose extra
    autograd nodes may sum a gradient in another order: a difference within rounding is not nondeterminism)."""
    worst, ratio = 0.0, 0.0
    for i, (a, b) in enumerate(zip(again.steps, first.steps, strict=False)):
        for q in ("loss", "grad_norm"):
            d = envelope.rel(a.get(q), b.get(q)) or 0.0
            worst, ratio = max(worst, d), max(ratio, d / env.bound(q, i) if d else 0.0)
        for name, value in (b.get("params") or {}).items():
            d = envelope.param_diff((a.get("params") or {}).get(name), value)
            worst, ratio = max(worst, d), max(ratio, d / env.bound("params", i, name) if d else 0.0)
    return worst, ratio


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
