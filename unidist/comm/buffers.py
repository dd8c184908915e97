"""Large communication buffers on transparent huge pages.

Measured on 2 ranks (MPICH shared memory): the same chunked allreduce of 32 MiB ran at 3.9 GB/s on a buffer
torch allocated and 6.7 GB/s on one numpy allocated, because numpy advises the kernel to back allocations of
4 MiB and more with huge pages (torch does so only with THP_MEM_ALLOC_ENABLE=1): every copy through shared
memory then takes far fewer TLB misses. The buffers unidist owns (gradient buckets, ZeRO's flat parameters)
are allocated here; a user's own tensors are as the user allocated them.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["zeros"]

_HUGE_FROM = 4 << 20  # numpy's own threshold for the huge-page advice


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """A zeroed 1-d tensor; on CPU and from 4 MiB, in numpy-allocated (huge-page advised) memory.

    Args:
        numel: elements.
        dtype: any torch dtype (numpy allocates raw bytes, torch views them).
        device: other devices get a plain ``torch.zeros``.
    """
    nbytes = numel * torch.empty(0, dtype=dtype).element_size()
    if torch.device(device).type != "cpu" or nbytes < _HUGE_FROM:
        return torch.zeros(numel, dtype=dtype, device=device)
    raw = torch.from_numpy(np.zeros(nbytes, dtype=np.uint8))
    return raw.view(dtype)
