"""Checkpoints real DeepSpeed and real FSDP2 + torch DCP wrote, resumed by unidist (tests/multiproc/test_ds_interop.py,
test_dcp_interop.py).

    --phase write  (real DeepSpeed, under the deepspeed launcher): for each (stage, precision) of --cases, a fresh
                   engine trains SAVE_AT steps, ``engine.save_checkpoint(DIR/<case>, client_state={"step": ...})``,
                   records what it saved through DeepSpeed's own calls (``safe_get_full_fp32_param`` and
                   ``safe_get_full_optimizer_state``: each weight's float32 master and its Adam moments) and goes on
                   to step STEPS, recording its final float32 weights: the writer's own continuation.
    --phase write-dcp (torch's FSDP2 under torchrun, torchtitan's way): the model sharded with ``fully_shard``,
                   AdamW, ``clip_grad_norm_``; at SAVE_AT ``dcp.save({"model", "optim"} of get_state_dict, "step",
                   "note")`` into DIR/dcp-fp32, what it saved and its final weights recorded through
                   ``get_model_state_dict``/``get_optimizer_state_dict`` with full_state_dict=True.
    --phase write-unidist-dcp (unidist on any launcher, at --stage): trains SAVE_AT steps, saves
                   ``format="dcp"`` into DIR/unidist-dcp, records what it saved and goes on to STEPS, recording its
                   final weights: the reference for
    --phase resume-fsdp2 (torch's FSDP2 under torchrun, its own resume): ``get_state_dict`` of a fresh sharded
                   model, ``dcp.load``, ``set_state_dict``, then the same steps; writes what it loaded and where it
                   ends against the unidist run's record.
    --phase resume (unidist on any launcher): for each case, a fresh model prepared at --stage (precision
                   "bf16-master" for a bf16 case, as DeepSpeed's bf16 keeps float32 masters), started elsewhere,
                   ``mgr.load_checkpoint(DIR/<case>)`` (the parent with ``latest``), then the same steps; writes
                   per case max |loaded - saved| (weights, Adam moments), the step and client state read back, and
                   max |final - the writer's final|. ``--compat``: the DeepSpeed script's own resume instead, the
                   writer's config at --stage through ``unidist.compat.deepspeed`` and ``engine.load_checkpoint``.

The model has what DeepSpeed's files treat apart: an embedding tied to the output layer (``shared_params``), a
LayerNorm, a buffer. Gradients are large (targets of scale 10) and both sides clip at 1.0, DeepSpeed's default.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

import torch
from ckpt_interop_model import VOCAB, build

SAVE_AT, STEPS, BATCH = 3, 6, 12
LR, BETAS, EPS, WD, CLIP = 1e-2, (0.9, 0.99), 1e-8, 0.01, 1.0

p = argparse.ArgumentParser()
p.add_argument("--phase", choices=["write", "write-dcp", "resume", "write-unidist-dcp", "resume-fsdp2",
                                   "resume-deepspeed"], required=True)
p.add_argument("--dir", type=Path, required=True)
p.add_argument("--cases", default="0-fp32,1-bf16,2-fp32,2-fp16,3-bf16")
p.add_argument("--stage", type=int, default=0)
p.add_argument("--out", type=Path)
p.add_argument("--compat", action="store_true", help="write or resume through unidist.compat.deepspeed")
p.add_argument("--local_rank", type=int, default=-1)  # the deepspeed launcher appends it
args = p.parse_args()


def batch(step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, VOCAB, (BATCH, 5), generator=g), torch.randn(BATCH, 5, VOCAB, generator=g) * 10


def loss_of(model: Any, step: int, rank: int, size: int) -> torch.Tensor:
    x, y = batch(step)
    per = BATCH // size
    rows = slice(rank * per, (rank + 1) * per)
    out = model(x[rows])
    return torch.nn.functional.mse_loss(out.float(), y[rows])


def config(stage: int, precision: str, size: int) -> dict[str, Any]:
    out: dict[str, Any] = {"train_micro_batch_size_per_gpu": BATCH // size, "gradient_clipping": CLIP,
                           "zero_optimization": {"stage": stage},
                           "optimizer": {"type": "AdamW", "params": {"lr": LR, "betas": list(BETAS), "eps": EPS,
                                                                     "weight_decay": WD, "torch_adam": True}}}
    if precision == "bf16":
        out["bf16"] = {"enabled": True}
    if precision == "fp16":  # a fixed scale: a dynamic one's first overflow skips a step a float32 resume would take
        out["fp16"] = {"enabled": True, "loss_scale": 128}
    return out


def _deepspeed(compat: bool) -> tuple[Any, Any, Any]:
    """(the deepspeed module, safe_get_full_fp32_param, safe_get_full_optimizer_state): real DeepSpeed's, or
    unidist.compat.deepspeed's (on any launcher, every stage through the same calls)."""
    if compat:
        import unidist.compat.deepspeed as ds
        from unidist.compat.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    else:
        import deepspeed as ds
        from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

        ds.ops.__compatible_ops__["deepspeed_shm_comm"] = False  # as unidist's deepspeed manager does
    return ds, safe_get_full_fp32_param, safe_get_full_optimizer_state


