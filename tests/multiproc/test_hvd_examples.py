"""Horovod's own PyTorch examples, with only the import line changed, give real Horovod's weights and metrics.

tests/data/horovod_examples/ holds upstream's example scripts (horovod/horovod@2626dc8), adapted only where this
machine forces it (README.md there lists every change). Each case runs the script twice per launch kind: as is,
under REAL Horovod (mpiexec, or plain python for one rank), and as a copy whose single line
``import horovod.torch as hvd`` is replaced by ``import unidist.compat.horovod as hvd``, under a unidist launcher.
Every rank's final weights must match real Horovod's rank by rank (max |w_compat - w_real| over every parameter
and buffer: SGD, Adasum and bfloat16 autocast 1e-5, fp16 compression 1e-3; all measured 0.0, bit for bit), and so
must every number the script printed or logged (timings aside).

The chain is split by environment because real Horovod is installed only in the horovod tox env and DeepSpeed
only in the deepspeed env:

- horovod env (mark horovod): real Horovod against compat under python (1 rank, against real Horovod's 1 rank),
  mpiexec-2, torchrun-2, horovodrun-gloo-2 and UNIDIST_BACKEND=horovod mpiexec-2. Each compat launch runs a
  different case (sampled to keep CI short), every case against its own real-Horovod run.
- deepspeed env (mark deepspeed): compat under the deepspeed launcher against compat under torchrun, same case,
  same tolerance. That closes the chain: the horovod env proves compat-under-torchrun equals real Horovod for the
  ImageNet case, and both launches run the same compat code on torch.distributed's gloo process group (DeepSpeed's
  CPU accelerator uses gloo too), so deepspeed-2 == torchrun-2 == real Horovod. The MNIST example cannot run
  there at all: it does ``import horovod`` for ``horovod.run``, and Horovod is not installed in that env.

Known deliberate difference: unidist's broadcast_optimizer_state does not take Horovod's zero-gradient optimizer
step on a fresh optimizer. For SGD without weight decay that step changes nothing (momentum buffers start from the
first real gradient either way), which is what the MNIST and synthetic cases use; the ImageNet example's SGD has
weight decay, so the step moves every weight by lr * wd * w: the launcher case runs it with --wd 0, and
test_horovods_zero_gradient_step_is_the_only_difference runs the default weight decay with that one step added to
the compat copy, equal to real Horovod. No upstream PyTorch example uses Adam (examples/pytorch/* and
examples/elastic/pytorch/* all use SGD), so Adam's bias correction (where the skipped step does matter) is left
to tests/multiproc/test_hvd_optimizer.py.
"""

from __future__ import annotations

import re
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from helpers import BIN, LAUNCHES, MARKS, Launch, Run, require, run

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "horovod_examples"
REAL_IMPORT = "import horovod.torch as hvd\n"
COMPAT_IMPORT = "import unidist.compat.horovod as hvd\n"
SGD, FP16 = 1e-5, 1e-3
BROADCAST_PARAMETERS = "hvd.broadcast_parameters(model.state_dict(), root_rank=0)"
# What Horovod's broadcast_optimizer_state does first on an optimizer with no state yet: a step of the wrapped
# torch optimizer's own class on all-zero gradients (unidist's deliberately does not)
HOROVODS_ZERO_STEP = ("    for p in model.parameters(): p.grad = torch.zeros_like(p)  # test: Horovod's zero step\n"
                      "    torch.optim.SGD.step(optimizer)\n")


@dataclass(frozen=True)
class Case:
    """One example script with one set of options, and how close compat must come to real Horovod."""

    script: str
    args: tuple[str, ...]
    tolerance: float


CASES = {
    "mnist-sgd": Case("pytorch_mnist.py", (), SGD),
    "mnist-mixed-precision": Case("pytorch_mnist.py", ("--use-mixed-precision",), SGD),
    "imagenet-k2-predivide-fp16": Case("pytorch_imagenet_resnet50.py",
                                       ("--batches-per-allreduce", "2", "--gradient-predivide-factor", "2",
                                        "--fp16-allreduce", "--wd", "0"), FP16),
    "synthetic-adasum": Case("pytorch_synthetic_benchmark.py", ("--use-adasum",), SGD),
}

# (launch id, case id): which compat launch runs which case. One launch per launcher, the options combined where
# a script allows: CI has about two minutes for this file, and each launch costs ~4 s of imports per process.
HOROVOD_ENV = [("local-1", "mnist-sgd"), ("mpiexec-2", "mnist-sgd"), ("torchrun-2", "imagenet-k2-predivide-fp16"),
               ("horovodrun-gloo-2", "mnist-mixed-precision"), ("horovod-under-mpiexec-2", "synthetic-adasum")]
DEEPSPEED_ENV = [("deepspeed-2", "imagenet-k2-predivide-fp16")]


