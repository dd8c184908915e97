"""ZeRO stages 0-3 under any launcher: training equals one process on the full batch and equals stage 0.

A 42k-parameter MLP, targets scaled so gradient norms are far above 1, 5 steps. Variants: sgd (momentum
0.9), adam, adam_clip_k2_steplr (clip_grad_norm=0.5, backward_passes_per_step=2, StepLR), fp16 (compressed
wire), group (data parallel inside ``split(rank % 2)``: each group against one process on its own batch),
adam_offload (adam with ``offload="cpu"`` at stages 1-3: the host path rehearsed on these CPU ranks, except on
DeepSpeed, where a CPU device makes it the no-op; ``vs_base``: against adam at the same stage, expected bitwise).
For every variant and stage: max |w - w_one_process| over the consolidated ``full_state_dict``, the same
against stage 0 of this run, whether ranks agree bitwise, ``full_state_dict`` against the parameters seen
inside ``gathered_parameters``, and ``full_optimizer_state_dict`` against the one-process optimizer's state.
``memory_stats`` (Adam, after the gradient reduction of the last step) for each stage.
Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import unidist

STEPS, BATCH, DIMS = 5, 12, (64, 256, 96, 8)


@dataclass(frozen=True)
class Variant:
    optimizer: str = "sgd"
    clip: float | None = None
    k: int = 1
    steplr: bool = False
    compression: str = "none"
    group: bool = False
    offload: bool = False
    base: str = ""  # the variant this one must equal bitwise at every stage


VARIANTS = {
    "sgd": Variant(), "adam": Variant(optimizer="adam"),
    "adam_clip_k2_steplr": Variant(optimizer="adam", clip=0.5, k=2, steplr=True),
    "fp16": Variant(compression="fp16"), "group": Variant(group=True),
    "adam_offload": Variant(optimizer="adam", offload=True, base="adam"),
}


def make_model() -> torch.nn.Module:
    torch.manual_seed(7)
    a, b, c, d = DIMS
    return torch.nn.Sequential(torch.nn.Linear(a, b), torch.nn.Tanh(), torch.nn.Linear(b, c), torch.nn.Tanh(),
                               torch.nn.Linear(c, d))


def make_opt(v: Variant, model: torch.nn.Module) -> torch.optim.Optimizer:
    if v.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-3)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def batch(step: int, color: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * color + step)
    x = torch.randn(BATCH, DIMS[0], generator=g) * 3
    return x, torch.randn(BATCH, DIMS[-1], generator=g) * 10


def reference(v: Variant, color: int) -> tuple[dict[str, torch.Tensor], dict[str, Any], float]:
    """One process, the whole batch (split into k micro-batches when accumulating, as the ranks do)."""
    model = make_model()
    opt = make_opt(v, model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if v.steplr else None
    first_norm = 0.0
    for step in range(STEPS):
        x, y = batch(step, color)
        for part in range(v.k):
            rows = slice(part * BATCH // v.k, (part + 1) * BATCH // v.k)
            (torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / v.k).backward()
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), v.clip if v.clip else float("inf"))
        first_norm = first_norm or float(norm)
        opt.step()
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return model.state_dict(), opt.state_dict(), first_norm


def train(mgr: Any, v: Variant, stage: int) -> dict[str, Any]:
    dp = mgr.split(mgr.rank % 2) if v.group else None
    comm = dp if dp is not None else mgr
    color = mgr.rank % 2 if v.group else 0
    model = make_model()
    opt = make_opt(v, model)
    model, opt = mgr.prepare(model, opt, zero_stage=stage, clip_grad_norm=v.clip, backward_passes_per_step=v.k,
                             compression=v.compression, group=dp, offload="cpu" if v.offload and stage else None)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if v.steplr else None
    stats: dict[str, int] = {}
    for step in range(STEPS):
        x, y = batch(step, color)
        for part in range(v.k):  # each pass: this rank's share of micro-batch `part`
            lo, hi = part * BATCH // v.k, (part + 1) * BATCH // v.k
            per = (hi - lo) // comm.size
            rows = slice(lo + comm.rank * per, lo + (comm.rank + 1) * per)
            mgr.backward(torch.nn.functional.mse_loss(model(x[rows]), y[rows]))
            if step == STEPS - 1 and part == v.k - 1:
                opt.synchronize()  # gradients reduced: what each stage keeps of them is now in place
                stats = mgr.memory_stats()
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()
    full = mgr.full_state_dict(model)
    with mgr.gathered_parameters(mgr.unwrap(model)):
        seen = {k: v.detach().clone() for k, v in mgr.unwrap(model).state_dict().items()}
    full_opt = mgr.full_optimizer_state_dict(opt)
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    units = getattr(opt, "units", [])
    return {"full": full, "seen": seen, "opt": full_opt, "mem": stats, "comm": comm, "color": color,
            "offloaded": bool(getattr(opt, "offload", False)),
            "prefetch": [sum(u.prefetches for u in units), sum(u.prefetch_hits for u in units)]}


def max_diff(a: dict[Any, Any], b: dict[Any, Any]) -> float:
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in b)


def opt_diff(got: dict[str, Any], want: dict[str, Any]) -> float:
    worst = 0.0
    for i, st in want["state"].items():
        for key, value in st.items():
            if isinstance(value, torch.Tensor) and value.dim() > 0:
                worst = max(worst, float((got["state"][i][key].float() - value.float()).abs().max()))
            elif got["state"][i][key] != value and float(got["state"][i][key]) != float(value):
                return float("inf")  # a step count differs
    return worst


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        if mgr.backend != "deepspeed":
            from unidist.train import offload
            offload.rehearse_on_cpu(mgr.device.type == "cpu")
        results: dict[str, Any] = {}
        fulls: dict[str, dict[str, torch.Tensor]] = {}
        for name in ns.variants.split(","):
            v = VARIANTS[name]
            want: dict[int, tuple[Any, Any, float]] = {}
            stage0: dict[str, torch.Tensor] = {}
            for stage in range(4):
                key = f"{name}/stage{stage}"
                try:
                    got = train(mgr, v, stage)
                    color = got["color"]
                    if color not in want:
                        want[color] = reference(v, color)
                    ref_w, ref_opt, norm = want[color]
                    flat = torch.cat([t.reshape(-1).float() for t in got["full"].values()])
                    spread = got["comm"].allreduce(flat, "max") - got["comm"].allreduce(flat, "min")
                    if stage == 0:
                        stage0 = got["full"]
                    fulls[key] = got["full"]
                    base = fulls.get(f"{v.base}/stage{stage}") if v.base else None
                    results[key] = {
                        "diff": max_diff(got["full"], ref_w), "vs_stage0": max_diff(got["full"], stage0),
                        "spread": float(spread.abs().max()), "seen_vs_full": max_diff(got["seen"], got["full"]),
                        "opt_diff": opt_diff(got["opt"], ref_opt), "first_norm": norm, "mem": got["mem"],
                        "vs_base": None if base is None else max_diff(got["full"], base), "offloaded": got["offloaded"],
                        "prefetch": got["prefetch"],
                    }
                except Exception as err:  # recorded; the other stages still run on every rank
                    traceback.print_exc()
                    results[key] = {"error": f"{type(err).__name__}: {err}"}
        numel = sum(p.numel() for p in make_model().parameters())
        results["_meta"] = {"backend": mgr.backend, "size": mgr.size, "numel": numel, "overlaps": mgr.overlaps}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
