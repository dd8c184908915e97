"""hvd.DistributedOptimizer cases, run with unidist.compat.horovod (``--impl compat``) or real horovod.torch
(``--impl horovod``): the same script either way, as a user's. Each case trains a small model for a few steps on
rank-dependent batches and reports the final parameters; the test compares them with ``reference()`` (one process,
plain torch: every rank's gradients computed in turn, then combined as Horovod's op defines) and, where real Horovod
runs, with its result. Gradients are large (targets scaled by 10, norms well above 1).
"""

from __future__ import annotations

import argparse
import importlib
import json
import warnings
from pathlib import Path
from typing import Any

import torch

CASES: dict[str, dict[str, Any]] = {
    "sgd": {"opt": "sgd"},
    "adam": {"opt": "adam"},
    "sum": {"opt": "sgd", "op": "Sum"},
    "predivide": {"opt": "sgd", "predivide": 4.0},
    "fp16": {"opt": "sgd", "fp16": True},
    "k2": {"opt": "adam", "k": 2},
    "groups2": {"opt": "sgd", "groups": 2},
    "groups_list": {"opt": "adam", "groups": "list"},
    "unused_on_rank1": {"opt": "sgd", "unused": True},
    "grad_scaler": {"opt": "sgd", "scaler": True},
}
STEPS = 3


def make_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4), torch.nn.Linear(4, 4))


def batch(rank: int, step: int, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * rank + 10 * step + k)
    return torch.randn(16, 8, generator=g) * 3, torch.randn(16, 4, generator=g) * 10


def forward(model: torch.nn.Module, x: torch.Tensor, skip_last: bool) -> torch.Tensor:
    h = model[2](model[1](model[0](x)))  # type: ignore[index]
    return h if skip_last else model[3](h)  # type: ignore[index]


def make_opt(case: dict[str, Any], model: torch.nn.Module) -> torch.optim.Optimizer:
    if case["opt"] == "adam":
        return torch.optim.Adam(model.parameters(), lr=1e-2)
    return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)


def params_of(model: torch.nn.Module) -> list[list[float]]:
    return [p.detach().reshape(-1).tolist() for p in model.parameters()]


def run_case(hvd: Any, case: dict[str, Any]) -> list[list[float]]:
    model = make_model()
    opt = make_opt(case, model)
    kwargs: dict[str, Any] = {"named_parameters": model.named_parameters(),
                              "backward_passes_per_step": case.get("k", 1)}
    if "op" in case:
        kwargs["op"] = getattr(hvd, case["op"])
    if "predivide" in case:
        kwargs["gradient_predivide_factor"] = case["predivide"]
    if case.get("fp16"):
        kwargs["compression"] = hvd.Compression.fp16
    if case.get("groups") == "list":
        kwargs["groups"] = [[model[0].weight, model[2].weight]]  # type: ignore[index]
    elif "groups" in case:
        kwargs["groups"] = case["groups"]
    hvd.broadcast_parameters(model.state_dict(), root_rank=0)
    opt = hvd.DistributedOptimizer(opt, **kwargs)
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0) if case.get("scaler") else None
    for step in range(STEPS):
        for j in range(case.get("k", 1)):
            x, y = batch(hvd.rank(), step, j)
            skip = case.get("unused", False) and hvd.rank() == 1
            loss = torch.nn.functional.mse_loss(forward(model, x, skip), y)
            if scaler is not None:
                scaler.scale(loss).backward()
            else:
                loss.backward()
        if scaler is not None:
            opt.synchronize()  # type: ignore[attr-defined]
            scaler.unscale_(opt)
            with opt.skip_synchronize():  # type: ignore[attr-defined]
                scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad()
    return params_of(model)


