"""Buffers that agree on every rank: rank 0's, after every optimizer step (DDP's ``broadcast_buffers`` rule).

Parameters agree because every rank applies the same averaged gradient; buffers do not: BatchNorm's running
statistics are updated from each rank's own rows, and after three steps on different data two ranks' running
means differ (0.44 measured on a ResNet). An evaluation or a checkpoint would then depend on which rank made it.
DDP broadcasts rank 0's buffers at the start of every forward; unidist broadcasts them at the end of every
optimizer step (skipped fp16 steps included), so that between steps — where evaluations and checkpoints happen —
every rank holds the same model.

Only buffers in the model's ``state_dict`` travel (persistent ones): a non-persistent buffer (Llama's RoPE
frequencies, causal masks) is by Torch's convention derived state, the same on every rank, and never saved. A
model without persistent buffers costs nothing; one with them, one fused broadcast per dtype per step.
"""

from __future__ import annotations

import torch

from unidist.comm.protocol import Comm
from unidist.train.broadcast_state import broadcast_parameters

__all__ = ["BufferSync"]


class BufferSync:
    """Rank ``root``'s persistent buffers of ``module`` on every rank of ``comm``, on each :meth:`sync`.

    Args:
        comm: the data-parallel ranks (the world or a Group).
        module: the user's module; its buffers are looked up again on each sync (by owner and name), so a buffer
            a module replaces (``self.running_mean = ...``) is still the one that travels.
        root: the rank whose buffers win (``comm``'s rank numbering).
    """

    def __init__(self, comm: Comm, module: torch.nn.Module, root: int = 0) -> None:
        self.comm, self.root = comm, root
        persistent = {id(v) for v in module.state_dict(keep_vars=True).values()}
        self.where: list[tuple[torch.nn.Module, str]] = []
        seen: set[int] = set()
        for owner in module.modules():
            for name, buf in owner.named_buffers(recurse=False):
                if buf is not None and id(buf) in persistent and id(buf) not in seen:
                    seen.add(id(buf))
                    self.where.append((owner, name))

    def tensors(self) -> list[torch.Tensor]:
        """The buffers that travel, as the module holds them now."""
        return [t for owner, name in self.where if isinstance(t := getattr(owner, name, None), torch.Tensor)]

    # a prepared optimizer's step observer (train/prepared.py): the buffers travel at the end of every step
    def before_step(self, opt: object) -> None:
        """Nothing before the step."""

    def after_step(self, opt: object) -> None:
        """Rank ``root``'s buffers everywhere (``sync``)."""
        self.sync()

    def sync(self) -> None:
        """One fused broadcast per dtype and device (none without buffers, or on one rank)."""
        if self.where and self.comm.size > 1:
            broadcast_parameters(self.comm, [(str(i), t) for i, t in enumerate(self.tensors())], self.root)