def write() -> None:
    """Real DeepSpeed's save (``--compat``: unidist.compat.deepspeed's, DeepSpeed's format written off DeepSpeed)."""
    deepspeed, safe_get_full_fp32_param, safe_get_full_optimizer_state = _deepspeed(args.compat)
    deepspeed.init_distributed()
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    for case in args.cases.split(","):
        stage, precision = int(case.split("-")[0]), case.split("-")[1]
        model = build()
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(stage, precision, size))

        def full(engine: Any, stage: int) -> dict[str, torch.Tensor]:  # stage 0 (float32): the parameter itself
            return {n: (safe_get_full_fp32_param(q) if stage or args.compat else q).detach().float().clone().cpu()
                    for n, q in engine.module.named_parameters()}

        def moments(engine: Any, stage: int, key: str) -> dict[str, torch.Tensor]:
            return {n: (safe_get_full_optimizer_state(q, key) if stage or args.compat
                        else engine.optimizer.state[q][key]).detach().clone().cpu()
                    for n, q in engine.module.named_parameters()}

        for step in range(STEPS):
            if step == SAVE_AT:
                engine.save_checkpoint(str(args.dir / case), client_state={"step": step, "note": case})
                saved = {"weights": full(engine, stage), **{k: moments(engine, stage, k)
                                                            for k in ("exp_avg", "exp_avg_sq")}}
            engine.backward(loss_of(engine, step, rank, size))
            engine.step()
        final = full(engine, stage)
        if rank == 0:
            torch.save({"saved": saved, "final": final}, args.dir / f"{case}.reference.pt")
        dist.barrier()


def write_dcp() -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    case = "dcp-fp32"
    model = build()
    fully_shard(model.up)
    fully_shard(model.down)
    fully_shard(model)  # the root holds the tied embedding and head
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = [n for n, _ in model.named_parameters()]

    def weights() -> dict[str, torch.Tensor]:
        whole = get_model_state_dict(model, options=full)
        return {n: whole[n].float() for n in names} if rank == 0 else {}

    for step in range(STEPS):
        if step == SAVE_AT:
            msd, osd = get_state_dict(model, opt)
            dcp.save({"model": msd, "optim": osd, "step": step, "note": case}, checkpoint_id=str(args.dir / case))
            whole = get_optimizer_state_dict(model, opt, options=full)  # rank 0's; {} elsewhere (cpu_offload)
            saved = {"weights": weights(), **{k: {n: whole["state"][n][k] for n in names} if rank == 0 else {}
                                              for k in ("exp_avg", "exp_avg_sq")}}
        loss_of(model, step, rank, size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    final = weights()
    if rank == 0:
        torch.save({"saved": saved, "final": final}, args.dir / f"{case}.reference.pt")
    dist.barrier()
    dist.destroy_process_group()


def resume_compat(real: bool = False) -> None:
    """The DeepSpeed script's resume, on unidist.compat.deepspeed (``real``: on real DeepSpeed, each case at the
    stage it was written at, as DeepSpeed requires): engine.load_checkpoint(dir) reads ``latest``."""
    deepspeed, safe_get_full_fp32_param, safe_get_full_optimizer_state = _deepspeed(not real)
    deepspeed.init_distributed()
    import torch.distributed as dist

    rank, size = dist.get_rank(), dist.get_world_size()
    report: dict[str, Any] = {"backend": "deepspeed" if real else "compat", "size": size}
    for case in args.cases.split(","):
        model = build()
        stage = int(case.split("-")[0]) if real else args.stage
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                               config=config(stage, case.split("-")[1], size))
        _, client = engine.load_checkpoint(str(args.dir / case))
        named = dict(engine.module.named_parameters())
        ref = torch.load(args.dir / f"{case}.reference.pt", weights_only=True)
        got: dict[str, Any] = {"extra_step": client.get("step"), "note": client.get("note"),
                               "global_steps": engine.global_steps, "lr": engine.get_lr()[0]}
        zero = stage or not real  # real DeepSpeed's stage 0 holds float32 weights and the torch optimizer's state

        def weight(q: Any, zero: bool = zero) -> torch.Tensor:
            return (safe_get_full_fp32_param(q) if zero else q).detach().float()

        def moment(q: Any, key: str, zero: bool = zero, engine: Any = engine) -> torch.Tensor:
            return (safe_get_full_optimizer_state(q, key) if zero else engine.optimizer.state[q][key]).detach()

        got["loaded"] = max(float((weight(q) - ref["saved"]["weights"][n]).abs().max())
                            for n, q in named.items())
        for key in ("exp_avg", "exp_avg_sq"):
            # real DeepSpeed 0.19.8 links ZeRO's state fragments at the first step, not at a load (its own
            # checkpoints alike: safe_get_full_optimizer_state raises on the rank owning one, the others wait in
            # its allreduce), so there the continuation below shows the moments loaded
            got[key] = None if real and stage else \
                max(float((moment(q, key) - ref["saved"][key][n]).abs().max()) for n, q in named.items())
        for step in range(engine.global_steps, STEPS):
            engine.backward(loss_of(engine, step, rank, size))
            engine.step()
        got["final"] = max(float((weight(q) - ref["final"][n]).abs().max()) for n, q in named.items())
        got["final_scale"] = max(float(w.abs().max()) for w in ref["final"].values())
        report[case] = got
    (args.out / f"rank{rank}.json").write_text(json.dumps(report))


