"""Building a model partitioned (``zero.Init``) beside building it whole: each rank's peak memory and the time.

    python benchmarks/partitioned_build.py --ranks 2 --layers 12 --width 768

A script beside the package, not in ``unidist.bench``: it imports the compat layer and transformers.

Each launch runs this file (``--child``) with ``--ranks`` processes and builds a Hugging Face GPT-2 from a config
(``--layers`` blocks of ``--width``, vocabulary 50257; its ``post_init`` re-initialises every weight):

- ``whole``: built as usual (mpiexec, unidist's mpi backend);
- ``unidist``: inside ``unidist.compat.deepspeed.zero.Init`` (mpiexec: unidist's own partitioned build);
- ``deepspeed``: inside real DeepSpeed's ``deepspeed.zero.Init`` (the deepspeed launcher).

Each rank reports its peak resident memory growth over the build (VmHWM after it minus VmRSS before it, from
/proc/self/status) and the build's seconds; the table gives the largest rank's, and the model's float32 bytes.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout's unidist, also when a launcher runs this file

__all__ = ["main"]

KINDS = ("whole", "unidist", "deepspeed")


def _status(key: str) -> int:
    """A /proc/self/status figure in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


def child(kind: str, out: Path, layers: int, width: int) -> None:
    """One rank of one launch (see the module docstring)."""
    import torch
    import torch._dynamo  # noqa: F401  - imported inside DeepSpeed's Init (by transformers), its polyfills refuse
    import transformers                #   the torch.Tensor.__new__ Init patches in (a TypeError on torch 2.13)

    if kind == "deepspeed":
        import deepspeed

        deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # its inference op: a JIT build, unused
    else:
        import unidist.compat.deepspeed as deepspeed  # type: ignore[no-redef]
    deepspeed.init_distributed(dist_backend="gloo")
    rank = deepspeed.comm.get_rank()
    transformers.logging.set_verbosity_error()
    config = transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64)
    ds_config = {"train_batch_size": 8, "zero_optimization": {"stage": 3}}
    torch.manual_seed(0)
    before = _status("VmRSS")
    start = time.perf_counter()
    with deepspeed.zero.Init(config_dict_or_path=ds_config, enabled=kind != "whole"):
        model = transformers.GPT2LMHeadModel(config)
    seconds = time.perf_counter() - start
    numel = sum(getattr(p, "ds_numel", p.numel()) for p in model.parameters())  # DeepSpeed's are empty: ds_numel
    (out / f"{kind}-{rank}.json").write_text(json.dumps({"peak": _status("VmHWM") - before, "s": seconds,
                                                          "bytes": numel * 4}))


def _launch(kind: str, n: int, out: Path, extra: list[str]) -> None:
    me = [sys.executable, __file__, "--child", kind, "--out", str(out), *extra]
    if kind == "deepspeed":
        argv = [str(Path(sys.executable).with_name("deepspeed")), "--num_gpus", str(n), *me[1:]]
    else:
        argv = ["mpiexec", "-n", str(n), *me]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "UNIDIST_DEVICE": "cpu"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{kind} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--child", choices=KINDS)
    p.add_argument("--out", type=Path)
    p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher appends it
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.out, args.layers, args.width)
        return 0
    extra = ["--layers", str(args.layers), "--width", str(args.width)]
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for kind in KINDS:
            _launch(kind, args.ranks, Path(tmp), extra)
            got = [json.loads(Path(tmp, f"{kind}-{r}.json").read_text()) for r in range(args.ranks)]
            rows.append((kind, max(g["peak"] for g in got), max(g["s"] for g in got), got[0]["bytes"]))
    mib = 2 ** 20
    print(f"GPT-2 ({args.layers} layers, width {args.width}) built by {args.ranks} ranks; model {rows[0][3] / mib:.0f}"
          " MiB in float32")
    print("| build | peak memory growth, largest rank (MiB) | of the model | seconds |")
    print("|---|---|---|---|")
    for kind, peak, seconds, model in rows:
        print(f"| {kind} | {peak / mib:.0f} | {peak / model:.2f} | {seconds:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
