"""``PipelineEngine``: what ``deepspeed.initialize`` returns for a ``PipelineModule``, on any unidist backend.

DeepSpeed 0.19.8's PipelineEngine (runtime/pipe/engine.py) trains a batch per ``train_batch()``: the first and
last stages each draw ``gradient_accumulation_steps`` micro-batches from their data iterator (the first stage
reads ``batch[0]``, the last ``batch[1]``), the micro-batches flow through the stages, each micro-batch's loss is
divided by their number, tied weights' gradients are summed over the stages holding them, gradients are averaged
over the stage's data-parallel ranks, clipped by the norm of the whole model (every stage's squares summed), and
the optimizer steps. It returns the batch's mean loss averaged over the data-parallel ranks, on every rank, and
rank 0 prints ``steps: N loss: L ...`` every ``steps_per_print`` steps.

Here the schedule is ``unidist.parallel.Pipeline``'s 1F1B over the pipe group (one schedule for unidist's own
pipelines and this front end); the micro-batches' backward passes run inside the prepared optimizer's
``accumulate`` block, so the data-parallel reduction happens once, after the tied sums; clipping spans the pipe
group through ``prepare(clip_norm_group=...)``. The training loader is DeepSpeed's: a ``DistributedSampler`` over
the data-parallel ranks without shuffling, repeated forever.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, DistributedSampler

from unidist.compat.deepspeed.config import DSConfig
from unidist.compat.deepspeed.dataloader import RepeatingLoader
from unidist.compat.deepspeed.engine import DeepSpeedEngine
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.compat.deepspeed.pipe.module import PipelineModule
from unidist.errors import InvalidArgumentError
from unidist.parallel.pipeline import Pipeline

__all__ = ["PipelineEngine", "pipeline_options"]


def _to(batch: Any, device: torch.device) -> Any:
    """A micro-batch's part on the device: a tensor, or a tuple/list of them (DeepSpeed moves both)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device)
    if isinstance(batch, (tuple, list)):
        return type(batch)(_to(b, device) for b in batch)
    return batch


def pipeline_options(pipe: PipelineModule, cfg: DSConfig) -> tuple[dict[str, Any], float]:
    """``prepare``'s gradient keywords for a pipeline stage, and the clipping norm the engine applies itself (0:
    none there). Checks the config as DeepSpeed's PipelineEngine does and applies its ``pipeline`` section.

    A stage is data parallel over its data-parallel group, accumulates inside ``train_batch`` (one pass per
    step for prepare), and clips as DeepSpeed 0.19.8 does: in fp32 at ZeRO 0 by the first stage's norm alone (this
    engine, ``_clip_as_deepspeed``), otherwise by every stage's norm, each tied weight once
    (``clip_norm_group``, ``clip_norm_replicas``).
    """
    if cfg.zero_stage > 1:
        raise InvalidArgumentError(f"ZeRO stage {cfg.zero_stage} with a PipelineModule: DeepSpeed refuses it too "
                                   "('ZeRO-2 and ZeRO-3 are incompatible with pipeline parallelism'); use stage 0 or 1")
    interval = (cfg.get("pipeline") or {}).get("activation_checkpoint_interval", 0)
    if isinstance(interval, int) and not isinstance(interval, bool) and interval > 0:
        pipe.activation_checkpoint_interval = interval  # the section overrides the module, as DeepSpeed's engine
    clip = cfg.gradient_clipping if cfg.gradient_clipping > 0 else 0.0
    engine_clips = clip > 0 and cfg.zero_stage == 0 and not cfg.fp16.get("enabled") and not cfg.bf16_enabled
    return {"backward_passes_per_step": 1, "group": pipe.grid.dp_group,
            "clip_grad_norm": None if engine_clips or not clip else clip,
            "clip_norm_group": pipe.grid.pipe_group if clip and not engine_clips else None,
            "clip_norm_replicas": pipe.replicated_parameters()}, clip if engine_clips else 0.0


