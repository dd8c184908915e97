"""N ranks on batch B/N must train exactly like one process on batch B, on every backend.

Runs under any launcher. Every rank also trains the single-process reference itself (plain torch, no
unidist), then compares. Most variants use targets scaled so gradient norms are well above 1 (the report
says how far): an engine that clips, rescales or casts behind the user's back shows up as a difference.

Variants: plain/k2/fp16/bf16 (gentle magnitudes: accumulation and compressed wires); sgd_big (SGD momentum);
adam_clip (Adam, clip_grad_norm=0.5); sgd_steplr and sgd_onecycle (LR schedulers stepped every iteration,
OneCycle also cycling momentum through param_groups); dropout (each rank seeded before prepare; the
reference replays every rank's dropout stream); roundtrip (Adam; state_dict()/load_state_dict() and an lr
edit halfway). Parameters are compared across ranks after every step.

Also checked here, in the same launch: the prepared optimizer is a torch Optimizer; synchronize() then
step() reduces once; prepare's argument errors happen before anything changes; unwrap() and state_dict keys;
with UNIDIST_TIMELINE set, the trace marks where the counted calls begin and end.
"""

from __future__ import annotations

import argparse
import copy
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

import unidist
from unidist.comm import trace_hooks, watchdog

STEPS, BATCH, DIM = 6, 24, 10
SEED = 500  # rank r seeds SEED + r before prepare (dropout streams)


@dataclass(frozen=True)
class Variant:
    k: int = 1
    compression: str = "none"
    optimizer: str = "sgd"  # sgd (momentum 0.9) or adam
    clip: float | None = None
    schedule: str | None = None  # steplr or onecycle
    scale: float = 10.0  # target scale: 10 gives gradient norms well above 1
    dropout: bool = False
    roundtrip: bool = False


VARIANTS = {
    "plain": Variant(scale=1.0), "k2": Variant(k=2, scale=1.0),
    "fp16": Variant(compression="fp16", scale=1.0), "bf16": Variant(compression="bf16", scale=1.0),
    "sgd_big": Variant(), "adam_clip": Variant(optimizer="adam", clip=0.5),
    "sgd_steplr": Variant(schedule="steplr"), "sgd_onecycle": Variant(schedule="onecycle"),
    "dropout": Variant(dropout=True), "roundtrip": Variant(optimizer="adam", roundtrip=True),
}


def make_model(dropout: bool) -> torch.nn.Module:
    torch.manual_seed(1234)
    layers: list[torch.nn.Module] = [torch.nn.Linear(DIM, 32), torch.nn.Tanh()]
    if dropout:
        layers.append(torch.nn.Dropout(0.3))
    return torch.nn.Sequential(*layers, torch.nn.Linear(32, 4))


def make_optimizer(v: Variant, params: Any) -> torch.optim.Optimizer:
    if v.optimizer == "adam":
        return torch.optim.Adam(params, lr=0.01)
    return torch.optim.SGD(params, lr=0.02 if v.scale > 1 else 0.1, momentum=0.9)


def make_schedule(v: Variant, opt: torch.optim.Optimizer) -> Any:
    if v.schedule == "steplr":
        return torch.optim.lr_scheduler.StepLR(opt, 2, gamma=0.5)
    if v.schedule == "onecycle":
        return torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=0.05, total_steps=STEPS)
    return None


