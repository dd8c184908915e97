"""deepspeed.utils.safe_get_full_grad / _fp32_param / _optimizer_state at ZeRO 0-3 on 2 ranks: each stage's answers
equal stage 0's (where every rank holds everything) and plain torch's on the whole batch. Prints one line per stage."""

from __future__ import annotations

import torch

import unidist.compat.deepspeed as deepspeed
from unidist.compat.deepspeed.utils import safe_get_full_fp32_param, safe_get_full_grad, safe_get_full_optimizer_state


def model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 3))


def main() -> None:
    deepspeed.init_distributed()
    x = torch.randn(8, 5, generator=torch.Generator().manual_seed(1))
    ref = model()
    ref(x).pow(2).mean().backward()
    want = [p.grad.clone() for p in ref.parameters()]
    for stage in range(4):
        engine, *_ = deepspeed.initialize(model=model(), config={
            "train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
            "zero_optimization": {"stage": stage}})
        rank, size = engine.global_rank, engine.world_size
        rows = x[rank * 8 // size:(rank + 1) * 8 // size]
        engine.backward(engine(rows).pow(2).mean())
        grads = [safe_get_full_grad(p) for p in engine.module.parameters()]
        for got, w in zip(grads, want, strict=True):
            torch.testing.assert_close(got, w, rtol=1e-6, atol=1e-7)
        engine.step()
        full = [safe_get_full_fp32_param(p) for p in engine.module.parameters()]
        moments = [safe_get_full_optimizer_state(p, "exp_avg") for p in engine.module.parameters()]
        assert all(f is not None and f.shape == w.shape for f, w in zip(full, want, strict=True))
        for m, w in zip(moments, want, strict=True):  # Adam's first moment after one step: 0.1 x the gradient
            torch.testing.assert_close(m, 0.1 * w, rtol=1e-5, atol=1e-8)
        print(f"rank {rank} stage {stage}: full gradients, parameters and exp_avg agree", flush=True)


if __name__ == "__main__":
    main()