def resume() -> None:
    import unidist

    with unidist.init() as mgr:
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        for case in args.cases.split(","):
            # DeepSpeed's fp16 (half weights, float32 masters, a loss scale) resumes here in float32
            precision = "bf16-master" if case.endswith("bf16") else "32"
            model = build()
            with torch.no_grad():
                for q in model.parameters():
                    q.add_(1.0)  # a different start: only the checkpoint can make it equal
            opt = torch.optim.AdamW(model.parameters(), lr=0.5, betas=BETAS, eps=EPS, weight_decay=WD)
            model, opt = mgr.prepare(model, opt, zero_stage=args.stage, precision=precision, clip_grad_norm=CLIP)
            extra = mgr.load_checkpoint(args.dir / case, model, opt)
            ref = torch.load(args.dir / f"{case}.reference.pt", weights_only=True)
            loaded = _masters(mgr, model, opt)
            got: dict[str, Any] = {"extra_step": extra.get("step"), "note": extra.get("note"),
                                   # DeepSpeed's counters; a DCP checkpoint's step is the script's own entry
                                   "global_steps": extra.get("deepspeed", {"global_steps": extra.get("step")})[
                                       "global_steps"],
                                   "lr": opt.param_groups[0]["lr"],
                                   "loaded": max(float((loaded[n] - w).abs().max())
                                                 for n, w in ref["saved"]["weights"].items())}
            for key in ("exp_avg", "exp_avg_sq"):
                mine = _state(mgr, model, opt, key)
                got[key] = max(float((mine[n] - w).abs().max()) for n, w in ref["saved"][key].items())
            for step in range(int(extra["step"]), STEPS):
                mgr.backward(loss_of(model, step, mgr.rank, mgr.size))
                opt.step()
                opt.zero_grad()
            final = _masters(mgr, model, opt)
            got["final"] = max(float((final[n] - w).abs().max()) for n, w in ref["final"].items())
            got["final_scale"] = max(float(w.abs().max()) for w in ref["final"].values())
            report[case] = got
        (args.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))


def _fresh_adamw(model: torch.nn.Module, lr: float = LR) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=BETAS, eps=EPS, weight_decay=WD)


