"""DeepSpeed's script-facing API on every unidist backend: ``import unidist.compat.deepspeed as deepspeed``.

A DeepSpeed training script runs with only its import lines changed, under ``python``, ``mpiexec``, ``torchrun``,
``horovodrun`` and the ``deepspeed`` launcher: ``deepspeed.initialize`` reads the same JSON config with DeepSpeed
0.19.8's meaning and defaults (``gradient_clipping`` 1.0 included: here the point is DeepSpeed's math), and returns an
engine whose ``backward``/``step``/``save_checkpoint`` give the weights real DeepSpeed gives. Off the deepspeed launcher
the work is unidist's (its ZeRO 1-3, clipping, accumulation, loss scaling); under it, it is DeepSpeed's engine.
Pipelines (``pipe``: ``PipelineModule`` and ``engine.train_batch``) and Mixture of Experts (``moe``) run on every
backend, and so does CPU offload (``prepare(offload="cpu")``). What only DeepSpeed's engine can do (NVMe offload,
ZeRO++) raises ``DeepSpeedUnsupportedError`` naming the
key when used elsewhere. See the README, "Coming from DeepSpeed".

Modules, one job each: ``config`` (the JSON config: keys, defaults, batch arithmetic), ``optimizers`` and
``lr_schedules`` (the config's optimizer and scheduler), ``loss_scale`` (fp16's dynamic loss scale), ``engine`` (the
engine), ``checkpoint`` (tags and ``latest``), ``dataloader``, ``dist`` (``init_distributed``), ``comm``,
``accelerator``, ``pipe`` (pipeline parallelism) and ``moe`` (Mixture of Experts).
"""

from __future__ import annotations

import argparse

from unidist.compat.deepspeed import accelerator, comm, constants, moe, ops, pipe, runtime, utils, zero
from unidist.compat.deepspeed.accelerator import get_accelerator
from unidist.compat.deepspeed.dist import init_distributed
from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.compat.deepspeed.initialize import initialize
from unidist.compat.deepspeed.missing import refuse_imports, uncovered
from unidist.compat.deepspeed.pipe.engine import PipelineEngine

__version__ = "0.19.8"  # the DeepSpeed release whose behaviour this layer follows
__all__ = ["DeepSpeedConfigError", "DeepSpeedUnsupportedError", "PipelineEngine", "__version__", "accelerator",
           "add_config_arguments", "comm", "constants", "get_accelerator", "init_distributed", "initialize", "moe",
           "ops", "pipe", "runtime", "utils", "zero"]

# a DeepSpeed name this layer lacks (deepspeed.init_inference...): an AttributeError that says so and what to do
# instead; an import of a module it lacks (deepspeed.ops.sparse_attention) likewise
__getattr__ = uncovered(__name__)
refuse_imports()


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """DeepSpeed's command-line arguments: ``--deepspeed``, ``--deepspeed_config`` (and the deprecated
    ``--deepscale``, ``--deepscale_config``), in a group named "DeepSpeed".

    Args:
        parser: the script's argparse parser; returned with the arguments added.
    """
    group = parser.add_argument_group("DeepSpeed", "DeepSpeed configurations")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="Enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepspeed_config", default=None, type=str, help="DeepSpeed json configuration file.")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="Deprecated enable DeepSpeed (helper flag for user code, no impact on DeepSpeed backend)")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="Deprecated DeepSpeed json configuration file.")
    return parser