def data(step: int, micro: int, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The global batch of (step, micro-step): the same on every rank."""
    g = torch.Generator().manual_seed(step * 100 + micro)
    x = torch.randn(BATCH, DIM, generator=g)
    return x, scale * (torch.sin(x[:, :4]) + 0.1 * x[:, 4:8])


def flat_grad_norm(params: Any) -> float:
    return float(torch.cat([p.grad.reshape(-1) for p in params if p.grad is not None]).norm())


def halfway(v: Variant, opt: torch.optim.Optimizer, step: int) -> None:
    if v.roundtrip and step == STEPS // 2:
        opt.load_state_dict(copy.deepcopy(opt.state_dict()))
        for group in opt.param_groups:
            group["lr"] *= 0.5


def reference(v: Variant, size: int) -> tuple[torch.Tensor, float]:
    """One process on the whole batch; with dropout, rank r's rows see rank r's dropout stream."""
    with torch.random.fork_rng():
        model = make_model(v.dropout)
        streams = []
        for r in range(size):
            torch.manual_seed(SEED + r)
            streams.append(torch.get_rng_state())
        opt = make_optimizer(v, model.parameters())
        sched = make_schedule(v, opt)
        per, first_norm = BATCH // size, 0.0
        for step in range(STEPS):
            xs, ys = zip(*(data(step, m, v.scale) for m in range(v.k)), strict=True)
            x, y = torch.cat(xs), torch.cat(ys)
            if v.dropout:
                loss = torch.zeros(())
                for r in range(size):
                    torch.set_rng_state(streams[r])
                    rows = slice(r * per, (r + 1) * per)
                    loss = loss + torch.nn.functional.mse_loss(model(x[rows]), y[rows]) / size
                    streams[r] = torch.get_rng_state()
            else:
                loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            if step == 0:
                first_norm = flat_grad_norm(model.parameters())
            if v.clip is not None:
                torch.nn.utils.clip_grad_norm_(model.parameters(), v.clip)
            opt.step()
            if sched is not None:
                sched.step()
            halfway(v, opt, step)
        return torch.cat([p.detach().reshape(-1) for p in model.parameters()]), first_norm


def distributed(mgr: Any, v: Variant) -> tuple[torch.Tensor, float, bool]:
    torch.manual_seed(mgr.rank)  # a different start on each rank: prepare() must broadcast rank 0's
    model = make_model(v.dropout) if mgr.rank == 0 else torch.nn.Sequential(
        torch.nn.Linear(DIM, 32), torch.nn.Tanh(), *([torch.nn.Dropout(0.3)] if v.dropout else []),
        torch.nn.Linear(32, 4))
    torch.manual_seed(SEED + mgr.rank)  # before prepare: an engine that consumes RNG would shift dropout
    opt = make_optimizer(v, model.parameters())
    model, opt = mgr.prepare(model, opt, backward_passes_per_step=v.k, compression=v.compression,
                             clip_grad_norm=v.clip)
    is_optimizer = isinstance(opt, torch.optim.Optimizer)
    sched = make_schedule(v, opt)
    per = BATCH // mgr.size
    spread = 0.0
    mine = slice(mgr.rank * per, (mgr.rank + 1) * per)
    for step in range(STEPS):
        for m in range(v.k):
            x, y = data(step, m, v.scale)
            loss = torch.nn.functional.mse_loss(model(x[mine]), y[mine])
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        if sched is not None:
            sched.step()
        halfway(v, opt, step)
        flat = _flat(mgr, model)
        spread = max(spread, (mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max().item())
    return _flat(mgr, model), spread, is_optimizer


def _flat(mgr: Any, model: Any) -> torch.Tensor:
    module = mgr.unwrap(model)
    return torch.cat([p.detach().reshape(-1).float().cpu() for p in module.parameters()])


def synchronize_once(mgr: Any) -> dict[str, Any]:
    """synchronize() then step(): the gradient applied is the one synchronize produced, reduced once."""
    op = "mean" if mgr.backend == "deepspeed" else "sum"  # DeepSpeed only averages
    model = make_model(False)
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    model, opt = mgr.prepare(model, opt, op=op)
    x, y = data(0, 0, 10.0)
    per = BATCH // mgr.size
    loss = torch.nn.functional.mse_loss(model(x[mgr.rank * per:(mgr.rank + 1) * per]), y[mgr.rank * per:
                                                                                           (mgr.rank + 1) * per])
    mgr.backward(loss)
    opt.synchronize()
    params = list(mgr.unwrap(model).parameters())
    before = [p.detach().clone() for p in params]
    grads = [p.grad.detach().clone() for p in params]
    opt.step()
    opt.zero_grad()
    applied = max((b - g - p.detach()).abs().max().item() for b, g, p in zip(before, grads, params, strict=True))
    ref = make_model(False)
    torch.nn.functional.mse_loss(ref(x), y).backward()
    factor = mgr.size if op == "sum" else 1
    synced = max((g - factor * p.grad).abs().max().item() for g, p in zip(grads, ref.parameters(), strict=True))
    return {"op": op, "applied_minus_synchronized": applied, "synchronized_minus_expected": synced}


def two_models(mgr: Any) -> dict[str, Any]:
    """Two prepared models, interleaved (a GAN's shape): A accumulates 2 passes per step, B steps every pass between
    A's passes. ``mgr.backward`` must serve the model whose loss it is (its k, its DeepSpeed engine), as one process
    training each on the whole batch."""
    def pair() -> tuple[torch.nn.Module, torch.nn.Module]:
        a = make_model(False)
        torch.manual_seed(99)
        return a, torch.nn.Sequential(torch.nn.Linear(DIM, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))

    ref_a, ref_b = pair()
    ref_oa, ref_ob = (torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (ref_a, ref_b))
    a, b = pair()
    a, oa = mgr.prepare(a, torch.optim.SGD(a.parameters(), lr=0.05, momentum=0.9), backward_passes_per_step=2)
    b, ob = mgr.prepare(b, torch.optim.SGD(b.parameters(), lr=0.05, momentum=0.9))
    per = BATCH // mgr.size
    rows = slice(mgr.rank * per, (mgr.rank + 1) * per)
    mse = torch.nn.functional.mse_loss
    for step in range(3):
        for micro in range(2):
            x, y = data(step, micro, 10.0)
            mgr.backward(mse(a(x[rows]), y[rows]))
            (mse(ref_a(x), y) / 2).backward()
            oa.step()
            oa.zero_grad()
            xb, yb = data(step + 10, micro, 10.0)
            mgr.backward(mse(b(xb[rows]), yb[rows]))
            mse(ref_b(xb), yb).backward()
            for o in (ob, ref_ob):
                o.step()
                o.zero_grad()
        ref_oa.step()
        ref_oa.zero_grad()
    diff = {name: float((_flat(mgr, m) - torch.cat([p.detach().reshape(-1) for p in r.parameters()])).abs().max())
            for name, m, r in (("a", a, ref_a), ("b", b, ref_b))}
    return diff


def api(mgr: Any) -> dict[str, Any]:
    """Argument errors come first (nothing broadcast or wrapped), and the prepared model unwraps."""
    out: dict[str, Any] = {}
    torch.manual_seed(77 + mgr.rank)
    model = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.Linear(8, 2))
    mine = torch.cat([p.detach().reshape(-1).clone() for p in model.parameters()])
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for name, kwargs in {"unknown": {"config": {}}, "ds_name": {"gradient_clipping": 1.0},
                         "bad_clip": {"clip_grad_norm": -1.0}, "bad_op": {"op": "max"},
                         "deepspeed_only": {"deepspeed_config": {}}}.items():
        try:
            mgr.prepare(model, opt, **kwargs)
            out[name] = "accepted"
        except unidist.InvalidArgumentError as err:
            out[name] = str(err)
        except Exception as err:  # the report says what else was raised
            out[name] = f"WRONG TYPE {type(err).__name__}: {err}"
        if name == "unknown":
            now = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
            out["untouched_after_error"] = bool(torch.equal(now, mine))
    user = torch.nn.Sequential(torch.nn.Linear(DIM, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    keys = list(user.state_dict())
    prepared, popt = mgr.prepare(user, torch.optim.SGD(user.parameters(), lr=0.1))
    out["unwrap_is_user_module"] = mgr.unwrap(prepared) is user
    out["state_dict_keys_equal"] = list(prepared.state_dict()) == keys
    schedulers = {
        "StepLR": lambda o: torch.optim.lr_scheduler.StepLR(o, 2),
        "LambdaLR": lambda o: torch.optim.lr_scheduler.LambdaLR(o, lambda e: 0.9 ** e),
        "OneCycleLR": lambda o: torch.optim.lr_scheduler.OneCycleLR(o, max_lr=0.1, total_steps=10),
        "CosineAnnealingLR": lambda o: torch.optim.lr_scheduler.CosineAnnealingLR(o, 10),
    }
    for name, make in schedulers.items():
        try:
            make(popt)
            out[name] = "ok"
        except Exception as err:
            out[name] = f"{type(err).__name__}: {err}"
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--variants", default=",".join(VARIANTS))
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        # the timeline's test (test_training.py): the trace lists exactly the calls the watchdog counted here
        trace_hooks.mark("counted", calls=watchdog.calls())
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        for name in ns.variants.split(","):
            v = VARIANTS[name]
            try:
                got, spread, is_optimizer = distributed(mgr, v)
                want, norm = reference(v, mgr.size)
                report[name] = {"max_diff": (got - want).abs().max().item(), "max_spread": spread,
                                "first_grad_norm": norm, "is_optimizer": is_optimizer}
            except unidist.InvalidArgumentError as err:
                report[name] = {"refused": str(err)}
        report["synchronize_once"] = synchronize_once(mgr)
        report["api"] = api(mgr)
        report["two_models"] = two_models(mgr)
        trace_hooks.mark("counted", calls=watchdog.calls())
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
