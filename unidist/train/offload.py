"""``prepare(offload="cpu")``: ZeRO's optimizer shards in CPU memory, stepped there (ZeRO-Offload, Ren et al. 2021;
FSDP2's ``CPUOffloadPolicy``).

What moves: each ZeRO unit's shard (the float32 parameters the optimizer steps), its gradient and so the whole
optimizer state live in pinned CPU memory; at stage 3 the shard is also all the parameter a rank keeps between
uses (the gather copies it to the device first). The device keeps the full parameters of stages 1-2, activations and
the gradients until they are reduced. The copies: each unit's reduced gradient goes down as it arrives
(non-blocking, into a pinned buffer the unit reuses), one device synchronisation before the step reads them, the
updated shard goes up before the all-gather that refreshes the parameters. The math is the same optimizer on the same
numbers, so training equals no offload (bitwise on the CPU; on a GPU within what the CPU's and GPU's kernels differ).

Where the parameters are on the CPU already there is nothing to move: offload is a no-op there, said once (by rank
0). ``rehearse_on_cpu`` runs the CPU path anyway (CPU-to-CPU copies), so a machine without a GPU tests its math.
On the deepspeed backend the same argument becomes DeepSpeed's own ``offload_optimizer`` (and ``offload_param`` at
stage 3), in engines/deepspeed/config.py.
"""

from __future__ import annotations

import logging

import torch

__all__ = ["cpu_copy", "cpu_empty", "effective", "rehearse_on_cpu", "wait_for_copies"]

_log = logging.getLogger("unidist")

_rehearse = False


def rehearse_on_cpu(on: bool = True) -> None:
    """Run the CPU path even where the parameters are on the CPU (the tests' way to check its math without a GPU).

    Args:
        on: True to rehearse, False for the default (offload is a no-op on a CPU device).
    """
    global _rehearse
    _rehearse = on


def effective(offload: str | None, device: torch.device, rank: int) -> str | None:
    """The offload this run follows: none where the device is the CPU (said once, by rank 0).

    Args:
        offload: what ``check`` returned.
        device: the rank's device (where the parameters are).
        rank: this rank in the world.
    """
    if offload is None or device.type != "cpu" or _rehearse:
        return offload
    if rank == 0:
        _log.warning("prepare(offload='cpu'): the parameters are on the CPU already, so nothing moves (offload "
                     "is a no-op on a CPU device)")
    return None


def cpu_empty(numel: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A CPU buffer for tensors of ``device``: pinned where that is a GPU (its copies then skip a staging copy and
    need not block)."""
    return torch.empty(numel, dtype=dtype, device="cpu", pin_memory=device.type == "cuda")


def cpu_copy(t: torch.Tensor) -> torch.Tensor:
    """``t`` in (pinned) CPU memory, never sharing its storage (the shard and the flat buffer stay two)."""
    out = cpu_empty(t.numel(), t.dtype, t.device)
    out.copy_(t.detach().reshape(-1))
    return out


def wait_for_copies(device: torch.device) -> None:
    """The non-blocking device-to-CPU copies done: the CPU may read the gradients."""
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()
