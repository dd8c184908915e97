"""``DeepSpeedEngine``: what ``deepspeed.initialize`` returns, on any unidist backend.

The engine is a thin bookkeeper over unidist's uniform loop (``mgr.prepare``, ``mgr.backward``, ``opt.step``):
prepare already gives DeepSpeed's math (ZeRO 1-3, gradient averaging, accumulation that divides the loss by the
accumulation steps, clipping by global norm, dynamic loss scaling) on every backend, and on the deepspeed backend
it *is* DeepSpeed's engine underneath. What this class adds is DeepSpeed's surface: its counters
(``global_steps`` counts accumulation boundaries, skipped steps included; ``skipped_steps``; ``micro_steps``;
``global_samples``), the scheduler stepped only on applied steps, its queries, ``no_sync`` and checkpoints with a
``latest`` tag file (``checkpoint.py``).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from unidist.compat.deepspeed import checkpoint
from unidist.compat.deepspeed.config import DSConfig
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.errors import InvalidArgumentError
from unidist.prepared import PreparedOptimizer
from unidist.train.precision import Precision, cast_floats

__all__ = ["DeepSpeedEngine"]


class DeepSpeedEngine(torch.nn.Module):
    """DeepSpeed's engine API over a prepared model and optimizer (see ``initialize``).

    Attributes scripts read: ``module`` (the user's model), ``optimizer`` (what ``mgr.prepare`` returned),
    ``lr_scheduler``, ``training_dataloader``, ``local_rank``, ``global_rank``, ``world_size``, ``global_steps``,
    ``global_samples``, ``skipped_steps``, ``micro_steps``.
    """

    # why this kind of engine's checkpoints cannot be DeepSpeed's own files (checkpoint.py; None: they are)
    not_deepspeeds_files: str | None = None

    def __init__(self, mgr: Any, config: DSConfig, model: torch.nn.Module, optimizer: Any, lr_scheduler: Any,
                 training_dataloader: Any) -> None:
        super().__init__()
        self._mgr = mgr
        self._config = config
        # DeepSpeed returns a half model's outputs in its dtype (forward): which one, known once
        self._out_dtype = Precision.of(config.precision()).param_dtype
        self.module = mgr.unwrap(model)
        self._prepared = [model]  # a list: not registered twice as a submodule (it may be the module itself)
        self.optimizer = optimizer
        self.lr_scheduler = lr_scheduler
        self.training_dataloader = training_dataloader
        self.local_rank = mgr.local_rank
        self.global_rank = mgr.rank
        self.world_size = mgr.size
        self.global_steps = 0
        self.global_samples = 0
        self.skipped_steps = 0
        self.micro_steps = 0
        self._step_applied = False
        self._in_no_sync = False
        self._pending: Any = None  # an accumulate block a no_sync opened, closed by the next backward outside
        # the optimizer's parameters in its order before prepare sharded them (initialize sets it): the indices of
        # its full state dict (utils.safe_get_full_optimizer_state)
        self.stepped_params: list[torch.Tensor] = []

    # ----------------------------------------------------------------------------------------- forward
    def forward(self, *args: Any, **kwargs: Any) -> Any:
        """The prepared model's forward (on ZeRO-3 it gathers the parameters it needs). DeepSpeed's engine returns
        the module's outputs as they are, a bf16 model's in bfloat16, and scripts compute their loss from them;
        unidist's prepared model returns float32, so they go back to the model's dtype (exactly: they were)."""
        out = self._prepared[0](*args, **kwargs)
        return out if self._out_dtype is None else cast_floats(out, self._out_dtype)

    # ------------------------------------------------------------------------------ the training loop
    def backward(self, loss: torch.Tensor, retain_graph: bool = False, scale_wrt_gas: bool = True) -> torch.Tensor:
        """Backward of ``loss`` divided by the accumulation steps (DeepSpeed's ``scale_wrt_gas``); gradients are
        averaged over the ranks at the accumulation boundary. Returns the divided loss, as DeepSpeed does.

        Args:
            loss: this micro-batch's loss (a scalar tensor).
            retain_graph: not supported here (unidist's backward frees the graph); True raises.
            scale_wrt_gas: False backs ``loss`` as it is (not divided by the accumulation steps).
        """
        if retain_graph:
            raise DeepSpeedUnsupportedError("engine.backward(loss, retain_graph=True) is not supported by "
                                            "unidist.compat.deepspeed; call it once per graph")
        if not isinstance(loss, torch.Tensor):
            raise InvalidArgumentError(f"engine.backward(loss) takes a tensor, got {type(loss).__name__}")
        gas = self.gradient_accumulation_steps()
        # mgr.backward divides by the accumulation steps itself; undo that when the script asks for no scaling
        self._mgr.backward(loss if scale_wrt_gas else loss * gas)
        if not self._in_no_sync:
            self._close_pending()  # DeepSpeed reduces the no_sync gradients with this backward's
        return loss / gas if scale_wrt_gas else loss

    def step(self, lr_kwargs: dict[str, Any] | None = None) -> None:
        """One micro-step. At the accumulation boundary: clip, step the optimizer (skipped on fp16 overflow),
        clear the gradients, step the scheduler if the step was applied, count a global step (applied or not)."""
        if self._in_no_sync:
            raise InvalidArgumentError("engine.step() inside engine.no_sync(): leave the no_sync block first "
                                       "(DeepSpeed refuses it too)")
        self._close_pending()
        boundary = self.is_gradient_accumulation_boundary()
        opt = self.optimizer
        if opt is not None:
            # prepared with backward_passes_per_step = the accumulation steps, so step() and zero_grad() act on the
            # boundary call only (unidist's contract for prepared optimizers, on every backend)
            opt.step()
            opt.zero_grad()
        self._step_applied = False
        if boundary:
            skipped = bool(getattr(opt, "last_step_skipped", False)) if opt is not None else False
            self._step_applied = not skipped
            self.skipped_steps += int(skipped)
            if not skipped and self.lr_scheduler is not None:
                self.lr_scheduler.step(**(lr_kwargs or {}))
            self.global_steps += 1
            self.global_samples += self.train_batch_size()
        self.micro_steps += 1

    def zero_grad(self, set_to_none: bool = True) -> None:
        """Clear the module's gradients (the engine's ``step`` already does at each boundary)."""
        self.module.zero_grad(set_to_none=set_to_none)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Backward passes inside accumulate gradients locally and communicate nothing; the next backward outside
        averages them together with its own (or ``step()`` does, if none comes). DeepSpeed refuses it with ZeRO
        stage 2 or 3, and so does this.

        It is ``mgr.accumulate`` kept open past the ``with`` until that backward: the gradients are reduced once,
        as DeepSpeed does, on every backend's optimizer."""
        if self.zero_optimization_stage() >= 2:
            raise InvalidArgumentError(f"engine.no_sync() is incompatible with ZeRO stage "
                                       f"{self.zero_optimization_stage()} (gradients are partitioned); DeepSpeed "
                                       "refuses it too: use gradient_accumulation_steps")
        if self._in_no_sync:
            raise InvalidArgumentError("engine.no_sync() blocks do not nest")
        if self.gradient_accumulation_steps() != 1:
            raise InvalidArgumentError("engine.no_sync() with gradient_accumulation_steps > 1 is not supported by "
                                       "unidist.compat.deepspeed: use one of the two ways to accumulate")
        if self._pending is None:
            block = self._mgr.accumulate(self._prepared[0])
            block.__enter__()
            self._pending = block
        self._in_no_sync = True
        try:
            yield
        except BaseException as exc:
            block, self._pending = self._pending, None
            block.__exit__(type(exc), exc, exc.__traceback__)
            raise
        finally:
            self._in_no_sync = False

    def _close_pending(self) -> None:
        """Leave the accumulate block a ``no_sync`` opened: its gradients (and a backward's since) reduce once."""
        block, self._pending = self._pending, None
        if block is not None:
            block.__exit__(None, None, None)

    # --------------------------------------------------------------------------------------- queries
    def train_batch_size(self) -> int:
        return self._config.train_batch_size

    def train_micro_batch_size_per_gpu(self) -> int:
        return self._config.train_micro_batch_size_per_gpu

    def gradient_accumulation_steps(self) -> int:
        return self._config.gradient_accumulation_steps

    def is_gradient_accumulation_boundary(self) -> bool:
        """Whether the next ``step()`` steps the optimizer: ``(micro_steps + 1) % gradient_accumulation_steps``."""
        return (self.micro_steps + 1) % self.gradient_accumulation_steps() == 0

    def zero_optimization_stage(self) -> int:
        return self._config.zero_stage

    def zero_optimization(self) -> bool:
        return self._config.zero_stage > 0

    def fp16_enabled(self) -> bool:
        return bool(self._config.fp16.get("enabled", False))

    def bfloat16_enabled(self) -> bool:
        return self._config.bf16_enabled

    def gradient_clipping(self) -> float:
        return self._config.gradient_clipping

    def get_lr(self) -> list[Any]:
        """Every parameter group's learning rate ([] without an optimizer)."""
        if self.optimizer is None:
            return []
        return [g.get("lr", 0.0) for g in self.optimizer.param_groups]

    def get_global_grad_norm(self) -> float | None:
        """The global L2 norm of the averaged gradients at the last step, before clipping; None when nothing
        measured it (clipping off, as DeepSpeed's fp32 stage 0 reports None)."""
        return self.optimizer.last_grad_norm if isinstance(self.optimizer, PreparedOptimizer) else None

    def was_step_applied(self) -> bool:
        """Whether the last ``step()`` updated the weights (False between boundaries and on fp16 overflow)."""
        return self._step_applied

    @property
    def loss_scale(self) -> float:
        return float(getattr(self.optimizer, "loss_scale", 1.0))

    @property
    def config(self) -> dict[str, Any]:
        """The user's config as given."""
        return dict(self._config.raw)

    # ------------------------------------------------------------------------------------ checkpoints
    def save_checkpoint(self, save_dir: str, tag: Any = None, client_state: dict[str, Any] | None = None,
                        save_latest: bool = True, exclude_frozen_parameters: bool = False) -> bool:
        """Save to ``save_dir/tag`` (default tag ``global_step{N}``) in unidist's format, which loads on any
        backend, world size and ZeRO stage, and write DeepSpeed's ``latest`` file naming the tag. Every rank calls
        it. Returns True.

        Args:
            save_dir: the directory holding tags. tag: the checkpoint's name (default ``global_step{global_steps}``).
            client_state: the script's own state (a dict), returned by ``load_checkpoint``.
            save_latest: write ``save_dir/latest``. exclude_frozen_parameters: not supported (True raises).
        """
        return checkpoint.save(self, save_dir, tag, client_state, save_latest, exclude_frozen_parameters)

    def load_checkpoint(self, load_dir: str, tag: Any = None, load_module_strict: bool = True,
                        load_optimizer_states: bool = True, load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn: Any = None) -> tuple[Any, Any]:
        """Load ``load_dir/tag`` (tag default: the ``latest`` file's). Returns ``(path, client_state)``, or
        ``(None, None)`` with a warning when there is no ``latest`` file, as DeepSpeed does.

        Args:
            load_dir: the directory ``save_checkpoint`` wrote. tag: which checkpoint (default: ``latest``'s).
            load_module_strict: must be True (unidist checks every parameter). load_optimizer_states,
                load_lr_scheduler_states: restore those too. load_module_only: the weights only.
            custom_load_fn: not supported (raises).
        """
        return checkpoint.load(self, load_dir, tag, load_module_strict, load_optimizer_states,
                               load_lr_scheduler_states, load_module_only, custom_load_fn)

    # the hooks checkpoint.py uses (public: no module reads another's private names)
    @property
    def manager(self) -> Any:
        return self._mgr

    @property
    def prepared_model(self) -> torch.nn.Module:
        return self._prepared[0]

    def counters(self) -> dict[str, int]:
        return {"global_steps": self.global_steps, "global_samples": self.global_samples,
                "skipped_steps": self.skipped_steps, "micro_steps": self.micro_steps}

    def restore_counters(self, saved: dict[str, int]) -> None:
        """What DeepSpeed restores (``micro_steps`` restarts, as the optimizer's own pass count does)."""
        for name in ("global_steps", "global_samples", "skipped_steps"):
            setattr(self, name, int(saved.get(name, 0)))
