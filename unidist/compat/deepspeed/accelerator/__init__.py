"""``deepspeed.accelerator``: ``get_accelerator()`` (see real_accelerator.py for the answers and the choice)."""

from __future__ import annotations

from unidist.compat.deepspeed.accelerator.real_accelerator import CpuAccelerator, CudaAccelerator, get_accelerator

__all__ = ["CpuAccelerator", "CudaAccelerator", "get_accelerator"]
