"""prepare(precision=) under any launcher: every mode at ZeRO stages 0-3 against one process with plain torch.

The model, batches and magnitudes are tests/workers/zero.py's (gradient norms far above 1). The reference is one
process on the whole batch with ``torch.autocast`` around the forward (mixed modes), a bfloat16 model
(bf16-true; bf16-master with the optimizer stepping float32 copies written back each step),
and ``torch.amp.GradScaler`` with the same parameters (fp16). For fp16 an inf is injected into the
loss of the last rank only (the reference: into its whole-batch loss) at ``INF_STEPS``: every rank must skip
exactly those steps, and the loss-scale sequence must be GradScaler's. Cases:

- ``<mode>/stage<s>``: SGD with momentum, every mode and stage;
- ``fp16-mixed+clip_k2/stage<s>``: fp16 with ``clip_grad_norm=0.5`` (norms are far above it), 2 accumulation
  passes and StepLR;
- ``fp16-mixed+resume/stage<s>``: 3 steps, a checkpoint, a fresh prepare that loads it, 3 more steps: equal to
  6 uninterrupted steps (the loss scale and its growth tracker resumed);
- ``bf16-master+resume/stage<s>``: the same with master copies: the resumed run's weights equal the uninterrupted
  run's exactly (``vs_uninterrupted``) only if the checkpoint kept the float32 copies, not the rounded weights.

Writes ``<out>/rank<R>.json``: per case the max |w - w_ref|, the spread across ranks, the per-step
(loss scale, skipped) sequence and the reference's.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from pathlib import Path
from typing import Any

import torch
from common import max_diff, spread
from zero import BATCH, make_model  # tests/workers/zero.py: this script's directory is on sys.path

import unidist

STEPS = 6
INF_STEPS = (2, 4)
SCALING = {"init_scale": 256.0, "growth_interval": 2}  # grows within the run, far from fp16 overflow
MODES = ("32", "bf16-mixed", "fp16-mixed", "bf16-true", "bf16-master")
AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, 64, generator=g) * 3, torch.randn(BATCH, 8, generator=g) * 10


def make_opt(model: torch.nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def loss_of(out: torch.Tensor, y: torch.Tensor, step: int, poison: bool) -> torch.Tensor:
    """The loss; times inf at ``INF_STEPS`` where ``poison`` (fp16 runs, the last rank)."""
    loss = torch.nn.functional.mse_loss(out.float(), y)
    return loss * float("inf") if poison and step in INF_STEPS else loss


def reference(mode: str, steplr: bool, k: int, clip: float | None, device: torch.device
              ) -> tuple[dict[str, torch.Tensor], list[Any]]:
    """One process, whole batch, plain torch (autocast + GradScaler) on ``device`` (the ranks' device: on a GPU
    ``torch.autocast("cuda")`` and ``GradScaler("cuda")``)."""
    model = make_model().to(device)
    if mode in ("bf16-true", "bf16-master"):
        model = model.to(torch.bfloat16)
    # bf16-master: the optimizer steps float32 copies made from the bfloat16 weights, written back each step
    masters = [torch.nn.Parameter(p.detach().float()) for p in model.parameters()] if mode == "bf16-master" else []
    opt = make_opt(torch.nn.ParameterList(masters) if masters else model)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if steplr else None
    scaler = torch.amp.GradScaler(device.type, **SCALING, enabled=mode == "fp16-mixed")  # type: ignore[arg-type]
    seq: list[Any] = []
    for step in range(STEPS):
        x, y = (t.to(device) for t in batch(step))
        for part in range(k):
            rows = slice(part * BATCH // k, (part + 1) * BATCH // k)
            with torch.autocast(device.type, dtype=AUTOCAST.get(mode, torch.bfloat16), enabled=mode in AUTOCAST):
                out = model(x[rows].to(torch.bfloat16) if mode in ("bf16-true", "bf16-master") else x[rows])
            scaler.scale(loss_of(out, y[rows], step, mode == "fp16-mixed") / k).backward()
        if clip is not None:
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        before = scaler.get_scale() if mode == "fp16-mixed" else 1.0
        for p, m in zip(model.parameters(), masters, strict=False):  # no masters: none
            m.grad = p.grad.float()
        scaler.step(opt)
        scaler.update()
        with torch.no_grad():
            for p, m in zip(model.parameters(), masters, strict=False):  # no masters: none
                p.copy_(m)
        model.zero_grad()
        after = scaler.get_scale() if mode == "fp16-mixed" else 1.0
        seq.append([after, after < before])
        opt.zero_grad()
        if sched is not None:
            sched.step()
    return {k: v.cpu() for k, v in model.state_dict().items()}, seq


def train(mgr: Any, mode: str, stage: int, steplr: bool, k: int, clip: float | None, tmp: Path | None
          ) -> tuple[dict[str, torch.Tensor], list[Any]]:
    extra = {"loss_scaling": SCALING} if mode == "fp16-mixed" else {}

    def fresh() -> tuple[Any, Any, Any]:
        model = make_model()
        opt = make_opt(model)
        model, opt = mgr.prepare(model, opt, zero_stage=stage, precision=mode, backward_passes_per_step=k,
                                 clip_grad_norm=clip, **extra)
        sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5) if steplr else None
        return model, opt, sched

    model, opt, sched = fresh()
    seq: list[Any] = []
    poison = mode == "fp16-mixed" and mgr.rank == mgr.size - 1
    for step in range(STEPS):
        if tmp is not None and step == STEPS // 2:  # resume from a checkpoint into a fresh prepare
            mgr.save_checkpoint(tmp, model, opt)
            if hasattr(opt, "remove_hooks"):
                opt.remove_hooks()
            model, opt, sched = fresh()
            mgr.load_checkpoint(tmp, model, opt)
            if sched is not None:
                sched.last_epoch = step - 1
                sched.step()
        x, y = mgr.to_device(batch(step))
        for part in range(k):  # this rank's share of micro-batch `part`
            lo, hi = part * BATCH // k, (part + 1) * BATCH // k
            per = (hi - lo) // mgr.size
            rows = slice(lo + mgr.rank * per, lo + (mgr.rank + 1) * per)
            out = model(x[rows])
            if out.dtype != torch.float32:
                raise TypeError(f"{mode}: the prepared model returned {out.dtype}, not float32")
            mgr.backward(loss_of(out, y[rows], step, poison))
            opt.step()
            opt.zero_grad()
        seq.append([opt.loss_scale, opt.last_step_skipped])
        if sched is not None:
            sched.step()
    full = {k: v.cpu() for k, v in mgr.full_state_dict(model).items()}
    if hasattr(opt, "remove_hooks"):
        opt.remove_hooks()
    return full, seq


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--modes", default=",".join(MODES))
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        results: dict[str, Any] = {}
        done: dict[str, dict[str, torch.Tensor]] = {}
        cases = [(m, s, "", False, 1, None) for m in ns.modes.split(",") for s in range(4)]
        cases += [("fp16-mixed", s, "+clip_k2", True, 2, 0.5) for s in (0, 2, 3)]
        cases += [(m, s, "+resume", False, 1, None) for m in ("fp16-mixed", "bf16-master") for s in (0, 3)
                  if m in ns.modes.split(",")]
        for mode, stage, tag, steplr, k, clip in cases:
            key = f"{mode}{tag}/stage{stage}"
            try:
                tmp = None
                if tag == "+resume":
                    tmp = ns.out / f"ckpt-{stage}"
                got, seq = train(mgr, mode, stage, steplr, k, clip, tmp)
                want, want_seq = reference(mode, steplr, k, clip, mgr.device)
                results[key] = {"diff": max_diff(got, want), "spread": spread(mgr, got), "seq": seq,
                                "want_seq": want_seq}
                if tag == "+resume" and f"{mode}/stage{stage}" in done:  # exactly the uninterrupted run's weights
                    results[key]["vs_uninterrupted"] = max_diff(got, done[f"{mode}/stage{stage}"])
                done[key] = got
            except Exception as err:  # recorded; the other cases still run on every rank
                traceback.print_exc()
                results[key] = {"error": f"{type(err).__name__}: {err}"}
        results["_meta"] = {"backend": mgr.backend, "size": mgr.size}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
