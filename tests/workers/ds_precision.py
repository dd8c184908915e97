"""prepare(precision=) on DeepSpeed's own engine, ZeRO stages 0-3, against one process with plain torch.

The MLP of tests/workers/zero.py (realistic magnitudes: first gradient norm > 5; DeepSpeed's clip at 1.0 is
pinned off by unidist). Cases, every one in this one launch:

- ``{bf16,fp16}-mixed/stage{0..3}``: the reference is one process on the whole batch under ``torch.autocast``
  (fp16: with ``torch.amp.GradScaler`` of the same parameters). fp16 multiplies rank 1's loss by inf at
  ``INF_STEPS`` (the reference multiplies its loss there): the same steps must be skipped on both ranks, and
  the loss-scale sequence must be the reference GradScaler's.
- ``fp16-partial/stage2``: one parameter's gradient made inf on rank 1 only (a hook), with DeepSpeed's global
  norm check off (``compute_grad_norm: false``): each rank's GradScaler unscales only its partition, so only
  the agreed skip keeps the ranks' decisions (and scales) equal.
- ``fp16-defaults/stage2``: GradScaler's default parameters; the first steps overflow in fp16 and the scale
  must back off (DeepSpeed alone skips them without ever lowering the scale).
- ``bf16-true/stage0``: a bfloat16 model against one process's bfloat16 model; ``bf16-true/stage2`` must be
  refused with an InvalidArgumentError.
- ``fp16-ds-section/stage{0,2}``: a DeepSpeed fp16 section (hysteresis 2, window 2) through
  ``compat.deepspeed.loss_scale.loss_scaling``; the reference is DeepSpeed's own scaler for that stage on the
  same overflow flags (stage 2 with the partial inf: the agreed skip must use hysteresis alike on both ranks).

Writes ``<out>/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import traceback
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from common import max_diff, spread  # tests/workers/common.py: this script's directory is on sys.path

import unidist

try:  # run as a script (tests/workers on sys.path) or imported as workers.ds_precision by the tests
    from zero import BATCH, batch, make_model
except ImportError:
    from workers.zero import BATCH, batch, make_model

STEPS = 10
INF_STEPS = (3, 4, 8)  # rank 1's loss times inf (two in a row: two backoffs)
SCALING = {"init_scale": 2.0**8, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2}
DTYPES = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}
mse = torch.nn.functional.mse_loss


def make_opt(model: torch.nn.Module, groups: bool = False) -> torch.optim.Optimizer:
    if groups:  # two parameter groups: DeepSpeed's ZeRO steps (and calls the GradScaler) once per group
        params = list(model.parameters())
        return torch.optim.SGD([{"params": params[:2]}, {"params": params[2:], "lr": 2e-3}], lr=1e-3, momentum=0.9)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def reference(precision: str, scaling: dict[str, Any] | None, inf_steps: tuple[int, ...], clip: float | None = None,
              k: int = 1, groups: bool = False) -> dict[str, Any]:
    """One process, the whole batch (as k micro-batches when accumulating), plain torch."""
    model = make_model()
    if precision == "bf16-true":
        model.to(torch.bfloat16)
    opt = make_opt(model, groups)
    scaler = torch.amp.GradScaler("cpu", **scaling) if scaling is not None else None
    scales, skipped, first_norm = [], [], 0.0
    for step in range(STEPS):
        x, y = batch(step, 0)
        for part in range(k):
            rows = slice(part * BATCH // k, (part + 1) * BATCH // k)
            if precision == "bf16-true":
                out = model(x[rows].to(torch.bfloat16)).float()
            else:
                with torch.autocast("cpu", dtype=DTYPES[precision]):
                    out = model(x[rows])
            loss = mse(out.float(), y[rows]) / k
            if step in inf_steps:
                loss = loss * math.inf
            (scaler.scale(loss) if scaler is not None else loss).backward()
        before = scaler.get_scale() if scaler is not None else 1.0
        if scaler is not None:
            scaler.unscale_(opt)
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), clip if clip else math.inf)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
            skipped.append(scaler.get_scale() < before)
            scales.append(scaler.get_scale())
        if not first_norm and math.isfinite(float(norm)):
            first_norm = float(norm)
        opt.zero_grad()
    return {"weights": {k: v.float() for k, v in model.state_dict().items()}, "scales": scales,
            "skipped": skipped, "first_norm": first_norm}


def train(mgr: Any, precision: str, stage: int, scaling: dict[str, Any] | None, inf_steps: tuple[int, ...],
          partial: bool = False, clip: float | None = None, k: int = 1, groups: bool = False) -> dict[str, Any]:
    model = make_model()
    opt = make_opt(model, groups)
    extra: dict[str, Any] = {}
    if scaling is not None and scaling != {}:
        extra["loss_scaling"] = scaling
    if partial:  # DeepSpeed's own (global-norm) overflow check off: only the scaler's decides
        extra["deepspeed_config"] = {"zero_optimization": {"compute_grad_norm": False}}
    engine, opt = mgr.prepare(model, opt, zero_stage=stage, precision=precision, clip_grad_norm=clip,
                              backward_passes_per_step=k, **extra)
    zero = opt.zero_optimizer
    # gradients travel in float32: no parameter marked for low-precision reduction, only float32 buckets
    comm = sorted({str(getattr(p, "comm_dtype", p.dtype)) for p in engine.module.parameters()})
    buckets = sorted(str(k) for k in getattr(zero, "ipg_buckets", {})) if zero is not None else []
    last = list(engine.module.parameters())[-1]
    scales, skipped, counts, out_dtypes = [], [], [], set()
    for step in range(STEPS):
        x, y = batch(step, 0)
        for part in range(k):  # each pass: this rank's share of micro-batch `part`
            lo = part * BATCH // k
            share = BATCH // k // mgr.size
            rows = slice(lo + mgr.rank * share, lo + (mgr.rank + 1) * share)
            out = engine(x[rows])
            out_dtypes.add(str(out.dtype))
            loss = mse(out, y[rows])
            hook = None
            if step in inf_steps and mgr.rank == 1:
                if partial:
                    hook = last.register_hook(lambda g: g * math.inf)
                else:
                    loss = loss * math.inf
            mgr.backward(loss)
            if hook is not None:
                hook.remove()
            opt.step()
            opt.zero_grad()
        scales.append(opt.loss_scale)
        skipped.append(opt.last_step_skipped)
        counts.append(opt.skipped_steps)
    full = {k: v.float() for k, v in mgr.full_state_dict(engine).items()}
    apart = spread(mgr, full)
    opt.remove_hooks()
    return {"full": full, "spread": apart, "k": opt.backward_passes_per_step, "scales": scales, "skipped": skipped,
            "counts": counts, "out_dtypes": sorted(out_dtypes), "comm_dtypes": comm, "buckets": buckets,
            "scaler": type(opt.scaler).__name__ if opt.scaler is not None else None}


def resume(mgr: Any, path: Path) -> dict[str, Any]:
    """fp16-mixed at stage 2: the loss scale (and skipped-step count) rides in unidist's checkpoint."""
    model = make_model()
    engine, opt = mgr.prepare(model, make_opt(model), zero_stage=2, precision="fp16-mixed", loss_scaling=SCALING)
    for step in range(5):
        x, y = batch(step, 0)
        loss = mse(engine(x[mgr.rank::mgr.size]), y[mgr.rank::mgr.size])
        mgr.backward(loss * math.inf if step == 4 else loss)  # scales 256 512 512 1024 512
        opt.step()
        opt.zero_grad()
    saved = (opt.loss_scale, opt.skipped_steps)
    mgr.save_checkpoint(path, engine, opt)
    fresh = make_model()
    engine2, opt2 = mgr.prepare(fresh, make_opt(fresh), zero_stage=2, precision="fp16-mixed", loss_scaling=SCALING)
    mgr.load_checkpoint(path, engine2, opt2)
    before = (opt2.loss_scale, opt2.skipped_steps)
    diff = max_diff(mgr.full_state_dict(engine2), mgr.full_state_dict(engine))
    opt.remove_hooks()
    opt2.remove_hooks()
    return {"saved": saved, "loaded": before, "weights": diff, "fresh_scale": SCALING["init_scale"]}


