"""DeepSpeedExamples' cifar10_deepspeed.py, with only its import lines changed, gives real DeepSpeed's weights.

tests/data/deepspeed_examples/ holds upstream's script (deepspeedai/DeepSpeedExamples@45b4b71), adapted only where
this machine forces it (README.md there lists every change), and harness.py, which runs it once per case inside
one process per launch. A case is ``<ZeRO stage>-<optimizer>-<gradient clipping>`` (SGD lr 1e-5, Adam lr 1e-4,
fp32, one epoch of 24 steps). The reference is the UNMODIFIED data script under REAL DeepSpeed (``deepspeed
--num_gpus 2``, DS_ACCELERATOR=cpu), every case in one launch; the compat copy differs from it by its three import
lines (``deepspeed`` -> ``unidist.compat.deepspeed``, replaced textually, each exactly once). Every rank's final
weights and every step's loss (and lr, and the global gradient norm where both report one) must match the
reference rank by rank, tighter than the issue's SGD 1e-5 / Adam 1e-4 (TOLERANCE says why and what was measured).
Under plain python (one rank) the script's DistributedSampler covers the whole set, so each step's batch is the
union of the two reference ranks' micro batches: its loss is compared with their mean, its weights with theirs.

The chain is split by environment, as test_hvd_examples.py's: real DeepSpeed exists only in the deepspeed tox env
and Horovod only in the horovod env.

- deepspeed env: the reference against plain torch (the same math written out: test_reference_is_deepspeeds_
  math), then compat under deepspeed-2, torchrun-2, mpiexec-2 and python against the reference. Each launch runs
  four cases, every stage once, both optimizers, both clipping thresholds.
- horovod env: compat under horovodrun-gloo-2 against compat under torchrun-2 for two of the cases torchrun-2 runs
  against real DeepSpeed in the deepspeed env (on horovodrun, Horovod's DistributedOptimizer at stage 0 and
  unidist's ZeRO over Horovod's collectives at 1-3; measured bit-identical to torchrun's), so horovodrun-2 ==
  torchrun-2 == real DeepSpeed. (Measured offline with both installed: horovodrun-2 against real DeepSpeed
  directly gives the torchrun figures.)

The script's gradient_clipping of 1.0 never acts here: its small CNN at PyTorch's initialization has a global
gradient norm of 0.2-0.5 on CIFAR-shaped data (measured on these data; per-sample norms are ~1.3, a 16-sample
mean far less), so half the cases clip at 0.3 instead, where the plain-torch replay shows the threshold cut
some steps and not others.
"""

from __future__ import annotations

import ast
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from helpers import LAUNCHES, MARKS, Launch, Run, require, run, upstream_copy

EXAMPLES = Path(__file__).resolve().parent.parent / "data" / "deepspeed_examples"
SCRIPT = "cifar10_deepspeed.py"
SIBLINGS = ("cifar_data.py", "example_record.py", "harness.py")
IMPORTS = {  # upstream's import line -> the compat copy's (each must occur exactly once)
    "import deepspeed\n": "import unidist.compat.deepspeed as deepspeed\n",
    "from deepspeed.accelerator import get_accelerator\n":
        "from unidist.compat.deepspeed.accelerator import get_accelerator\n",
    "from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n":
        "from unidist.compat.deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer\n",
}
# max |difference| of the final weights: the issue's 1e-5 (SGD) / 1e-4 (Adam) would be weak here, SGD at lr 1e-5
# moves a weight by 3e-5 at most over the run (Adam 2.4e-3). Measured against real DeepSpeed: 0 (compat under the
# deepspeed launcher, which is DeepSpeed; horovodrun against torchrun too), 1.2e-10 / 2.2e-8 (SGD / Adam, torchrun
# and mpiexec: float order of the reduction), 3.7e-9 / 5.7e-8 (python, one rank: a 16-sample mean instead of the
# mean of two 8-sample means). The bounds leave ~20x room and stay 100x under the distance trained.
TOLERANCE = {"SGD": 1e-7, "Adam": 1e-6}
LOSS_TOLERANCE = 2e-6  # per step; measured <= 3.6e-7 (1.5 float32 ulps of a loss near 2.3: the batch mean's order)
SCRIPT_LINE = re.compile(r"^(Finished Training|Accuracy .*)$")  # what the script prints (not DeepSpeed's logs)
NORM_TOLERANCE = 1e-6  # DeepSpeed's reported global gradient norm (~0.3); measured <= 6.3e-8
LR = {"SGD": 1e-5, "Adam": 1e-4}  # harness.LR
STEPS, WARMUP, BATCH = 24, 8, 16  # cifar_data.TRAIN_SIZE / BATCH, harness.WARMUP_STEPS, the script's train_batch_size

