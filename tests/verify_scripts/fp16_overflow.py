"""Planted divergence for ``unidist verify``: an fp16 loss summed over the batch, where it should be averaged.

``prepare(precision="fp16-mixed")`` runs the forward in float16 under a dynamic loss scale (2**16 at first), and
a step whose gradients hold inf/nan is skipped, on every rank alike. The planted mistake is
``reduction="sum"``: the bias gradient is then the sum of (loss scale x error) over the rows, computed in
float16 inside the layer's backward, so its size grows with the rows a process holds. The whole batch of 16
(the one-process run) overflows float16's 65504 at step 1 and skips it; half of it (each of 2 ranks) does not,
so those ranks apply step 1. Expected: a 2-rank launch diverges at step 1 on ``skipped``, with the fp16 cause.
(The zero-initialised layer makes step 1's error exactly the targets, 0.05 each: a full-batch bias gradient of
2 * 2**16 * 16 * 0.05 ~ 1.05e5, a half batch's ~ 5.2e4.)
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812

import unidist


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    args = parser.parse_args(unidist.script_args())
    torch.set_num_threads(1)
    with unidist.init() as mgr:
        g = torch.Generator().manual_seed(0)
        x = torch.rand(128, 8, generator=g) - 0.5
        y = 0.05 + 0.001 * torch.rand(128, 1, generator=g)
        net = torch.nn.Linear(8, 1)
        torch.nn.init.zeros_(net.weight)
        torch.nn.init.zeros_(net.bias)
        model, opt = mgr.prepare(net, torch.optim.SGD(net.parameters(), lr=1e-2), precision="fp16-mixed")
        mine = list(mgr.shard(args.batch, shuffle=False))
        skipped = []
        for s in range(args.steps):
            rows = torch.arange(s * args.batch, (s + 1) * args.batch)[mine]
            xb, yb = mgr.to_device((x[rows], y[rows]))
            loss = F.mse_loss(model(xb), yb, reduction="sum")  # the planted bug: "sum", not "mean"
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
            skipped.append(opt.last_step_skipped)  # type: ignore[attr-defined]  # a prepared optimizer's
        if mgr.is_main:
            scale = opt.loss_scale  # type: ignore[attr-defined]
            print(f"fp16_overflow: ranks={mgr.size} skipped steps {skipped} loss scale {scale:g}")


if __name__ == "__main__":
    main()
