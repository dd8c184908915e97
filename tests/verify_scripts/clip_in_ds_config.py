"""Planted divergence for ``unidist verify``: a DeepSpeed config carried over with ``gradient_clipping: 1.0``.

A user porting a DeepSpeed job passes their config only when running on DeepSpeed, as prepare asks
(``deepspeed_config=`` is refused elsewhere). Its ``gradient_clipping: 1.0`` is honoured there, and nowhere else:
with a loss whose gradient norm is far above 1 (an MSE on targets of size ~100, plain SGD), the first update
under the deepspeed launcher is clipped and every other launch's is not. Expected: only the deepspeed launch
diverges, at step 1, on ``params`` (the gradient norm before clipping is the same), naming the clipping.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F  # noqa: N812

import unidist

DS_CONFIG = {"gradient_clipping": 1.0, "steps_per_print": 1000}  # what the user's DeepSpeed job had


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--batch", type=int, default=16, help="global batch, split across the ranks")
    args = parser.parse_args(unidist.script_args())
    torch.set_num_threads(1)
    with unidist.init() as mgr:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = torch.randn(128, 8, generator=g)
        y = 100.0 * (x @ torch.randn(8, 2, generator=g))  # big targets: gradient norms in the thousands
        net = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))
        sgd = torch.optim.SGD(net.parameters(), lr=1e-4)
        # the planted mistake: the DeepSpeed job's config, handed over only where DeepSpeed runs
        model, opt = mgr.prepare(net, sgd, deepspeed_config=DS_CONFIG if mgr.backend == "deepspeed" else None)
        mine = list(mgr.shard(args.batch, shuffle=False))
        for s in range(args.steps):
            rows = torch.arange(s * args.batch, (s + 1) * args.batch)[mine]
            xb, yb = mgr.to_device((x[rows], y[rows]))
            loss = F.mse_loss(model(xb), yb)
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        if mgr.is_main:
            print(f"clip_in_ds_config: backend={mgr.backend} ranks={mgr.size} last loss {loss.item():.4g}")


if __name__ == "__main__":
    main()
