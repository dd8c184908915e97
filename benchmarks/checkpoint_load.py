"""Loading a GPT-2 124M checkpoint with its AdamW state: unidist's loads of unidist's format and of torch DCP
beside DCP's own load, on one process and on two ranks; each rank's seconds and peak memory growth.

    python benchmarks/checkpoint_load.py            # GPT-2 124M (12 layers, width 768), AdamW after one step

A script beside the package, not in ``unidist.bench``: it builds a Hugging Face GPT-2 from its config (no
download). One process trains one step and saves the model and its optimizer twice: unidist's format
(``save_checkpoint``) and a DCP directory (``save_checkpoint(format="dcp")``, which FSDP2 loads; checked there by
tests/multiproc/test_dcp_interop.py). Then each row is a fresh launch that builds the model and an AdamW, prepares
them, and loads:

- ``unidist <- unidist`` / ``unidist <- dcp``: ``mgr.load_checkpoint`` of each directory (one process at ZeRO 0;
  ``mpiexec -n 2`` at ZeRO 3, each rank reading the slices it holds);
- ``dcp's own``: torch's own resume, ``get_state_dict``, ``dcp.load``, ``set_state_dict`` (one process with
  ``no_dist``; ``torchrun`` 2 with FSDP2, ``fully_shard`` on every block and the root).

Each rank reports the load's seconds, its peak resident memory growth over the load (VmHWM after it minus VmRSS
before it, /proc/self/status) and the peak growth of its anonymous memory alone (RssAnon, sampled every 5 ms: what
the load allocated, without the pages of memory-mapped files, which the kernel can drop); the table gives the
largest rank's.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path[0] = str(Path(__file__).resolve().parents[1])  # the checkout's unidist, also when a launcher runs this file

__all__ = ["main"]

ROWS = (("unidist <- unidist", "unidist", "ck"), ("unidist <- dcp", "unidist", "dcp"), ("dcp's own", "torch", "dcp"))


def _status(key: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(key)


class _AnonPeak:
    """The highest RssAnon seen while the block runs, sampled by a thread every 5 ms."""

    def __enter__(self) -> _AnonPeak:
        self.base = self.peak = _status("RssAnon")
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(0.005):
            self.peak = max(self.peak, _status("RssAnon"))

    def __exit__(self, *exc: object) -> None:
        self.stop.set()
        self.thread.join()
        self.peak = max(self.peak, _status("RssAnon"))


def _model(layers: int, width: int) -> object:
    import torch
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    return transformers.GPT2LMHeadModel(transformers.GPT2Config(n_layer=layers, n_embd=width, n_head=width // 64))


def prepare(where: Path, layers: int, width: int) -> None:
    """One process: one AdamW step, then both checkpoints."""
    import torch

    import unidist

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model = _model(layers, width)
        model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4))  # type: ignore[attr-defined]
        ids = torch.randint(0, 50257, (2, 32))
        mgr.backward(model(ids, labels=ids).loss)
        opt.step()
        mgr.save_checkpoint(where / "ck", model, opt, step=1)
        mgr.save_checkpoint(where / "dcp", model, opt, format="dcp", step=1)


def child(kind: str, source: Path, out: Path, layers: int, width: int) -> None:
    """One rank of one row's launch (see the module docstring)."""
    import torch

    if kind == "unidist":
        import unidist

        with unidist.init() as mgr:
            model = _model(layers, width)
            model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-4),  # type: ignore[attr-defined]
                                     zero_stage=3 if mgr.size > 1 else 0)
            before, start = _status("VmRSS"), time.perf_counter()
            with _AnonPeak() as anon:
                mgr.load_checkpoint(source, model, opt)
            seconds, rank = time.perf_counter() - start, mgr.rank
    else:
        import torch.distributed as dist
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        n = int(os.environ.get("WORLD_SIZE", "1"))
        if n > 1:
            from torch.distributed.fsdp import fully_shard

            dist.init_process_group("gloo")
        model = _model(layers, width)
        if n > 1:
            for block in model.transformer.h:  # type: ignore[attr-defined]
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)  # type: ignore[attr-defined]
        before, start = _status("VmRSS"), time.perf_counter()
        with _AnonPeak() as anon:
            msd, osd = get_state_dict(model, opt)
            state = {"model": msd, "optim": osd, "step": 0}
            dcp.load(state, checkpoint_id=str(source), no_dist=n == 1)
            set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
        seconds, rank = time.perf_counter() - start, dist.get_rank() if n > 1 else 0
        if n > 1:
            dist.destroy_process_group()
    (out / f"{rank}.json").write_text(json.dumps({"peak": _status("VmHWM") - before, "s": seconds,
                                                  "anon": anon.peak - anon.base}))


def _launch(kind: str, n: int, source: Path, out: Path, extra: list[str]) -> list[dict[str, float]]:
    me = [__file__, "--child", kind, "--source", str(source), "--out", str(out), *extra]
    if n == 1:
        argv = [sys.executable, *me]
    elif kind == "unidist":
        argv = ["mpiexec", "-n", str(n), sys.executable, *me]
    else:
        argv = [str(Path(sys.executable).with_name("torchrun")), "--standalone", "--nproc_per_node", str(n), *me]
    env = {**os.environ, "UNIDIST_DEVICE": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=1800)
    if proc.returncode:
        raise SystemExit(f"{kind} x{n} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return [json.loads((out / f"{r}.json").read_text()) for r in range(n)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--child", choices=("unidist", "torch"))
    p.add_argument("--source", type=Path)
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)
    if args.child:
        child(args.child, args.source, args.out, args.layers, args.width)
        return 0
    extra = ["--layers", str(args.layers), "--width", str(args.width)]
    mib = 2 ** 20
    with tempfile.TemporaryDirectory() as tmp:
        where = Path(tmp)
        prepare(where, args.layers, args.width)
        sizes = {d: sum(f.stat().st_size for f in (where / d).iterdir()) for d in ("ck", "dcp")}
        print(f"GPT-2 ({args.layers} layers, width {args.width}) with AdamW state; files: unidist's "
              f"{sizes['ck'] / mib:.0f} MiB, DCP {sizes['dcp'] / mib:.0f} MiB")
        print("| load | ranks | seconds, largest rank | peak memory growth, largest rank (MiB) "
              "| of it anonymous (MiB) |")
        print("|---|---|---|---|---|")
        for label, kind, source in ROWS:
            for n in (1, 2):
                out = where / f"out-{kind}-{source}-{n}"
                out.mkdir()
                got = _launch(kind, n, where / source, out, extra)
                print(f"| {label} | {n} | {max(g['s'] for g in got):.2f} | {max(g['peak'] for g in got) / mib:.0f} "
                      f"| {max(g['anon'] for g in got) / mib:.0f} |", flush=True)
                shutil.rmtree(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