# every stage once per launch, both optimizers and both clipping thresholds in each
A = ("0-SGD-1.0", "1-Adam-0.3", "2-SGD-0.3", "3-Adam-1.0")
B = ("0-Adam-0.3", "1-SGD-1.0", "2-Adam-1.0", "3-SGD-0.3")
DEEPSPEED_ENV = {"deepspeed-2": A, "torchrun-2": B, "mpiexec-2": A, "local-1": B}
# against torchrun-2 on two of its B cases (which the deepspeed env checks against DeepSpeed): stage 0 is Horovod's
# DistributedOptimizer, stage 3 unidist's ZeRO over Horovod's collectives, one of each optimizer (CI budget)
HOROVOD_ENV = {"horovodrun-gloo-2": ("0-Adam-0.3", "3-SGD-0.3")}


@dataclass
class Outcome:
    """One launch: the process, each case's per-rank record (example_record: weights, steps) and the wall time."""

    proc: Run
    cases: dict[str, dict[int, dict[str, Any]]]
    seconds: float

    def ranks(self, case: str) -> dict[int, dict[str, Any]]:
        assert self.proc.returncode == 0, self.proc.describe()
        assert case in self.cases, f"case {case} left no record\n{self.proc.describe()}"
        return self.cases[case]


def _copy(tmp: Path, compat: bool) -> Path:
    """The data script (the compat copy: its import lines replaced) with its siblings in a fresh directory."""
    return upstream_copy(EXAMPLES, SCRIPT, SIBLINGS, IMPORTS, tmp, compat) / "harness.py"


def launch_cases(tmp: Path, launch: Launch, cases: tuple[str, ...], compat: bool, flags: tuple[str, ...] = ()
                 ) -> Outcome:
    """Run ``cases`` in one launch of the harness under ``launch`` (the deepspeed launcher's --local_rank=N goes
    through the harness to the script, whose argparse takes it, as upstream runs it). Real DeepSpeed's runs skip
    the JIT build of its shared-memory inference op (harness.skip_shm_comm_build: 74 s on a clean machine), as
    unidist's deepspeed backend does for the compat copy."""
    import torch

    harness = _copy(tmp, compat)
    out = tmp / "out"
    start = time.monotonic()
    extra = [*([] if compat else ["--no-shm-comm"]), *flags]  # flags: the script's own (--moe ...), to every case
    proc = run(launch.command(str(harness), "--out", str(out), "--cases", ",".join(cases), *extra),
               env=launch.env, cwd=tmp, timeout=600)
    seconds = time.monotonic() - start
    records = {case: {r: torch.load(out / case / f"rank{r}.pt") for r in range(launch.size)
                      if (out / case / f"rank{r}.pt").exists()} for case in cases}
    return Outcome(proc, records, seconds)


_REFERENCE: dict[str, Outcome] = {}