def reference(case: dict[str, Any], size: int) -> list[list[float]]:
    """One process, plain torch: each rank's summed gradients over the passes, combined as the op says."""
    model = make_model()
    opt = make_opt(case, model)
    f = case.get("predivide", 1.0)
    for step in range(STEPS):
        per_rank = []
        for r in range(size):
            model.zero_grad(set_to_none=False)
            for j in range(case.get("k", 1)):
                x, y = batch(r, step, j)
                skip = case.get("unused", False) and r == 1
                torch.nn.functional.mse_loss(forward(model, x, skip), y).backward()
            per_rank.append([p.grad.clone() for p in model.parameters()])  # type: ignore[union-attr]
        for i, p in enumerate(model.parameters()):
            grads = [g[i] for g in per_rank]
            if case.get("fp16"):
                total = grads[0].half()
                for g in grads[1:]:
                    total = total + g.half()
                p.grad = (total.float() / size)
            elif case.get("op") == "Sum":
                p.grad = torch.stack(grads).sum(0)
            else:
                p.grad = torch.stack([g / f for g in grads]).sum(0) * (f / size)
        opt.step()
    return params_of(model)


def protocol_errors(hvd: Any) -> dict[str, str]:
    """Horovod's refusals: zero_grad() between backward and step, more passes than backward_passes_per_step,
    bad arguments; and what broadcast_optimizer_state does to a fresh Adam (Horovod: one zero-gradient step)."""
    out: dict[str, str] = {}
    model = make_model()
    opt = hvd.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1),
                                   named_parameters=model.named_parameters())
    x, y = batch(hvd.rank(), 0, 0)
    torch.nn.functional.mse_loss(forward(model, x, False), y).backward()
    try:
        opt.zero_grad()
        out["zero_grad_mid_step"] = "none"
    except Exception as e:
        out["zero_grad_mid_step"] = str(isinstance(e, AssertionError))
    opt.step()
    opt.zero_grad()
    for _ in range(2):
        try:
            torch.nn.functional.mse_loss(forward(model, x, False), y).backward()
            out["too_many_passes"] = "none"
        except Exception as e:
            out["too_many_passes"] = str(isinstance(e, AssertionError))
            break
    for name, kwargs in {"dup_names": {"named_parameters": [("a", p) for p in model.parameters()]},
                         "bad_k": {"backward_passes_per_step": 0},
                         "predivide_sum": {"op": hvd.Sum, "gradient_predivide_factor": 2.0}}.items():
        try:
            hvd.DistributedOptimizer(torch.optim.SGD(make_model().parameters(), lr=0.1), **kwargs)
            out[name] = "none"
        except ValueError as e:
            out[name] = "ValueError"
            out[name + "_message"] = str(e)[:60]
    # param_groups in another order on another rank (built from a set, say): Horovod pairs by name, and so must we
    a, b = torch.nn.Parameter(torch.zeros(3)), torch.nn.Parameter(torch.zeros(3))
    named = [("a", a), ("b", b)] if hvd.rank() % 2 == 0 else [("b", b), ("a", a)]
    swapped = hvd.DistributedOptimizer(torch.optim.SGD([p for _, p in named], lr=1.0), named_parameters=named,
                                       op=hvd.Sum)
    (a.sum() * (1 + hvd.rank()) + b.sum() * 10 * (1 + hvd.rank())).backward()
    swapped.synchronize()
    out["swapped_order_grads"] = str([a.grad.tolist(), b.grad.tolist()])  # type: ignore[union-attr]
    adam_model = make_model()
    adam = torch.optim.Adam(adam_model.parameters(), lr=1e-2)
    hvd.broadcast_optimizer_state(adam, root_rank=0)
    state = adam.state_dict()["state"]
    out["fresh_adam_steps_after_broadcast"] = str([float(s["step"]) for s in state.values()])
    return out


def main() -> None:
    from unidist import script_args

    parser = argparse.ArgumentParser()
    parser.add_argument("--impl", choices=("compat", "horovod"), default="compat")
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(script_args())
    hvd = importlib.import_module("unidist.compat.horovod" if args.impl == "compat" else "horovod.torch")
    hvd.init()
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    report: dict[str, Any] = {"size": hvd.size(), "cases": {name: run_case(hvd, c) for name, c in CASES.items()}}
    report["protocol"] = protocol_errors(hvd)
    (args.out / f"rank{hvd.rank()}.json").write_text(json.dumps(report))
    hvd.shutdown()


if __name__ == "__main__":
    main()
