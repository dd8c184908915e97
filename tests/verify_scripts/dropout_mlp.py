"""A small MLP with dropout, written as a newcomer writes it, for ``unidist verify``'s launch-level behaviours.

Correct as written: ``nn.Dropout(0.2)``, Adam, a global batch of 16 from ``mgr.loader`` (``16 // mgr.size`` per
rank), 8 steps; it resumes from the newest checkpoint in ``CKPT`` (a directory, from the environment) when there is
one and saves one every 3 steps there, as a script that survives preemption does. Each launch of ``verify
--launch`` can set its own variables:

- ``CKPT=dir``: resume and save there (relative: inside the launch's own working directory; absolute: shared by
  every launch that names it, which verify must report);
- ``NONDETERMINISTIC=1``: on more than one rank, noise from a generator seeded by the clock is added to the
  gradients: a launch that differs from run to run.
"""

from __future__ import annotations

import os
import time

import torch
import torch.nn.functional as F  # noqa: N812

import unidist


def main() -> None:
    torch.set_num_threads(1)
    steps, batch = 8, 16
    ckpt, noisy = os.environ.get("CKPT"), os.environ.get("NONDETERMINISTIC") == "1"
    with unidist.init() as mgr:
        torch.manual_seed(0)
        g = torch.Generator().manual_seed(0)
        x = 2 * torch.randn(steps * batch, 12, generator=g)
        y = (x @ torch.randn(12, 5, generator=g)).argmax(1)
        net = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.ReLU(), torch.nn.Dropout(0.2),
                                  torch.nn.Linear(32, 5))
        model, opt = mgr.prepare(net, torch.optim.Adam(net.parameters(), lr=1e-2))
        done = 0
        latest = mgr.latest_checkpoint(ckpt) if ckpt else None
        if latest is not None:
            done = mgr.load_checkpoint(latest, model, opt)["step"]
        loader = mgr.loader(list(zip(x, y, strict=True)), batch_size=batch // mgr.size)
        noise = torch.Generator().manual_seed(time.time_ns() % 2**31)
        for step, (xb, yb) in enumerate(loader):
            if step < done:
                continue
            mgr.backward(F.cross_entropy(model(xb), yb))
            if noisy and mgr.size > 1:
                for p in model.parameters():
                    p.grad.add_(1e-3 * torch.randn(p.shape, generator=noise))
            opt.step()
            opt.zero_grad()
            if ckpt and (step + 1) % 3 == 0:
                mgr.save_checkpoint(os.path.join(ckpt, f"step-{step + 1}"), model, opt, step=step + 1)


if __name__ == "__main__":
    main()