def reference(tmp_path_factory: pytest.TempPathFactory) -> Outcome:
    """The unmodified script under real DeepSpeed, every case the deepspeed env compares, in one launch."""
    if "real" not in _REFERENCE:
        cases = tuple(dict.fromkeys(case for group in DEEPSPEED_ENV.values() for case in group))
        _REFERENCE["real"] = launch_cases(tmp_path_factory.mktemp("real-deepspeed"), LAUNCHES["deepspeed-2"],
                                          cases, compat=False)
    return _REFERENCE["real"]


def _max_diff(a: dict[str, Any], b: dict[str, Any]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def compare(got: dict[int, dict[str, Any]], want: dict[int, dict[str, Any]], tol: float) -> tuple[float, float]:
    """Assert a case's runs agree; return (max |dw|, max |dloss|). Equal sizes compare rank by rank; one rank
    against N compares its loss with the mean of the N ranks' (each rank's loss is its micro batch's mean, all
    micro batches the same size) and its weights with each rank's."""
    assert sorted(want) == list(range(len(want))) and sorted(got) == list(range(len(got)))
    dw = max(_max_diff(got[min(r, len(got) - 1)]["weights"], want[r]["weights"]) for r in want)
    if len(got) == len(want):
        pairs = [(s["loss"], t["loss"]) for r in got for s, t in zip(got[r]["steps"], want[r]["steps"], strict=True)]
    else:
        assert len(got) == 1, "compare one rank, or as many as the reference"
        mean = [sum(want[r]["steps"][i]["loss"] for r in want) / len(want) for i in range(len(want[0]["steps"]))]
        pairs = [(s["loss"], m) for s, m in zip(got[0]["steps"], mean, strict=True)]
    assert len(pairs) == len(got) * STEPS, f"{len(pairs) // len(got)} steps recorded per rank, not {STEPS}"
    dloss = max(abs(x - y) for x, y in pairs)
    for r in got:  # the lr after each step (the same WarmupLR everywhere) and the norm where both report one
        for s, t in zip(got[r]["steps"], want[min(r, len(want) - 1)]["steps"], strict=True):
            assert s["lr"] == pytest.approx(t["lr"], rel=1e-12, abs=0), (r, s, t)
            if s.get("grad_norm") is not None and t.get("grad_norm") is not None:
                assert abs(s["grad_norm"] - t["grad_norm"]) <= NORM_TOLERANCE, (r, s, t)
    for r in (r for r in got if "printed" in got[r]):  # (the plain-torch replay prints nothing)
        # "Finished Training" on every rank, then the test accuracies on local rank 0
        printed = [line for line in got[r]["printed"] if SCRIPT_LINE.match(line)]
        assert printed == [line for line in want[r]["printed"] if SCRIPT_LINE.match(line)], (r, printed)
        assert printed[:1] == ["Finished Training"] and (r > 0 or len(printed) == 12), (r, got[r]["printed"])
    assert dw <= tol, f"max |dw| = {dw:.3g} > {tol:g}"
    assert dloss <= LOSS_TOLERANCE, f"max |dloss| = {dloss:.3g} > {LOSS_TOLERANCE:g}"
    return dw, dloss


def _moved(record: dict[int, dict[str, Any]], tol: float) -> float:
    """How far training moved the weights from the seeded start (must dwarf the tolerance)."""
    start = _net()[1]
    moved = _max_diff(record[0]["weights"], start)
    assert moved > 100 * tol, f"the weights moved only {moved:.3g}: the comparison would be trivial"
    return moved


def _net() -> tuple[Any, dict[str, Any]]:
    """The script's own Net class (its source, compiled here: the module imports DeepSpeed) and its start."""
    import torch
    import torch.nn as nn
    import torch.nn.functional as F  # noqa: N812

    tree = ast.parse((EXAMPLES / SCRIPT).read_text())
    node = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == "Net")
    space: dict[str, Any] = {"nn": nn, "F": F, "torch": torch}
    exec(compile(ast.Module([node], []), SCRIPT, "exec"), space)
    torch.manual_seed(0)  # as the script seeds it (its marked line (4))
    net = space["Net"](SimpleNamespace(moe=False))
    return net, {k: v.detach().clone() for k, v in net.state_dict().items()}


