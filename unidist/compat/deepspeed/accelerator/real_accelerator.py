"""``deepspeed.accelerator.real_accelerator.get_accelerator``: DeepSpeed's CPU or CUDA accelerator answers.

Scripts ask the accelerator for device names and the communication backend (DSE cifar:
``get_accelerator().set_device(local_rank)``, ``get_accelerator().device_name(local_rank)``). The choice follows
DeepSpeed's (ds/accelerator/real_accelerator.py:51-216): ``DS_ACCELERATOR`` when set ('cpu' or 'cuda' here;
DeepSpeed's other accelerators raise DeepSpeedUnsupportedError), else CUDA when a started unidist Manager runs
on CUDA (or, before one starts, when torch sees a CUDA device), else CPU. The CPU answers are
``CPU_Accelerator``'s (ds/accelerator/cpu_accelerator.py), the CUDA ones ``CUDA_Accelerator``'s
(ds/accelerator/cuda_accelerator.py). Only the CPU side is tested on this project's machines.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from typing import Any

import torch

from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError

__all__ = ["CpuAccelerator", "CudaAccelerator", "get_accelerator"]

# ds/accelerator/real_accelerator.py:23
_DEEPSPEED_ACCELERATORS = ("cuda", "cpu", "xpu", "npu", "mps", "hpu", "mlu", "sdaa", "supa", "klxpu")


class CpuAccelerator:
    """DeepSpeed's CPU_Accelerator answers (gloo: oneCCL's bindings are not used by unidist)."""

    _name = "cpu"

    def is_synchronized_device(self) -> bool:
        return True

    def device_name(self, device_index: int | None = None) -> str:
        return "cpu"

    def device(self, device_index: int | None = None) -> None:
        return None  # cpu_accelerator.py:58

    def set_device(self, device_index: int) -> None:
        return None  # no-op on CPU (cpu_accelerator.py:61)

    def current_device(self) -> Any:
        return os.environ.get("LOCAL_RANK", 0)  # as DeepSpeed: the string LOCAL_RANK when set (cpu_accelerator.py:64)

    def current_device_name(self) -> str:
        return "cpu"

    def device_count(self) -> int:
        """LOCAL_SIZE when set, else the NUMA nodes that have cores (at least 1) (cpu_accelerator.py:70-88)."""
        local = int(os.environ.get("LOCAL_SIZE", 0))
        return local if local > 0 else _numa_nodes_with_cores()

    def synchronize(self, device_index: int | None = None) -> None:
        return None

    def manual_seed(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> Any:
        return torch.manual_seed(seed)

    def is_available(self) -> bool:
        return True

    def communication_backend_name(self) -> str:
        return "gloo"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        """The mkldnn probe DeepSpeed uses (cpu_accelerator.py:228-233; it answers None where we say False)."""
        try:
            return bool(torch.ops.mkldnn._is_mkldnn_fp16_supported())
        except Exception:  # an op missing from this torch build: DeepSpeed answers False too
            return False

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float, torch.bfloat16] + ([torch.float16] if self.is_fp16_supported() else [])


class CudaAccelerator:
    """DeepSpeed's CUDA_Accelerator answers. gpu-untested: written from cuda_accelerator.py, not run here."""

    _name = "cuda"

    def is_synchronized_device(self) -> bool:
        return False

    def device_name(self, device_index: int | None = None) -> str:
        return "cuda" if device_index is None else f"cuda:{device_index}"

    def device(self, device_index: int | None = None) -> torch.device:
        return torch.device("cuda") if device_index is None else torch.device("cuda", device_index)

    def set_device(self, device_index: int) -> None:
        torch.cuda.set_device(device_index)

    def current_device(self) -> int:
        return torch.cuda.current_device()

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}"

    def device_count(self) -> int:
        return torch.cuda.device_count()

    def synchronize(self, device_index: int | None = None) -> None:
        torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        torch.cuda.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.cuda.manual_seed_all(seed)

    def is_available(self) -> bool:
        return torch.cuda.is_available()

    def communication_backend_name(self) -> str:
        return "nccl"

    def is_bf16_supported(self) -> bool:
        return not torch.cuda.is_available() or torch.cuda.is_bf16_supported()  # cuda_accelerator.py:204-207

    def is_fp16_supported(self) -> bool:
        """Compute capability 7 or more (6 with DS_ALLOW_DEPRECATED_FP16=1) (cuda_accelerator.py:209-221)."""
        if not torch.cuda.is_available():
            return True
        major, _ = torch.cuda.get_device_capability()
        return major >= 7 or (major == 6 and os.environ.get("DS_ALLOW_DEPRECATED_FP16", "0") == "1")

    def supported_dtypes(self) -> list[torch.dtype]:
        return [torch.float] + ([torch.half] if self.is_fp16_supported() else []) + \
            ([torch.bfloat16] if self.is_bf16_supported() else [])


_CPU = CpuAccelerator()
_CUDA = CudaAccelerator()


def get_accelerator() -> CpuAccelerator | CudaAccelerator:
    """This run's accelerator (one object per kind, as DeepSpeed's is a singleton)."""
    name = os.environ.get("DS_ACCELERATOR")
    if name is None:
        mgr = state.running()
        if mgr is not None:
            name = mgr.device.type
        else:
            name = "cuda" if torch.cuda.is_available() and torch.cuda.device_count() > 0 else "cpu"
    if name == "cpu":
        return _CPU
    if name == "cuda":
        return _CUDA
    if name in _DEEPSPEED_ACCELERATORS:
        raise DeepSpeedUnsupportedError(f"DS_ACCELERATOR={name!r}: unidist runs on 'cpu' or 'cuda'; unset it, or run "
                                        "under the deepspeed launcher with real deepspeed")
    raise DeepSpeedConfigError(f"DS_ACCELERATOR must be one of {list(_DEEPSPEED_ACCELERATORS)}, not {name!r}")


def _numa_nodes_with_cores() -> int:
    """DeepSpeed's count: the nodes of ``numactl --hardware`` that have cores, consecutive equal core lists once
    (ds/utils/numa.py:24-40); 1 without numactl, as DeepSpeed."""
    numactl = shutil.which("numactl")
    if numactl is None:
        return 1
    try:
        out = subprocess.run([numactl, "--hardware"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 1
    count, previous = 0, None
    for line in out.splitlines():
        head, _, cores = line.partition(" cpus:")
        if head.startswith("node ") and cores.split() and cores.split() != previous:
            count += 1
            previous = cores.split()
    return count or 1