DS_SECTION = {"initial_scale_power": 8, "loss_scale_window": 2, "hysteresis": 2}
DS_INF_STEPS = (1, 2, 3, 7)  # 1 and 7 absorbed by hysteresis at ZeRO, a growth at 6 refills it


def ds_section(mgr: Any, stage: int) -> dict[str, Any]:
    """A DeepSpeed fp16 section's scaling on DeepSpeed's engine, and DeepSpeed's own scaler on the same flags."""
    from deepspeed.runtime.fp16.loss_scaler import CreateLossScaler, LossScaleConfig, LossScaleProfile
    from deepspeed.runtime.fp16.unfused_optimizer import FP16_UnfusedOptimizer
    from deepspeed.runtime.precision_config import DeepSpeedFP16Config

    from unidist.compat.deepspeed.loss_scale import loss_scaling

    got = train(mgr, "fp16-mixed", stage, loss_scaling(DS_SECTION, zero_stage=stage), DS_INF_STEPS,
                partial=stage > 0)
    cfg = DeepSpeedFP16Config(enabled=True, **DS_SECTION)
    if stage:  # ZeRO's scaler (zero/stage_1_and_2.py:722)
        theirs = CreateLossScaler(torch.half, cfg.loss_scale, True, cfg.dynamic_loss_scale_args())
        update, read = theirs.update_scale, lambda: theirs.cur_scale
    else:  # stage 0's fp16 optimizer (engine.py:2555-2609)
        lsc = LossScaleConfig(torch.float16, True, cfg.loss_scale, cfg.dynamic_loss_scale_args(),
                              profile=LossScaleProfile.UNFUSED)
        fp16 = FP16_UnfusedOptimizer(torch.optim.SGD([torch.nn.Parameter(torch.zeros(2, dtype=torch.half))], lr=0.1),
                                     loss_scale_config=lsc, low_precision_dtype=torch.float16, verbose=False)
        update, read = fp16._update_scale, lambda: fp16.loss_scale
    ref = []
    for step in range(STEPS):
        update(step in DS_INF_STEPS)
        ref.append(float(read()))
    return {"scales": got["scales"], "skipped": got["skipped"], "counts": got["counts"], "spread": got["spread"],
            "ref_scales": ref}


