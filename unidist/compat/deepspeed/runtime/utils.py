"""``deepspeed.runtime.utils``: the helpers scripts call from it (``set_random_seed``, ``see_memory_usage``)."""

from __future__ import annotations

import torch

from unidist.compat.deepspeed.missing import uncovered
from unidist.compat.deepspeed.seed import set_random_seed

__all__ = ["see_memory_usage", "set_random_seed"]


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's memory printout on rank 0, only with ``force=True`` (as DeepSpeed's): the device's allocated and
    peak bytes where it is a GPU, the process's resident memory otherwise.

    Args:
        message: printed first. force: print (False prints nothing, DeepSpeed's default).
    """
    if not force:
        return
    from unidist.compat.deepspeed import state

    mgr = state.running()
    if mgr is not None and mgr.rank != 0:
        return
    if torch.cuda.is_available():
        gb = 2**30
        print(f"{message}\nMA {torch.cuda.memory_allocated() / gb:.2f} GB  Max_MA "
              f"{torch.cuda.max_memory_allocated() / gb:.2f} GB", flush=True)
        return
    import resource

    print(f"{message}\nCPU RSS peak {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20:.2f} GB", flush=True)


__getattr__ = uncovered(__name__)