def write_unidist_dcp() -> None:
    import unidist

    case = "unidist-dcp"
    with unidist.init() as mgr:
        model = build()
        model, opt = mgr.prepare(model, _fresh_adamw(model), zero_stage=args.stage, clip_grad_norm=CLIP)
        for step in range(STEPS):
            if step == SAVE_AT:
                mgr.save_checkpoint(args.dir / case, model, opt, format="dcp", step=step, note=case)
                saved = {"weights": _masters(mgr, model, opt),
                         **{k: _state(mgr, model, opt, k) for k in ("exp_avg", "exp_avg_sq")}}
            mgr.backward(loss_of(model, step, mgr.rank, mgr.size))
            opt.step()
            opt.zero_grad()
        final = _masters(mgr, model, opt)
        if mgr.rank == 0:
            torch.save({"saved": saved, "final": final}, args.dir / f"{case}.reference.pt")


def resume_fsdp2() -> None:
    """FSDP2's own resume, as torchtitan's checkpointer does it."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        get_model_state_dict,
        get_optimizer_state_dict,
        get_state_dict,
        set_state_dict,
    )
    from torch.distributed.fsdp import fully_shard

    case = "unidist-dcp"
    dist.init_process_group("gloo")
    rank, size = dist.get_rank(), dist.get_world_size()
    model = build()
    with torch.no_grad():
        for q in model.parameters():
            q.add_(1.0)  # a different start: only the checkpoint can make it equal
    fully_shard(model.up)
    fully_shard(model.down)
    fully_shard(model)
    opt = _fresh_adamw(model, lr=0.5)
    msd, osd = get_state_dict(model, opt)
    state = {"model": msd, "optim": osd, "step": -1, "note": ""}
    dcp.load(state, checkpoint_id=str(args.dir / case))
    set_state_dict(model, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    full = StateDictOptions(full_state_dict=True, cpu_offload=True)
    names = [n for n, _ in model.named_parameters()]
    ref = torch.load(args.dir / f"{case}.reference.pt", weights_only=True)
    whole = get_model_state_dict(model, options=full)
    moments = get_optimizer_state_dict(model, opt, options=full)
    got: dict[str, Any] = {"extra_step": state["step"], "note": state["note"], "lr": opt.param_groups[0]["lr"]}
    if rank == 0:
        got["loaded"] = max(float((whole[n] - ref["saved"]["weights"][n]).abs().max()) for n in names)
        for key in ("exp_avg", "exp_avg_sq"):
            got[key] = max(float((moments["state"][n][key] - ref["saved"][key][n]).abs().max()) for n in names)
    for step in range(int(state["step"]), STEPS):
        loss_of(model, step, rank, size).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)
        opt.step()
        opt.zero_grad()
    whole = get_model_state_dict(model, options=full)
    if rank == 0:
        got["final"] = max(float((whole[n] - ref["final"][n]).abs().max()) for n in names)
        got["final_scale"] = max(float(w.abs().max()) for w in ref["final"].values())
        (args.out / "rank0.json").write_text(json.dumps({"backend": "fsdp2", "size": size, case: got}))
    dist.barrier()
    dist.destroy_process_group()


def _masters(mgr: Any, model: Any, opt: Any) -> dict[str, torch.Tensor]:
    """Each parameter's float32 value as the optimizer steps it (the master copy under bf16-master); DeepSpeed's
    own call under the deepspeed backend, whose engine holds them."""
    named = dict(mgr.unwrap(model).named_parameters())
    if mgr.backend == "deepspeed":
        from deepspeed.utils import safe_get_full_fp32_param

        return {n: safe_get_full_fp32_param(q).float().cpu() for n, q in named.items()}
    return {n: opt.full_param(q).float().cpu() for n, q in named.items()}


def _state(mgr: Any, model: Any, opt: Any, key: str) -> dict[str, torch.Tensor]:
    """Each parameter's whole optimizer state ``key`` (parameters in the optimizer's order: the model's)."""
    named = dict(mgr.unwrap(model).named_parameters())
    if mgr.backend == "deepspeed":
        from deepspeed.utils import safe_get_full_optimizer_state

        return {n: safe_get_full_optimizer_state(q, key).float().cpu() for n, q in named.items()}
    full = mgr.full_optimizer_state_dict(opt)["state"]
    return {n: full[i][key].float().cpu() for i, n in enumerate(named)}


if __name__ == "__main__":
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    if args.phase == "write":
        write()
    elif args.phase == "write-dcp":
        write_dcp()
    elif args.phase == "write-unidist-dcp":
        write_unidist_dcp()
    elif args.phase == "resume-fsdp2":
        resume_fsdp2()
    elif args.phase == "resume-deepspeed":
        resume_compat(real=True)
    elif args.compat:
        resume_compat()
    else:
        resume()