@dataclass
class Outcome:
    """One launch's per-rank records (rank<r>.pt: weights, printed lines, logged scalars) and its wall time."""

    proc: Run
    ranks: dict[int, dict[str, Any]]
    seconds: float


def _script(tmp: Path, case: Case, compat: bool, after_broadcast: str = "") -> Path:
    """The case's script in a fresh directory beside the harness it imports; the compat copy differs from the
    data file by the one import line (replaced textually, exactly once), plus ``after_broadcast`` when a test
    inserts a line after broadcast_parameters on purpose."""
    tmp.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLES / "harness.py", tmp / "harness.py")
    lines = (EXAMPLES / case.script).read_text().splitlines(keepends=True)
    if compat:
        where = [i for i, line in enumerate(lines) if line == REAL_IMPORT]
        if len(where) != 1:
            raise AssertionError(f"{case.script} must contain the line {REAL_IMPORT!r} exactly once")
        lines[where[0]] = COMPAT_IMPORT
        code = [line for line in lines if not line.lstrip().startswith("#")]
        if any("horovod.torch" in line for line in code):
            raise AssertionError(f"{case.script} still names horovod.torch after the replacement")
    if after_broadcast:
        where = [i for i, line in enumerate(lines) if line.strip() == BROADCAST_PARAMETERS]
        if len(where) != 1:
            raise AssertionError(f"{case.script} must call {BROADCAST_PARAMETERS!r} exactly once")
        lines.insert(where[0] + 1, after_broadcast)
    path = tmp / case.script
    path.write_text("".join(lines))
    return path


def _launch(argv: list[str], env: dict[str, str], tmp: Path, size: int) -> Outcome:
    import torch

    start = time.monotonic()
    proc = run(argv, env=env, cwd=tmp, timeout=300)
    seconds = time.monotonic() - start
    out = tmp / "out"
    ranks = {r: torch.load(out / f"rank{r}.pt") for r in range(size) if (out / f"rank{r}.pt").exists()}
    return Outcome(proc, ranks, seconds)


def _args(case: Case, tmp: Path) -> list[str]:
    extra = ["--checkpoint-format", str(tmp / "ckpt" / "checkpoint-{epoch}.pth.tar")] \
        if "imagenet" in case.script else []
    (tmp / "ckpt").mkdir(parents=True, exist_ok=True)
    return [*case.args, *extra, "--out", str(tmp / "out")]


def real_horovod(tmp: Path, case: Case, size: int) -> Outcome:
    """The unmodified data script under real Horovod: plain python for one rank, ``mpiexec -n N`` (Horovod's MPI
    controller) for N. Both were measured bit-identical (weights and every printed line) to horovodrun --gloo -np
    1 / -np 2 on these scripts, and horovodrun takes 10-25 s longer per launch here, which CI cannot spare."""
    path = _script(tmp, case, compat=False)
    argv = [str(BIN / "python"), str(path)] if size == 1 else \
        [str(BIN / "mpiexec"), "-n", str(size), str(BIN / "python"), str(path)]
    return _launch([*argv, *_args(case, tmp)], {}, tmp, size)


def compat(tmp: Path, case: Case, launch: Launch, after_broadcast: str = "") -> Outcome:
    """The compat copy under ``launch``. The deepspeed launcher gets its own --no_local_rank: by default it appends
    --local_rank=N to the script's argv, which Horovod's examples' argparse rejects."""
    path = _script(tmp, case, compat=True, after_broadcast=after_broadcast)
    argv = launch.command(str(path), *_args(case, tmp))
    if launch.backend == "deepspeed":
        argv.insert(argv.index(str(path)), "--no_local_rank")
    return _launch(argv, launch.env, tmp, launch.size)


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:e[-+]?\d+)?")


def _same_lines(got: list[str], want: list[str], tol: float) -> list[str]:
    """Differences between two runs' printed lines: the words must be equal, each number within ``tol`` plus one
    unit in its last printed digit (a rounding flip); timings (img/sec) are not compared."""
    problems = []
    if len(got) != len(want):
        return [f"{len(got)} lines printed, the reference printed {len(want)}"]
    for a, b in zip(got, want, strict=True):
        if _NUMBER.sub("#", a) != _NUMBER.sub("#", b):
            problems.append(f"{a!r} != {b!r}")
            continue
        if "img/sec" in a.lower():
            continue
        for x, y in zip(_NUMBER.findall(a), _NUMBER.findall(b), strict=True):
            unit = 10.0 ** -len(x.split(".")[1]) if "." in x else 0.0
            if abs(float(x) - float(y)) > tol + unit:
                problems.append(f"{a!r} vs {b!r}")
                break
    return problems


