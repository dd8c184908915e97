"""Run cifar10_deepspeed.py several times in one process: one launch, several (stage, optimizer) cases.

A launch costs seconds of imports per process (about 8 s under the deepspeed launcher), a case a second or two,
so the test starts each launcher once and this module runs the script once per case, as ``python
cifar10_deepspeed.py <case's flags>`` would (runpy with the case's sys.argv, ``__name__ == "__main__"``), each
case writing to its own directory (example_record.OUT_ENV). Whatever this process was given beyond its own
options (the deepspeed launcher's ``--local_rank=N``) goes on to every case, as it would to the script.

    python harness.py --out DIR --cases 0-SGD-1.0,3-Adam-0.3 [--script cifar10_deepspeed.py] [--no-shm-comm]

A case is ``<stage>-<optimizer>-<gradient clipping>[-<dtype>]``; the lr is the test's for that optimizer (SGD 1e-5,
Adam 1e-4). Every case trains one epoch with an 8-step warmup, in fp32 unless the case names the script's
``--dtype`` (``bf16``: the test that states how far the compat layer's bf16 is from DeepSpeed's).
"""

from __future__ import annotations

import argparse
import os
import runpy
import sys
import time
from pathlib import Path

import example_record

LR = {"SGD": 1e-5, "Adam": 1e-4}
# Plain "Adam" makes real DeepSpeed JIT-compile FusedAdam for the CPU: measured here 490 s the first time (a clean
# CI machine, every launch of a fresh env) and 24 s per launch from the cache, so the cases ask for torch's AdamW
# ("torch_adam": true, the same math) unless UNIDIST_TEST_FUSED_ADAM=1
TORCH_ADAM = os.environ.get("UNIDIST_TEST_FUSED_ADAM") != "1"
WARMUP_STEPS = 8  # of the 24 steps: the lr rises over a third of the run, then holds (upstream warms up over 1000)


def case_argv(script: str, case: str, passthrough: list[str]) -> list[str]:
    """The script's command line for one case."""
    stage, optimizer, clipping, *rest = case.split("-")
    if optimizer not in LR:
        raise ValueError(f"optimizer {optimizer!r} in case {case!r}: one of {sorted(LR)}")
    dtype = rest[0] if rest else "fp32"  # <stage>-<optimizer>-<clipping>[-bf16]
    return [script, "--epochs", "1", "--dtype", dtype, "--stage", stage, "--optimizer", optimizer,
            "--lr", repr(LR[optimizer]), "--warmup-steps", str(WARMUP_STEPS), "--gradient-clipping", clipping,
            *(["--torch-adam"] if optimizer == "Adam" and TORCH_ADAM else []), *passthrough]


def skip_shm_comm_build() -> None:
    """Mark real DeepSpeed's CPU shared-memory comm op unavailable, as unidist's deepspeed manager does
    (unidist/engines/deepspeed/manager.py). deepspeed.init_distributed JIT-compiles it on first use (measured here: 74 s
    on a clean extensions cache, as on every fresh CI machine), and only DeepSpeed's inference_all_reduce uses it
    (deepspeed/comm/torch.py build_shm_op / inference_all_reduce): training's collectives are torch.distributed's
    either way, so the script's math is unchanged."""
    import deepspeed

    compatible = getattr(getattr(deepspeed, "ops", None), "__compatible_ops__", None)
    if isinstance(compatible, dict):
        compatible["deepspeed_shm_comm"] = False


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, help="each case writes <out>/<case>/rank<r>.pt")
    parser.add_argument("--cases", required=True, help="comma-separated <stage>-<optimizer>-<clipping>")
    parser.add_argument("--script", default=str(Path(__file__).with_name("cifar10_deepspeed.py")))
    parser.add_argument("--no-shm-comm", action="store_true", help="real DeepSpeed: skip the shm op's JIT build")
    args, passthrough = parser.parse_known_args()
    if args.no_shm_comm:
        skip_shm_comm_build()
    for case in args.cases.split(","):
        os.environ[example_record.OUT_ENV] = os.path.join(args.out, case)
        sys.argv = case_argv(args.script, case, passthrough)
        start = time.monotonic()
        runpy.run_path(args.script, run_name="__main__")
        print(f"harness: case {case} took {time.monotonic() - start:.2f} s", flush=True)


if __name__ == "__main__":
    main()
