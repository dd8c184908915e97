"""``deepspeed.initialize``: DeepSpeed 0.19.8's signature and return tuple, on ``mgr.prepare``.

The steps are DeepSpeed's (``deepspeed/__init__.py``, ``runtime/engine.py``): start the distributed run
(``init_distributed``), read the config (``config=`` / ``config_params=`` / ``args.deepspeed_config``), check the
launcher's ``--local_rank`` against ``LOCAL_RANK``, pick the optimizer (the script's own instance or callable wins
over the config's ``optimizer`` section), the scheduler likewise, then make the model data parallel. That last step
is ``mgr.prepare`` with the config's ZeRO stage, clipping, accumulation steps, bucket size and precision: unidist's
ZeRO and optimizer off the deepspeed launcher, DeepSpeed's engine under it (with the config's DeepSpeed-only keys,
such as offload, handed through).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Any

import torch

from unidist.compat.deepspeed import config as config_mod
from unidist.compat.deepspeed import state
from unidist.compat.deepspeed.dataloader import DeepSpeedDataLoader
from unidist.compat.deepspeed.dist import init_distributed
from unidist.compat.deepspeed.engine import DeepSpeedEngine
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.compat.deepspeed.loss_scale import loss_scaling
from unidist.compat.deepspeed.lr_schedules import build_scheduler
from unidist.compat.deepspeed.optimizers import build_optimizer
from unidist.compat.deepspeed.pipe.engine import PipelineEngine, pipeline_options
from unidist.compat.deepspeed.pipe.module import PipelineModule
from unidist.errors import InvalidArgumentError
from unidist.precisions import MODES

__all__ = ["initialize"]


def initialize(args: Any = None, model: torch.nn.Module | None = None, optimizer: Any = None,
               model_parameters: Iterable[Any] | None = None, training_data: Any = None, lr_scheduler: Any = None,
               distributed_port: int = 29500, mpu: Any = None, dist_init_required: bool | None = None,
               collate_fn: Callable[..., Any] | None = None, config: Any = None, mesh_param: Any = None,
               config_params: Any = None) -> tuple[DeepSpeedEngine, Any, Any, Any]:
    """Make ``model`` data parallel as DeepSpeed would; returns ``(engine, optimizer, training_dataloader,
    lr_scheduler)`` (None for what was not asked for).

    Args:
        args: the script's argparse namespace (``--deepspeed_config``, ``--local_rank``), or None.
        model: the ``torch.nn.Module`` to train (required).
        optimizer: a ``torch.optim.Optimizer``, or a callable taking the parameters and returning one; overrides
            the config's ``optimizer`` section.
        model_parameters: what the config's optimizer optimizes (default: every parameter of ``model``).
        training_data: a map-style ``torch.utils.data.Dataset``: a loader of this rank's micro-batches is returned.
        lr_scheduler: a scheduler, or a callable taking the optimizer; overrides the config's ``scheduler``.
        distributed_port: the rendezvous port when this call starts torch.distributed (DeepSpeed's default 29500).
        mpu, mesh_param: model-parallel topologies; not supported here (raise when given).
        dist_init_required: accepted (the run is always initialized here).
        collate_fn: the training loader's collate function.
        config, config_params: the DeepSpeed config (a dict or a JSON file path); one of these or
            ``args.deepspeed_config``.
    """
    if model is None:
        raise InvalidArgumentError("deepspeed.initialize requires a model")
    if not isinstance(model, torch.nn.Module):
        raise InvalidArgumentError(f"deepspeed.initialize(model=...) takes a torch.nn.Module, got "
                                   f"{type(model).__name__}")
    for name, given in (("mpu", mpu), ("mesh_param", mesh_param)):
        if given is not None:
            raise DeepSpeedUnsupportedError(f"deepspeed.initialize({name}=...) (model parallelism through "
                                            "DeepSpeed's topology) is not supported by unidist.compat.deepspeed; "
                                            "use unidist.parallel for tensor and pipeline parallelism")
    init_distributed(distributed_port=distributed_port, dist_init_required=dist_init_required)
    mgr = state.manager()
    raw = config_mod.load_source(args, config, config_params)
    if mgr.backend == "deepspeed" and isinstance(model, mgr.engine_api.pipe.PipelineModule):
        # compat's PipelineModule is DeepSpeed's under its launcher (pipe/handoff.py): its engine runs it
        return mgr.engine_api.initialize(  # type: ignore[no-any-return]
            args=args, model=model, optimizer=optimizer, model_parameters=model_parameters,
            training_data=training_data, lr_scheduler=lr_scheduler, collate_fn=collate_fn, config=raw)
    pipe = model if isinstance(model, PipelineModule) else None
    # a pipeline's batch arithmetic counts its data-parallel ranks, not the world (DeepSpeed's dp_world_size)
    cfg = config_mod.parse(raw, pipe.grid.dp if pipe is not None else mgr.size, on_deepspeed=mgr.backend == "deepspeed")
    _check_local_rank(args, mgr)
    # prepare's gradient keywords; a pipeline stage's differ (pipe/engine.py says how), and it may clip itself
    sync: dict[str, Any] = {"clip_grad_norm": cfg.gradient_clipping if cfg.gradient_clipping > 0 else None,
                            "backward_passes_per_step": cfg.gradient_accumulation_steps}
    engine_clip = 0.0
    if pipe is not None:
        overrides, engine_clip = pipeline_options(pipe, cfg)
        sync.update(overrides)

    params = list(model_parameters) if model_parameters is not None else list(model.parameters())
    opt = _optimizer(optimizer, params, cfg)
    # the optimizer's parameters in its own order, before prepare shards them: how its state dict numbers them
    stepped = [q for g in opt.param_groups for q in g["params"]] if opt is not None else []
    precision = cfg.precision()
    passthrough = cfg.deepspeed_only() if mgr.backend == "deepspeed" else {}
    if _offloads(passthrough) and "zero_force_ds_cpu_optimizer" not in cfg.raw:
        # the step runs the config's optimizer as torch builds it (the same math as DeepSpeedCPUAdam, slower):
        # DeepSpeed refuses a torch optimizer with offload unless told this is meant
        passthrough["zero_force_ds_cpu_optimizer"] = False
    prepared, prepared_opt = mgr.prepare(
        model, opt, zero_stage=cfg.zero_stage, **sync,
        bucket_mb=max(cfg.reduce_bucket_size * 4 / 2**20, 1.0),
        precision=precision,
        # the config's CPU offload (offload_optimizer/offload_param device cpu); DeepSpeed's engine reads the keys
        offload=cfg.offload() if mgr.backend != "deepspeed" else None,
        loss_scaling=loss_scaling(cfg.fp16, zero_stage=cfg.zero_stage) if MODES[precision].scaled else None,
        deepspeed_config=passthrough or None)
    scheduler = _scheduler(lr_scheduler, prepared_opt, cfg) if prepared_opt is not None else None
    engine: DeepSpeedEngine
    if pipe is not None:
        engine = PipelineEngine(mgr, cfg, pipe, prepared, prepared_opt, scheduler, training_data, collate_fn,
                                clip=engine_clip)
    else:
        loader = None if training_data is None else DeepSpeedDataLoader(
            mgr, training_data, cfg.train_micro_batch_size_per_gpu, collate_fn, cfg.dataloader_drop_last)
        engine = DeepSpeedEngine(mgr, cfg, prepared, prepared_opt, scheduler, loader)
    engine.stepped_params = stepped
    state.register_engine(engine)
    return engine, engine.optimizer, engine.training_dataloader, engine.lr_scheduler


def _optimizer(client: Any, params: list[Any], cfg: config_mod.DSConfig) -> Any:
    """DeepSpeed's precedence: the script's optimizer (instance or callable), else the config's section."""
    if isinstance(client, torch.optim.Optimizer):
        return client
    params = [p for p in params if not isinstance(p, dict) or p.get("params")]  # DeepSpeed drops empty groups
    if client is not None:
        if not callable(client):
            raise InvalidArgumentError(f"deepspeed.initialize(optimizer=...) takes a torch.optim.Optimizer or a "
                                       f"callable returning one, got {type(client).__name__}")
        made = client(params)
        if not isinstance(made, torch.optim.Optimizer):
            raise InvalidArgumentError(f"the optimizer callable returned {type(made).__name__}, not a "
                                       "torch.optim.Optimizer")
        return made
    if cfg.optimizer is None:
        return None
    return build_optimizer(cfg.optimizer, params, zero_stage=cfg.zero_stage,
                           allow_untested=cfg.zero_allow_untested_optimizer)


def _scheduler(client: Any, optimizer: Any, cfg: config_mod.DSConfig) -> Any:
    """The script's scheduler (instance, or callable on the optimizer) wins over the config's section."""
    if client is not None:
        return client(optimizer) if callable(client) else client  # DeepSpeed calls anything callable
    if cfg.scheduler is None:
        return None
    return build_scheduler(cfg.scheduler, optimizer)


def _offloads(passthrough: dict[str, Any]) -> bool:
    zero = passthrough.get("zero_optimization", {})
    return any(isinstance(zero.get(k), dict) and str(zero[k].get("device", "none")).lower() != "none"
               for k in ("offload_optimizer", "offload_param"))


def _check_local_rank(args: Any, mgr: Any) -> None:
    """DeepSpeed checks the launcher's ``--local_rank`` against ``LOCAL_RANK``: a mismatch means the script
    would put its tensors on another rank's device."""
    given = getattr(args, "local_rank", None)
    if isinstance(given, int) and given >= 0 and given != mgr.local_rank:
        raise InvalidArgumentError(f"args.local_rank={given} but this process is local rank {mgr.local_rank} "
                                   f"(LOCAL_RANK={os.environ.get('LOCAL_RANK')}); pass the launcher's --local_rank "
                                   "through unchanged")
