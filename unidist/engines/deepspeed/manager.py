"""DeepSpeedManager: collectives through ``deepspeed.comm`` (a TorchEngine over it; only start-up differs).

Training through ``deepspeed.initialize`` lives in unidist/engines/deepspeed/trainer.py.
"""

from __future__ import annotations

import logging
from typing import Any

from unidist.comm import watchdog
from unidist.engines.torch.manager import TorchManager
from unidist.errors import BackendUnavailableError, LaunchEnvironmentError
from unidist.registry import get

__all__ = ["DeepSpeedManager"]


class DeepSpeedManager(TorchManager):
    """deepspeed.comm process group; ``prepare`` builds a DeepSpeed engine."""

    name = "deepspeed"

    def _import_dist(self) -> Any:
        try:
            import deepspeed
            import deepspeed.comm as ds_comm
        except ImportError as err:
            raise BackendUnavailableError(
                f"the 'deepspeed' backend needs deepspeed ({err}); {get('deepspeed').install}") from err
        if self.config.log_level != "DEBUG":  # DeepSpeed warns about every untested optimizer otherwise
            deepspeed.utils.logger.setLevel(max(logging.ERROR, logging.getLevelName(self.config.log_level)))
        self._deepspeed = deepspeed
        return ds_comm

    @property
    def engine_api(self) -> Any:
        """The ``deepspeed`` module this run imported (its trainer calls ``deepspeed.initialize``)."""
        return self._deepspeed

    def _refuse_shared_gpu(self) -> None:
        """DeepSpeed's engine reduces its gradients and ZeRO partitions with NCCL on a GPU (reduce-scatter included,
        which gloo cannot do on CUDA tensors): ranks sharing a GPU cannot run it. Said before any rendezvous, rather
        than NCCL's "Duplicate GPU detected" at the first collective."""
        import torch

        gpus = torch.cuda.device_count()
        raise LaunchEnvironmentError(
            f"{self.launch.local_size} ranks share {gpus} GPU(s) on this host, and DeepSpeed's engine needs a GPU "
            f"of its own per rank (NCCL refuses two ranks on one device); start at most {gpus} rank(s) per host "
            f"(deepspeed --num_gpus {gpus}), or UNIDIST_DEVICE=cpu with DS_ACCELERATOR=cpu to run on the CPU, or "
            "UNIDIST_BACKEND=torch (unidist's own training, which stages CUDA tensors through the host)")

    def _init_group(self) -> None:
        super()._init_group()  # torch's group on unidist's store; init_distributed adopts it
        if self._process_group_backend() == "gloo":
            # init_distributed JIT-compiles a shared-memory op (~2 min on first use) that only DeepSpeed's
            # inference_all_reduce needs; unidist never calls it, so mark it unavailable before init.
            ops = getattr(self._deepspeed, "ops", None)
            compatible = getattr(ops, "__compatible_ops__", None)
            if isinstance(compatible, dict):
                compatible["deepspeed_shm_comm"] = False
        self._dist.init_distributed(dist_backend=self._process_group_backend(), auto_mpi_discovery=False,
                                    verbose=False,
                                    timeout=watchdog.engine_timeout(self.config.timeout))
