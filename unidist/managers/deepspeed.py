"""DeepSpeedManager: collectives through ``deepspeed.comm``, training through ``deepspeed.initialize``.

``deepspeed.comm`` mirrors torch.distributed, so every collective is TorchManager's; only start-up differs
(``deepspeed.init_distributed``, DeepSpeed's CPU accelerator picks gloo on machines without a GPU).
"""

from __future__ import annotations

import datetime
import logging
from typing import Any

from unidist.errors import BackendUnavailableError
from unidist.managers.torch import TorchManager

__all__ = ["DeepSpeedManager"]

PIP_HINT = "pip install 'unidist[deepspeed]'"


class DeepSpeedManager(TorchManager):
    """deepspeed.comm process group; ``prepare`` builds a DeepSpeed engine."""

    name = "deepspeed"

    def _import_dist(self) -> Any:
        try:
            import deepspeed
            import deepspeed.comm as ds_comm
        except ImportError as err:
            raise BackendUnavailableError(f"the 'deepspeed' backend needs deepspeed ({err}); {PIP_HINT}") from err
        if self.config.log_level != "DEBUG":  # DeepSpeed logs every step at INFO otherwise
            deepspeed.utils.logger.setLevel(max(logging.WARNING, logging.getLevelName(self.config.log_level)))
        return ds_comm

    def _init_group(self) -> None:
        self._dist.init_distributed(dist_backend=self._process_group_backend(), auto_mpi_discovery=False,
                                    verbose=False, init_method="env://",
                                    timeout=datetime.timedelta(seconds=self.config.timeout))

    def _shutdown(self) -> None:
        if self._owns_group and self._dist.is_initialized():
            self._dist.destroy_process_group()