class PipelineEngine(DeepSpeedEngine):
    """DeepSpeed's pipeline engine API over a prepared stage (see the module docstring). ``forward``,
    ``backward`` and ``step`` are refused, as DeepSpeed refuses them: ``train_batch`` does all three."""

    not_deepspeeds_files = "a pipeline engine (DeepSpeed writes one file per layer)"

    def __init__(self, mgr: Any, config: DSConfig, module: PipelineModule, prepared: torch.nn.Module,
                 optimizer: Any, lr_scheduler: Any, training_data: Any = None, collate_fn: Any = None,
                 clip: float = 0.0) -> None:
        super().__init__(mgr, config, prepared, optimizer, lr_scheduler, None)
        self._clip = clip  # > 0: this engine clips (fp32, stage 0), as DeepSpeed's clip_fp32_gradients
        self.grid = module.grid
        self.num_stages, self.stage_id = self.grid.num_stages, self.grid.stage_id
        self.micro_batches = config.gradient_accumulation_steps
        self.micro_batch_size = config.train_micro_batch_size_per_gpu
        self._pipe_module = module
        self._pipeline = Pipeline(prepared, self.grid.pipe_group, microbatches=self.micro_batches, schedule="1f1b",
                                  loss_fn=self._loss)
        self.data_iterator: Iterator[Any] | None = None
        self.agg_train_loss: torch.Tensor | None = None
        self._since_print = 0.0
        if training_data is not None:
            sampler: DistributedSampler[Any] = DistributedSampler(
                training_data, num_replicas=self.grid.dp, rank=self.grid.dp_id, shuffle=False)
            loader = DataLoader(training_data, batch_size=self.micro_batch_size, sampler=sampler,
                                collate_fn=collate_fn, drop_last=config.dataloader_drop_last,
                                pin_memory=mgr.device.type == "cuda")
            self.set_dataloader(RepeatingLoader(loader))

    def _loss(self, outputs: Any, labels: Any) -> torch.Tensor:
        fn = self._pipe_module.loss_fn
        return fn(outputs, labels) if fn is not None else outputs  # type: ignore[no-any-return]

    # ------------------------------------------------------------------------------------- the data
    def is_first_stage(self) -> bool:
        return self.stage_id == 0

    def is_last_stage(self) -> bool:
        return self.stage_id == self.num_stages - 1

    def set_dataloader(self, loader: Any) -> None:
        """Read the training batches from ``loader`` (first and last stages only, as DeepSpeed)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = loader
            self.data_iterator = iter(loader)

    def set_dataiterator(self, iterator: Iterator[Any]) -> None:
        """Read the training batches from ``iterator`` (first and last stages only)."""
        if self.is_first_stage() or self.is_last_stage():
            self.training_dataloader = None
            self.data_iterator = iterator

    def _micro_batches(self, count: int) -> tuple[list[Any] | None, list[Any] | None]:
        """``count`` micro-batches: the inputs on the first stage, the labels on the last (one ``next`` each)."""
        if not (self.is_first_stage() or self.is_last_stage()):
            return None, None
        if self.data_iterator is None:
            raise InvalidArgumentError("train_batch() has no data: pass train_batch(data_iter=...) or "
                                       "deepspeed.initialize(training_data=...)")
        inputs, labels = [], []
        for _ in range(count):
            batch = next(self.data_iterator)
            if not isinstance(batch, (tuple, list)) or len(batch) < 2:
                raise InvalidArgumentError(f"a pipeline batch is (inputs, labels); the data iterator gave "
                                           f"{type(batch).__name__}")
            inputs.append(_to(batch[0], self.device))
            labels.append(_to(batch[1], self.device))
        return (inputs if self.is_first_stage() else None), (labels if self.is_last_stage() else None)

    @property
    def device(self) -> torch.device:
        return self.manager.device  # type: ignore[no-any-return]

    # ---------------------------------------------------------------------------------- train, eval
    def train_batch(self, data_iter: Iterator[Any] | None = None) -> torch.Tensor:
        """Train on the next ``train_batch_size`` samples (each data-parallel rank's ``gradient_accumulation_steps``
        micro-batches); returns their mean loss, averaged over the data-parallel ranks, on every rank.

        Args:
            data_iter: where the batches come from from now on (default: ``initialize``'s training data).
        """
        if not torch.is_grad_enabled():
            raise InvalidArgumentError("train_batch() requires gradients enabled. Use eval_batch() instead.")
        if data_iter is not None:
            self.set_dataiterator(data_iter)
        start = time.perf_counter()
        self.module.train()
        inputs, labels = self._micro_batches(self.micro_batches)
        opt = self.optimizer
        if opt is None:
            raise InvalidArgumentError("train_batch() needs an optimizer: pass deepspeed.initialize(optimizer=...) or "
                                       "an 'optimizer' section in the config")
        with opt.accumulate():
            loss = self._pipeline.train_microbatches(inputs, labels)
            self._pipe_module.allreduce_tied_weight_gradients()
        if self._clip > 0:
            self._clip_as_deepspeed()
        opt.step()
        opt.zero_grad()
        self.agg_train_loss = self._dp_mean(loss)
        skipped = bool(getattr(opt, "last_step_skipped", False))
        self._step_applied = not skipped
        self.skipped_steps += int(skipped)
        if not skipped and self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.global_steps += 1
        self.global_samples += self.train_batch_size()
        self.micro_steps += self.micro_batches
        self._since_print += time.perf_counter() - start
        self._print_progress(float(self.agg_train_loss))
        return self.agg_train_loss

    @torch.no_grad()
    def eval_batch(self, data_iter: Iterator[Any], return_logits: bool = False, compute_loss: bool = True,
                   reduce_output: str = "avg", bcast_loss: bool = True, num_micro_batches: int | None = None
                   ) -> Any:
        """The mean loss over the next micro-batches of ``data_iter`` without training, on every rank.

        Args:
            data_iter: the evaluation batches. num_micro_batches: how many (default gradient_accumulation_steps).
            return_logits: also return the last stage's outputs of the last micro-batch, as DeepSpeed does:
                ``(loss, outputs)``, outputs None on the other stages.
            compute_loss=False, reduce_output other than "avg", bcast_loss=False: not supported.
        """
        if not compute_loss or reduce_output != "avg" or not bcast_loss:
            raise DeepSpeedUnsupportedError("eval_batch: unidist.compat.deepspeed returns the averaged loss only "
                                            "(compute_loss=True, reduce_output='avg', bcast_loss=True)")
        self.module.eval()
        count = num_micro_batches or self.micro_batches
        saved = self.data_iterator
        self.data_iterator = data_iter if (self.is_first_stage() or self.is_last_stage()) else None
        try:
            inputs, labels = self._micro_batches(count)
        finally:
            self.data_iterator = saved
        loss = self._dp_mean(self._pipeline.eval_microbatches(inputs, labels, count))
        if return_logits:
            outputs, self._pipeline.eval_outputs = self._pipeline.eval_outputs, None
            return loss, outputs
        return loss

    def _clip_as_deepspeed(self) -> None:
        """DeepSpeed 0.19.8's fp32 clip (runtime/utils.py ``clip_grad_norm_`` with the pipe grid as ``mpu``):
        only parameters on model-parallel rank 0 count, and a pipe grid's model-parallel rank is the stage, so
        the norm is the first stage's gradients' (the others add 0 over the pipe group); every stage then scales
        by ``max_norm / (norm + 1e-6)``, capped at 1. ZeRO-1 counts every stage (``prepare(clip_norm_group=)``)."""
        grads = [p.grad for p in self.module.parameters() if p.grad is not None]
        if self.stage_id == 0 and grads:  # float32 throughout, in DeepSpeed's order of operations
            local = torch.stack([g.detach().float().norm(2) for g in grads]).pow(2).sum().float().reshape(1)
        else:
            local = torch.zeros(1)
        total = self.grid.pipe_group.allreduce_(local, "sum").pow(0.5)
        coef = torch.clamp(self._clip / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device, g.dtype))

    def _dp_mean(self, loss: float) -> torch.Tensor:
        value = torch.tensor([loss], dtype=torch.float32)
        if self.grid.dp > 1:
            self.grid.dp_group.allreduce_(value, "sum").div_(self.grid.dp)
        return value[0]

    def _print_progress(self, loss: float) -> None:
        """DeepSpeed's line on rank 0 every ``steps_per_print`` steps."""
        every = self._config.steps_per_print
        if not every or self.global_steps % every:
            return
        if self.global_rank == 0:
            iter_time = self._since_print / every
            print(f"steps: {self.global_steps} loss: {loss:0.4f} "
                  f"iter time (s): {iter_time:0.3f} samples/sec: {self.train_batch_size() / iter_time:0.3f}")
        self._since_print = 0.0

    # -------------------------------------------------------------------- not in pipeline mode
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError("Only train_batch() is accessible in pipeline mode (DeepSpeed's message).")

    def backward(self, *args: Any, **kwargs: Any) -> Any:
        raise InvalidArgumentError("Only train_batch() is accessible in pipeline mode (DeepSpeed's message).")

    def step(self, *args: Any, **kwargs: Any) -> None:
        raise InvalidArgumentError("Only train_batch() is accessible in pipeline mode (DeepSpeed's message).")
