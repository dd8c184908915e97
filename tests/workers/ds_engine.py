"""The DeepSpeed engine's API, case by case, in one launch (tests/multiproc/test_ds_engine.py).

``--real`` runs the same cases on real DeepSpeed (``import deepspeed``): the reference. Without it,
``unidist.compat.deepspeed`` on whatever launcher started this. Every rank writes ``rank{r}.json``: per case the
final weights (gathered under real ZeRO-3), the losses, the engine's counters and queries.

Cases: ``train/<opt>/s<stage>`` (2 epochs of 4 steps, 2 accumulation steps, WarmupLR, DeepSpeed's default clipping
at 1.0 with gradients of norm ~10-30 so it clips every step); ``nosync/s<stage>`` (a micro-batch inside ``no_sync``
and one outside, then ``step``); ``init/s3`` (the model built inside ``zero.Init``, edited inside
``GatheredParameters``, one epoch at ZeRO-3); with ``--save DIR`` the Adam case's first epoch is checkpointed; with
``--load DIR`` ``resume/s<stage>`` loads it and runs the second epoch.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--real", action="store_true")
p.add_argument("--stages", default="0,1,2,3")
p.add_argument("--save", default=None)
p.add_argument("--load", default=None)
p.add_argument("--offload", action="store_true", help="also offload/s2: ZeRO-2 with offload_optimizer (deepspeed only)")
p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher appends it
args = p.parse_args()

if args.real:
    import deepspeed

    # as unidist's deepspeed manager does: init_distributed would JIT-compile DeepSpeed's CPU shared-memory op
    # (74 s on a clean machine) that only its inference_all_reduce uses; training's collectives are torch's
    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False
else:
    import unidist.compat.deepspeed as deepspeed  # type: ignore[no-redef]

deepspeed.init_distributed()
import torch.distributed as dist  # noqa: E402  (initialized by init_distributed on every launcher)

RANK, SIZE = dist.get_rank(), dist.get_world_size()
HELD: list[float] = []  # the bytes a model built inside zero.Init holds in its parameters' own data, over the whole
OPTS = {"Adam": {"lr": 3e-3, "betas": [0.8, 0.999], "weight_decay": 0.1, "torch_adam": True},
        "SGD": {"lr": 1e-2, "momentum": 0.9, "weight_decay": 1e-3}}


def model_and_data(init: bool = False) -> tuple[torch.nn.Module, Any]:
    """The MLP; ``init``: built inside ``zero.Init`` (partitioned as built), its head then edited as DeepSpeed's
    users do it there, inside ``GatheredParameters(modifier_rank=0)`` (a slice written, a weight scaled)."""
    torch.manual_seed(0)
    with deepspeed.zero.Init(config_dict_or_path=config("Adam", 3), enabled=init):  # its dtype: the config's
        model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
        with deepspeed.zero.GatheredParameters(list(model[2].parameters()), modifier_rank=0), torch.no_grad():
            model[2].weight.mul_(1.5)
            model[2].bias[:2].fill_(0.25)
    if init:
        # DeepSpeed's partitioned parameters are empty: their size is ds_numel
        total = sum(getattr(p, "ds_numel", p.numel()) * p.element_size() for p in model.parameters())
        HELD.append(sum(p.data.untyped_storage().nbytes() for p in model.parameters()) / total)
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8, generator=g) * 3, torch.randint(0, 4, (64,), generator=g))
    return model, data


def config(opt: str, stage: int, gas: int = 2) -> dict[str, Any]:
    return {"train_batch_size": 16, "gradient_accumulation_steps": gas,
            "optimizer": {"type": opt, "params": OPTS[opt]},
            "scheduler": {"type": "WarmupLR",
                          "params": {"warmup_min_lr": 0, "warmup_max_lr": OPTS[opt]["lr"], "warmup_num_steps": 3,
                                     "warmup_type": "linear"}},
            "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True}


def weights(engine: Any) -> dict[str, list[float]]:
    params = list(engine.module.parameters())
    if engine.zero_optimization_stage() == 3:
        with deepspeed.zero.GatheredParameters(params):
            return {k: v.detach().flatten().tolist() for k, v in engine.module.state_dict().items()}
    return {k: v.detach().flatten().tolist() for k, v in engine.module.state_dict().items()}


def norm(engine: Any) -> float | None:
    n = engine.get_global_grad_norm()
    return None if n is None else float(n)


def epoch(engine: Any, loader: Any, rec: dict[str, Any]) -> None:
    for x, y in loader:
        rec.setdefault("first_labels", y.tolist())
        rec["boundary"].append(engine.is_gradient_accumulation_boundary())
        loss = torch.nn.functional.cross_entropy(engine(x), y) * 10  # gradients of norm ~10-30: clipping bites
        back = engine.backward(loss)
        rec["scaled_loss"].append(float(back) / float(loss))
        engine.step()
        rec["losses"].append(float(loss))
        rec["applied"].append(engine.was_step_applied())
        rec["lr"].append(engine.get_lr())
        if engine.was_step_applied():
            rec["norms"].append(norm(engine))


def train(opt: str, stage: int, epochs: int = 2, save: str | None = None, offload: bool = False,
          init: bool = False) -> dict[str, Any]:
    model, data = model_and_data(init)
    cfg = config(opt, stage)
    if offload:  # a key only DeepSpeed's engine honours, handed to it under the deepspeed launcher
        cfg["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, optimizer, loader, sched = deepspeed.initialize(model=model, training_data=data, config=cfg)
    rec: dict[str, Any] = {"boundary": [], "losses": [], "applied": [], "lr": [], "norms": [], "scaled_loss": []}
    rec["queries"] = {
        "train_batch_size": engine.train_batch_size(), "micro": engine.train_micro_batch_size_per_gpu(),
        "gas": engine.gradient_accumulation_steps(), "stage": engine.zero_optimization_stage(),
        "fp16": engine.fp16_enabled(), "bf16": engine.bfloat16_enabled(), "local_rank": engine.local_rank,
        "global_rank": engine.global_rank, "world_size": engine.world_size, "batches": len(loader),
        "is_module": isinstance(engine, torch.nn.Module), "has_optimizer": optimizer is not None,
        "has_scheduler": sched is not None, "lr0": engine.get_lr(),
        "n_parameters": sum(p.numel() for p in engine.parameters()) if stage < 3 else None,
    }
    for e in range(epochs):
        epoch(engine, loader, rec)
        if save is not None and e == 0:
            engine.save_checkpoint(save, client_state={"epoch": 1, "note": "after epoch 1"})
            rec["latest"] = (Path(save) / "latest").read_text()
    rec["counters"] = {"global_steps": engine.global_steps, "global_samples": engine.global_samples,
                       "skipped_steps": engine.skipped_steps}
    engine.train()
    rec["training_flag"] = engine.module.training
    engine.eval()
    rec["eval_flag"] = engine.module.training
    rec["weights"] = weights(engine)
    if init:
        rec["held"] = HELD[-1]
    return rec


def resume(stage: int, load: str) -> dict[str, Any]:
    model, data = model_and_data()
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data, config=config("Adam", stage))
    path, client = engine.load_checkpoint(load)
    rec: dict[str, Any] = {"boundary": [], "losses": [], "applied": [], "lr": [], "norms": [], "scaled_loss": []}
    rec["loaded"] = {"path_tag": Path(path).name, "client_state": client, "global_steps": engine.global_steps,
                     "lr": engine.get_lr()}
    epoch(engine, loader, rec)
    rec["weights"] = weights(engine)
    missing = engine.load_checkpoint(str(Path(load) / "no-such-dir"))
    rec["missing"] = list(missing)
    return rec


FP16 = {"enabled": True, "initial_scale_power": 8, "loss_scale_window": 3, "hysteresis": 2, "min_loss_scale": 1}
OVERFLOW_MICRO_STEPS = {3, 6, 7, 10}  # micro-steps whose loss is made inf/nan (optimizer steps 1, 3 and 5)


def fp16(stage: int) -> dict[str, Any]:
    """DeepSpeed's fp16 section: which steps are skipped, the loss scale after each, the scheduler not stepped on
    skipped steps. Compat only: real DeepSpeed refuses fp16 on a CPU ("Type fp16 is not supported on your
    device"); tests/unit/test_ds_loss_scale.py compares the scale arithmetic with DeepSpeed's own scaler classes."""
    model, data = model_and_data()
    cfg = {**config("Adam", stage), "fp16": FP16}
    engine, _, loader, _ = deepspeed.initialize(model=model, training_data=data, config=cfg)
    rec: dict[str, Any] = {"applied": [], "scale": [], "lr": [], "skipped": []}
    micro = 0
    for _ in range(2):
        for x, y in loader:
            x = x.half() if engine.fp16_enabled() else x  # as DeepSpeedExamples' scripts do
            loss = torch.nn.functional.cross_entropy(engine(x).float(), y)
            if micro in OVERFLOW_MICRO_STEPS:
                loss = loss * float("inf")
            engine.backward(loss)
            engine.step()
            micro += 1
            if engine.is_gradient_accumulation_boundary():  # the step just taken was a window's first micro-step
                continue
            rec["applied"].append(engine.was_step_applied())
            rec["scale"].append(float(engine.loss_scale))
            rec["lr"].append(engine.get_lr())
            rec["skipped"].append(engine.skipped_steps)
    rec["global_steps"] = engine.global_steps
    return rec


def nosync(stage: int) -> dict[str, Any]:
    model, data = model_and_data()
    engine, _, _, _ = deepspeed.initialize(model=model, config=config("SGD", stage, gas=1))
    xs, ys = data.tensors
    lo = RANK * 4
    with engine.no_sync():
        engine.backward(torch.nn.functional.cross_entropy(engine(xs[lo:lo + 4]), ys[lo:lo + 4]))
    engine.backward(torch.nn.functional.cross_entropy(engine(xs[16 + lo:20 + lo]), ys[16 + lo:20 + lo]))
    engine.step()
    return {"weights": weights(engine)}


def main() -> None:
    out: dict[str, Any] = {"_meta": {"rank": RANK, "size": SIZE, "real": args.real,
                                     "env": {k: os.environ.get(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}}}
    stages = [int(s) for s in args.stages.split(",")]
    for i, stage in enumerate(stages):
        for opt in ("Adam", "SGD"):
            if opt == "SGD" and stage % 2:  # SGD on stages 0 and 2: both optimizers, fewer runs
                continue
            save = args.save if (opt == "Adam" and i == 0) else None
            out[f"train/{opt}/s{stage}"] = train(opt, stage, save=save)
        if stage < 2:
            out[f"nosync/s{stage}"] = nosync(stage)
        if stage == 3:  # the model built partitioned (zero.Init), then trained at ZeRO-3
            out["init/s3"] = train("Adam", 3, epochs=1, init=True)
        if stage in (0, 2) and not args.real:
            out[f"fp16/s{stage}"] = fp16(stage)
        if args.load is not None:
            out[f"resume/s{stage}"] = resume(stage, args.load)
    if args.offload:
        out["offload/s2"] = train("Adam", 2, offload=True)
    Path(args.out, f"rank{RANK}.json").write_text(json.dumps(out))


if __name__ == "__main__":
    try:
        main()
    except BaseException as err:
        print(f"rank {RANK}: {type(err).__name__}: {err}", file=sys.stderr)
        raise