def replay(case: str) -> dict[str, Any]:
    """The case in one process of plain torch: the global batches DistributedSampler(seed 0) deals the ranks,
    torch's SGD/AdamW with the script's parameters (DeepSpeed's Adam with weight decay is AdamW), the global
    gradient norm clipped as DeepSpeed clips it, and DeepSpeed's WarmupLR class stepped after each step."""
    import sys

    import torch
    import torch.nn.functional as F  # noqa: N812
    from deepspeed.runtime.lr_schedules import WarmupLR

    sys.path.insert(0, str(EXAMPLES))
    try:
        import cifar_data
    finally:
        sys.path.remove(str(EXAMPLES))
    _, optimizer, clipping = case.split("-")
    net, _ = _net()
    t = cifar_data.transforms
    data = cifar_data.CIFAR10("./data", train=True, transform=t.Compose([t.ToTensor(), t.Normalize((0.5,) * 3,
                                                                                                  (0.5,) * 3)]))
    lr = LR[optimizer]
    opt = torch.optim.SGD(net.parameters(), lr=lr, momentum=0.9) if optimizer == "SGD" else \
        torch.optim.AdamW(net.parameters(), lr=lr, betas=(0.8, 0.999), eps=1e-8, weight_decay=3e-7)
    sched = WarmupLR(opt, warmup_min_lr=0, warmup_max_lr=lr, warmup_num_steps=WARMUP)
    order = torch.randperm(len(data), generator=torch.Generator().manual_seed(0)).tolist()
    losses, norms, lrs = [], [], []
    for i in range(STEPS):
        batch = [data[j] for j in order[i * BATCH:(i + 1) * BATCH]]
        x, y = torch.stack([b[0] for b in batch]), torch.tensor([b[1] for b in batch])
        loss = F.cross_entropy(net(x), y)
        opt.zero_grad()
        loss.backward()
        norms.append(float(torch.nn.utils.clip_grad_norm_(net.parameters(), float(clipping))))
        opt.step()
        sched.step()
        losses.append(loss.item())
        lrs.append(opt.param_groups[0]["lr"])  # what the engine's get_lr() reports after its step
    return {"weights": {k: v.detach().clone() for k, v in net.state_dict().items()},
            "steps": [{"loss": x, "lr": r} for x, r in zip(losses, lrs, strict=True)], "norms": norms}


@MARKS["deepspeed"]
def test_reference_is_deepspeeds_math(tmp_path_factory: pytest.TempPathFactory) -> None:
    """Real DeepSpeed's run of each case equals the plain-torch replay (so the reference is the math the compat
    layer must give, and not, say, a run where the lr stayed 0), DeepSpeed's reported global gradient norms
    (ZeRO stages >= 1; stage 0 reports None in fp32) equal the replay's, and clipping at 0.3 acted on some
    steps but not all."""
    require("deepspeed")
    real = reference(tmp_path_factory)
    assert real.proc.returncode == 0, real.proc.describe()
    print(f"\nreal DeepSpeed, {len(real.cases)} cases in one deepspeed-2 launch: {real.seconds:.1f} s")
    for case in real.cases:
        want, got = replay(case), real.ranks(case)
        tol = TOLERANCE[case.split("-")[1]]
        dw, dloss = compare({0: want}, got, tol)
        reported = [s["grad_norm"] for s in got[0]["steps"]]
        if case.startswith("0-"):
            assert reported == [None] * STEPS
        else:
            assert max(abs(a - b) for a, b in zip(reported, want["norms"], strict=True)) <= NORM_TOLERANCE, \
                (reported, want["norms"])
        clipping = float(case.split("-")[2])
        clipped = sum(n > clipping for n in want["norms"])
        assert (0 < clipped < STEPS) if clipping < 1 else clipped == 0, (case, want["norms"])
        print(f"{case}: replay vs real DeepSpeed max|dw|={dw:.3g} max|dloss|={dloss:.3g}, clipped "
              f"{clipped}/{STEPS} steps, moved {_moved(got, tol):.3g}")


