"""prepare(offload="cpu") under any launcher, on the GPU: the same training as no offload, less device memory.

GPT-2 from its config (unidist.bench.gpt, 4x256, vocab 8192: 6.6 M parameters), AdamW, 4 steps at each ZeRO
stage 1-3, once without and once with ``offload="cpu"``. Per stage: the peak device allocation each run adds (CUDA's
``max_memory_allocated`` above what was allocated before it), the Adam state's bytes, the max |w - w_no_offload|
over ``full_state_dict``, where the optimizer state lives (device, pinned) and whether the engine offloaded
(unidist's ZeroOptimizer.offload, or DeepSpeed's ``zero_cpu_offload()``). On a CPU rank (the GPU suite's rehearsal)
the host path is rehearsed and the peaks mean nothing. Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path
from typing import Any

import torch
from common import max_diff

import unidist
from unidist.bench.gpt import GPT2, GPT2Config
from unidist.train import offload

STEPS, BATCH, SEQ, VOCAB = 4, 4, 128, 8192


def run(mgr: Any, stage: int, moved: str | None) -> dict[str, Any]:
    gc.collect()
    cuda = mgr.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(mgr.device)
        torch.cuda.reset_peak_memory_stats(mgr.device)
    base = torch.cuda.memory_allocated(mgr.device) if cuda else 0
    torch.manual_seed(0)
    model = GPT2(GPT2Config(n_layer=4, n_embd=256, n_head=4, vocab=VOCAB, n_positions=SEQ))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt = mgr.prepare(model, opt, zero_stage=stage, offload=moved)
    for step in range(STEPS):
        g = torch.Generator().manual_seed(100 * mgr.rank + step)
        ids = mgr.to_device(torch.randint(0, VOCAB, (BATCH, SEQ), generator=g))
        mgr.backward(model(ids, ids))
        opt.step()
        opt.zero_grad()
    peak = (torch.cuda.max_memory_allocated(mgr.device) - base) if cuda else 0
    inner = getattr(opt, "optimizer", opt)
    state = [v for st in inner.state.values() for v in st.values() if isinstance(v, torch.Tensor) and v.dim()]
    engine = getattr(opt, "engine", None)
    offloaded = bool(getattr(opt, "offload", False)) or bool(engine is not None and engine.zero_cpu_offload())
    full = mgr.full_state_dict(model)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return {"full": full, "peak": peak, "state_bytes": sum(v.numel() * v.element_size() for v in state),
            "state_devices": sorted({str(v.device) for v in state}),
            "state_pinned": all(v.is_pinned() for v in state) if cuda and state else None, "offloaded": offloaded}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        if mgr.device.type == "cpu" and mgr.backend != "deepspeed":
            offload.rehearse_on_cpu()
        report: dict[str, Any] = {"_meta": {"backend": mgr.backend, "device": str(mgr.device), "size": mgr.size}}
        for stage in (1, 2, 3):
            plain = run(mgr, stage, None)
            moved = run(mgr, stage, "cpu")
            report[f"stage{stage}"] = {
                "diff": max_diff(moved.pop("full"), plain.pop("full")),
                "plain": plain, "offload": moved,
            }
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