@dataclass(frozen=True)
class Case:
    precision: str
    stage: int
    scaling: dict[str, Any] | None = None  # {}: GradScaler's defaults
    inf_steps: tuple[int, ...] = ()
    partial: bool = False
    clip: float | None = None
    k: int = 1
    groups: bool = False


def cases() -> dict[str, Case]:
    out: dict[str, Case] = {}
    for stage in range(4):
        out[f"bf16-mixed/stage{stage}"] = Case("bf16-mixed", stage)
    for stage in range(4):
        out[f"fp16-mixed/stage{stage}"] = Case("fp16-mixed", stage, SCALING, INF_STEPS)
    out["fp16-partial/stage2"] = Case("fp16-mixed", 2, SCALING, INF_STEPS, partial=True)
    out["fp16-defaults/stage2"] = Case("fp16-mixed", 2, {})
    for stage in range(4):  # clipped after unscaling: under ZeRO DeepSpeed clips, with the scaler's scale
        out[f"fp16-clip/stage{stage}"] = Case("fp16-mixed", stage, SCALING, INF_STEPS, clip=0.5)
    out["fp16-k2/stage2"] = Case("fp16-mixed", 2, SCALING, INF_STEPS, k=2)
    for stage in (2, 3):
        out[f"fp16-groups/stage{stage}"] = Case("fp16-mixed", stage, SCALING, INF_STEPS, groups=True)
    out["bf16-clip-k2/stage3"] = Case("bf16-mixed", 3, clip=0.5, k=2)
    out["bf16-true/stage0"] = Case("bf16-true", 0)
    return out


DEFAULTS = {"init_scale": 2.0**16, "growth_factor": 2.0, "backoff_factor": 0.5, "growth_interval": 2000}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        results: dict[str, Any] = {}
        stage0: dict[str, dict[str, torch.Tensor]] = {}
        for key, c in cases().items():
            try:
                got = train(mgr, c.precision, c.stage, c.scaling, c.inf_steps, c.partial, c.clip, c.k, c.groups)
                ref_scaling = None if c.scaling is None else {**DEFAULTS, **c.scaling}
                want = reference(c.precision, ref_scaling, c.inf_steps, c.clip, c.k, c.groups)
                full = got.pop("full")
                family = key.split("/")[0]
                stage0.setdefault(family, full)
                results[key] = {**got, "diff": max_diff(full, want["weights"]), "ref_scales": want["scales"],
                                "vs_stage0": max_diff(full, stage0[family]),
                                "ref_skipped": want["skipped"], "first_norm": want["first_norm"]}
            except Exception as err:  # recorded; the other cases still run on every rank
                traceback.print_exc()
                results[key] = {"error": f"{type(err).__name__}: {err}"}
        try:
            results["fp16-resume/stage2"] = resume(mgr, ns.out / "ckpt")
        except Exception as err:
            traceback.print_exc()
            results["fp16-resume/stage2"] = {"error": f"{type(err).__name__}: {err}"}
        for stage in (0, 2):
            try:
                results[f"fp16-ds-section/stage{stage}"] = ds_section(mgr, stage)
            except Exception as err:
                traceback.print_exc()
                results[f"fp16-ds-section/stage{stage}"] = {"error": f"{type(err).__name__}: {err}"}
        try:
            train(mgr, "bf16-true", 2, None, ())
            results["bf16-true/stage2"] = {"error": None}
        except Exception as err:
            results["bf16-true/stage2"] = {"error": f"{type(err).__name__}: {err}"}
        results["_meta"] = {"backend": mgr.backend, "size": mgr.size}
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