def _compare_cases(launch_id: str, cases: tuple[str, ...], got: Outcome, want: Outcome, against: str) -> None:
    """Every case of ``got`` within its optimizer's tolerance of ``want`` (and the figures printed)."""
    for case in cases:
        tol = TOLERANCE[case.split("-")[1]]
        dw, dloss = compare(got.ranks(case), want.ranks(case), tol)
        print(f"{launch_id} {case} vs {against}: max|dw|={dw:.3g} max|dloss|={dloss:.3g} "
              f"(moved {_moved(got.ranks(case), tol):.3g})")


@pytest.mark.parametrize("launch_id", [pytest.param(k, marks=MARKS["deepspeed"], id=k) for k in DEEPSPEED_ENV])
def test_compat_equals_real_deepspeed(launch_id: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    launch, cases = LAUNCHES[launch_id], DEEPSPEED_ENV[launch_id]
    require("deepspeed", *launch.engines)
    real = reference(tmp_path_factory)
    got = launch_cases(tmp_path_factory.mktemp(f"compat-{launch_id}"), launch, cases, compat=True)
    print(f"\ncompat under {launch_id}: {got.seconds:.1f} s for {len(cases)} cases (reference {real.seconds:.1f} s)")
    _compare_cases(launch_id, cases, got, real, "real DeepSpeed")


@pytest.mark.parametrize("launch_id", [pytest.param(k, marks=MARKS["horovod"], id=k) for k in HOROVOD_ENV])
def test_compat_under_horovodrun_equals_torchrun(launch_id: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    launch, cases = LAUNCHES[launch_id], HOROVOD_ENV[launch_id]
    require(*launch.engines)
    want = launch_cases(tmp_path_factory.mktemp("compat-torchrun-2"), LAUNCHES["torchrun-2"], cases, compat=True)
    got = launch_cases(tmp_path_factory.mktemp(f"compat-{launch_id}"), launch, cases, compat=True)
    print(f"\ncompat under {launch_id}: {got.seconds:.1f} s, under torchrun-2: {want.seconds:.1f} s")
    _compare_cases(launch_id, cases, got, want, "compat under torchrun-2")


# DeepSpeed's bf16 section means a bfloat16 model (parameters, activations, gradients and their averaging in bf16)
# with float32 master weights in its optimizer; unidist.compat.deepspeed runs it as prepare(precision="bf16-master"),
# the same meaning on every backend, and returns the model's outputs in bfloat16 as DeepSpeed's engine does (the
# script's loss is computed from them). Before that mode (autocast over float32 weights) the per-step loss was 0.018
# apart by step 24 and the first step's loss already differed; the issue asks 0.003 of DeepSpeed's printed metrics.
# Measured (ZeRO-2, 2 ranks, 24 steps, Adam and SGD): bit-identical losses and final weights, asserted.
BF16_CASES = ("2-Adam-1.0-bf16", "2-SGD-1.0-bf16")
BF16_LOSS_BOUND = 0.003


@MARKS["deepspeed"]
def test_bf16_section_equals_deepspeed_within_the_issue_bound(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The cifar script's bf16 section at ZeRO-2 under torchrun through the compat layer against real DeepSpeed:
    per-step printed loss within the issue's 0.003, and in fact the same losses and final weights, bit for bit."""
    require("deepspeed", "torch")
    real = launch_cases(tmp_path_factory.mktemp("real-bf16"), LAUNCHES["deepspeed-2"], BF16_CASES, compat=False)
    got = launch_cases(tmp_path_factory.mktemp("compat-bf16"), LAUNCHES["torchrun-2"], BF16_CASES, compat=True)
    for case in BF16_CASES:
        want_ranks, got_ranks = real.ranks(case), got.ranks(case)
        for rank in want_ranks:
            w, g = want_ranks[rank], got_ranks[rank]
            dw = max((g["weights"][k].double() - v.double()).abs().max().item() for k, v in w["weights"].items())
            dloss = [abs(a["loss"] - b["loss"]) for a, b in zip(g["steps"], w["steps"], strict=True)]
            print(f"{case} rank {rank}: max|dw| {dw:.2e}, max|dloss| {max(dloss):.3g}, first step {dloss[0]:.3g}")
            assert max(dloss) <= BF16_LOSS_BOUND, (case, rank, dloss)
            assert dw == 0.0 and max(dloss) == 0.0, (case, rank, dw, dloss)  # DeepSpeed's own bf16 arithmetic


# The script's --moe path: deepspeed.moe.layer.MoE after fc2 (its own fc3 as the expert). Each row: the launch
# compared, the reference launch (real DeepSpeed at the same size), the case, the script's MoE flags. 4 ranks with
# ep_size 2 make expert-data-parallel groups of 2 (gradients summed there, divided by 4); two layers (2 and 4
# experts), top-2 with its Gumbel-sampled second expert and Jitter noise, Residual MoE and DeepSpeed's MoE param
# groups; clipping at 0.3 acts on the first steps (norms ~0.33, each rank's norm averaged, as DeepSpeed's).
# Measured against real DeepSpeed: 4 ranks max|dw| 3.1e-7, max|dloss| 2.4e-7 (mpiexec: reduction order); 2 ranks,
# top-1 with RSample noise: max|dw| 9.3e-10, max|dloss| 2.4e-7 (horovodrun was bit-identical, offline).
# CI runs the 4-rank row; the 2-rank one (passed 2026-11-29) with FULL_MATRIX=1
MOE = (("mpiexec-2", 4, "0-Adam-0.3", ("--moe", "--ep-world-size", "2", "--num-experts", "2", "4", "--top-k", "2",
                                       "--noisy-gate-policy", "Jitter", "--mlp-type", "residual",
                                       "--moe-param-group")),
       *((("torchrun-2", 2, "0-SGD-1.0", ("--moe", "--ep-world-size", "2", "--num-experts", "2",
                                          "--noisy-gate-policy", "RSample")),) if os.environ.get("FULL_MATRIX") == "1"
         else ()))


@MARKS["deepspeed"]
@pytest.mark.parametrize(("launch_id", "size", "case", "flags"), MOE, ids=[f"{m[0][:-2]}-{m[1]}" for m in MOE])
def test_moe_path_equals_real_deepspeed(launch_id: str, size: int, case: str, flags: tuple[str, ...],
                                        tmp_path_factory: pytest.TempPathFactory) -> None:
    launch = LAUNCHES[launch_id].resized(size)
    require("deepspeed", *launch.engines)
    real = launch_cases(tmp_path_factory.mktemp("real-moe"), LAUNCHES["deepspeed-2"].resized(size), (case,),
                        compat=False, flags=flags)
    got = launch_cases(tmp_path_factory.mktemp("compat-moe"), launch, (case,), compat=True, flags=flags)
    want_ranks, got_ranks = real.ranks(case), got.ranks(case)
    assert len(want_ranks) == len(got_ranks) == size
    experts = [k for k in want_ranks[0]["weights"] if ".deepspeed_experts." in k]
    assert experts and sorted(got_ranks[0]["weights"]) == sorted(want_ranks[0]["weights"])
    # the ranks holding other experts trained them apart: the comparison is per rank, not of one shared model
    assert any((want_ranks[0]["weights"][k] - want_ranks[1]["weights"][k]).abs().max() > 0 for k in experts)
    dw, dloss = compare(got_ranks, want_ranks, 2e-6)
    print(f"MoE {launch_id[:-2]}-{size} {case} {' '.join(flags)}: max|dw|={dw:.3g} max|dloss|={dloss:.3g}")