def compare(got: Outcome, want: Outcome, size: int, tol: float) -> float:
    """Assert rank-by-rank equality of two runs; return the max weight difference over ranks and entries."""
    assert got.proc.returncode == 0, got.proc.describe()
    assert want.proc.returncode == 0, want.proc.describe()
    assert sorted(got.ranks) == sorted(want.ranks) == list(range(size)), (got.proc.describe(), want.proc.describe())
    worst = 0.0
    for rank in range(size):
        a, b = got.ranks[rank], want.ranks[rank]
        assert a["state"].keys() == b["state"].keys()
        for name, value in a["state"].items():
            ref = b["state"][name]
            if not value.is_floating_point():
                assert value.equal(ref), (rank, name)  # e.g. batch norm's num_batches_tracked
                continue
            worst = max(worst, (value.double() - ref.double()).abs().max().item())
        assert not _same_lines(a["printed"], b["printed"], tol), (rank, _same_lines(a["printed"], b["printed"], tol))
        assert len(a["scalars"]) == len(b["scalars"]), rank
        for (tag, x, step), (tag2, y, step2) in zip(a["scalars"], b["scalars"], strict=True):
            assert (tag, step) == (tag2, step2) and abs(x - y) <= tol, (rank, tag, step, x, y)
    assert worst <= tol, f"max |w_compat - w_real| = {worst:.3g} > {tol:g}"
    return worst


def _report(label: str, got: Outcome, want: Outcome, worst: float) -> None:
    print(f"\n{label}: max|dw|={worst:.3g} compat {got.seconds:.1f}s, reference {want.seconds:.1f}s")


_REAL: dict[tuple[str, int], Outcome] = {}


@pytest.mark.parametrize(("launch_id", "case_id"), [pytest.param(launch, case, marks=MARKS["horovod"],
                                                            id=f"{launch}-{case}") for launch, case in HOROVOD_ENV])
def test_example_equals_real_horovod(launch_id: str, case_id: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    launch, case = LAUNCHES[launch_id], CASES[case_id]
    require("horovod", *launch.engines)
    key = (case_id, launch.size)
    if key not in _REAL:  # one real-Horovod run per case and size, shared by the launches that compare with it
        _REAL[key] = real_horovod(tmp_path_factory.mktemp(f"real-{case_id}-{launch.size}"), case, launch.size)
    got = compat(tmp_path_factory.mktemp(f"compat-{launch_id}-{case_id}"), case, launch)
    worst = compare(got, _REAL[key], launch.size, case.tolerance)
    _report(f"{launch_id} {case_id} vs real Horovod", got, _REAL[key], worst)


@pytest.mark.parametrize(("launch_id", "case_id"), [pytest.param(launch, case, marks=MARKS["deepspeed"],
                                                            id=f"{launch}-{case}") for launch, case in DEEPSPEED_ENV])
def test_example_under_deepspeed_equals_torchrun(launch_id: str, case_id: str,
                                                 tmp_path_factory: pytest.TempPathFactory) -> None:
    launch, case = LAUNCHES[launch_id], CASES[case_id]
    require(*launch.engines)
    reference = compat(tmp_path_factory.mktemp(f"torchrun-{case_id}"), case, LAUNCHES["torchrun-2"])
    got = compat(tmp_path_factory.mktemp(f"compat-{launch_id}-{case_id}"), case, launch)
    worst = compare(got, reference, launch.size, case.tolerance)
    _report(f"{launch_id} {case_id} vs compat under torchrun-2", got, reference, worst)


@MARKS["horovod"]
def test_horovods_zero_gradient_step_is_the_only_difference(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The ImageNet example with its default weight decay (5e-5): there Horovod's zero-gradient step on the fresh
    optimizer is not a no-op (SGD adds wd * w to the zero gradient, so the step moves each weight by lr * wd * w
    and leaves wd * w in the momentum buffer). Measured here: compat with only the import changed ends
    2.6e-5 away from real Horovod (batch norm weights start at 1.0), over the SGD tolerance. With that one step
    written into the compat copy right after broadcast_parameters (as Horovod takes it inside
    broadcast_optimizer_state) the two are equal within the SGD tolerance (measured bit for bit): the step is the
    whole difference."""
    launch, case = LAUNCHES["mpiexec-2"], Case("pytorch_imagenet_resnet50.py", ("--batches-per-allreduce", "2"), SGD)
    require("horovod", *launch.engines)
    want = real_horovod(tmp_path_factory.mktemp("real-imagenet-wd"), case, launch.size)
    got = compat(tmp_path_factory.mktemp("compat-imagenet-wd-zero-step"), case, launch, HOROVODS_ZERO_STEP)
    worst = compare(got, want, launch.size, case.tolerance)
    _report("mpiexec-2 imagenet-k2 (weight decay) + Horovod's zero step vs real Horovod", got, want, worst)
