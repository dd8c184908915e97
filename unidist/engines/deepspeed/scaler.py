"""The GradScaler DeepSpeed's ``torch_autocast`` fp16 runs with under unidist (``AgreedGradScaler``): unidist's
loss-scaling parameters, the skip agreed across ranks, one update per optimizer step (trainer.py installs it right
after ``deepspeed.initialize``)."""

from __future__ import annotations

from typing import Any

import torch

from unidist.request import ScalerOptions
from unidist.train.precision import next_scale

__all__ = ["AgreedGradScaler"]


class AgreedGradScaler(torch.amp.GradScaler):
    """The GradScaler DeepSpeed's ``torch_autocast`` fp16 steps with, made to mean what unidist's fp16 means.

    DeepSpeed 0.19.8 builds its own with GradScaler's default parameters (``engine.torch_autocast_z0_gradscaler``
    at stage 0, ``optimizer.torch_autocast_gradscaler`` under ZeRO); this one replaces it right after
    ``deepspeed.initialize`` and differs in three ways:

    - its parameters are ``prepare(loss_scaling=...)``'s, DeepSpeed's scaler's included (hysteresis, floor,
      growth count, static scale: ``next_scale`` in train/precision.py moves the scale then);
    - the skip is agreed: each rank's found-inf is max-allreduced over the data-parallel group before the step
      (under ZeRO a rank unscales only its partition, so ranks could otherwise skip different steps and their
      scales drift apart: pytorch/pytorch#76282);
    - the scale is updated once per optimizer step, by ``EngineOptimizer.step`` (``end_step``), also when
      DeepSpeed skipped the step itself: under ZeRO its global-norm check finds the inf first and returns without
      ever calling the scaler, so the scale would never back off and every later step would overflow again;
      with several parameter groups (or ZeRO-3 sub-groups) it would call ``update()`` once per group.

    Clipping under ZeRO: DeepSpeed clips inside its step, before this scaler unscales, by the global norm of the
    still-scaled gradients, dividing by its own loss scale (1.0 under torch_autocast), so the clip would be off
    by the whole scale. With ``engine_unscales`` the ZeRO optimizer's static loss scale is set to this scale
    before each step (``EngineOptimizer.step``): DeepSpeed unscales and clips together, as GradScaler's
    ``unscale_`` then ``clip_grad_norm_`` do, and this scaler then only checks for inf/nan (inverse scale 1).
    """

    def __init__(self, options: ScalerOptions, device: torch.device, group: Any) -> None:
        super().__init__(device.type, init_scale=options.init_scale, growth_factor=options.growth_factor,
                         backoff_factor=options.backoff_factor, growth_interval=options.growth_interval)
        self.options, self.group = options, group
        self._init_growth_tracker = options.start_tracker  # -1 under DeepSpeed's growth rule (precision.py)
        self.hysteresis = options.hysteresis  # overflows left before a back-off (DeepSpeed's hysteresis)
        self.skipped_steps = 0
        self.last_step_skipped = False
        self._in_step = False  # inside EngineOptimizer.step: update() waits for end_step
        self._found = False  # an agreed inf/nan in this step
        self.engine_unscales = False  # the ZeRO optimizer unscales (and clips) before the step

    def _unscale_grads_(self, optimizer: torch.optim.Optimizer, inv_scale: torch.Tensor, found_inf: torch.Tensor,
                        allow_fp16: bool) -> dict[torch.device, torch.Tensor]:
        if self.engine_unscales:  # already unscaled by DeepSpeed: only the inf/nan check
            inv_scale = torch.ones_like(inv_scale)
        return super()._unscale_grads_(optimizer, inv_scale, found_inf, allow_fp16)

    def _maybe_opt_step(self, optimizer: torch.optim.Optimizer, optimizer_state: dict[str, Any], *args: Any,
                        **kwargs: Any) -> Any:
        import deepspeed.comm as dist

        found = torch.zeros(1, dtype=torch.float32, device=self._scale.device if self._scale is not None else "cpu")
        for value in optimizer_state["found_inf_per_device"].values():
            found += value.to(found.device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX, group=self.group)
        agreed = found.clamp_(max=1.0).reshape(())
        optimizer_state["found_inf_per_device"] = {found.device: agreed}  # what update() then reads
        if float(agreed):
            self._found = True
            return None
        return optimizer.step(*args, **kwargs)

    def update(self, new_scale: Any = None) -> None:
        if not self._in_step and new_scale is None and not self.options.gradscaler and self._scale is not None:
            found = [f for state in self._per_optimizer_states.values()
                     for f in state["found_inf_per_device"].values()]
            if not found:
                raise RuntimeError("No inf checks were recorded prior to update.")  # GradScaler's text
            self._per_optimizer_states.clear()
            self._move(any(bool(f) for f in found))
            return
        if not self._in_step or new_scale is not None:
            super().update(new_scale)
            return
        self._per_optimizer_states.clear()  # the next group may step; the scale moves at end_step

    def begin_step(self) -> None:
        self._in_step, self._found = True, False

    def abandon_step(self) -> None:
        """The engine's step raised: it moved no scale, and ``update()`` is GradScaler's again."""
        self._in_step = False

    def end_step(self, engine_skipped: bool) -> None:
        """After the engine's optimizer step: one update of the scale, with inf if this scaler or the engine
        found one (every rank alike: both decisions are agreed)."""
        self._in_step = False
        self._per_optimizer_states.clear()
        found = self._found or engine_skipped
        self.last_step_skipped = found
        self.skipped_steps += int(found)
        if self._scale is None or self._growth_tracker is None:  # no scale() yet: nothing was scaled
            return
        self._move(found)

    def _move(self, found: bool) -> None:
        """One update of the scale: GradScaler's kernel, or ``next_scale`` with DeepSpeed's options."""
        o = self.options
        if self._scale is None or self._growth_tracker is None:
            return
        if o.gradscaler:
            torch._amp_update_scale_(self._scale, self._growth_tracker,
                                     torch.full((), float(found), dtype=torch.float32, device=self._scale.device),
                                     o.growth_factor, o.backoff_factor, o.growth_interval)
            return
        scale, tracker, self.hysteresis = next_scale(o, float(self._scale), int(self._growth_tracker),
                                                     self.hysteresis, found)
        self._scale.fill_(scale)
        self._growth_tracker.fill_(tracker)

    def state_dict(self) -> dict[str, Any]:
        """GradScaler's keys and the skipped-step count: LossScaler's (train/precision.py) layout, so an fp16
        checkpoint resumes on any backend."""
        return {**super().state_dict(), "skipped_steps": self.skipped_steps, "hysteresis": self.hysteresis}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state = dict(state_dict)
        self.skipped_steps = int(state.pop("skipped_steps", 0))
        self.hysteresis = int(state.pop("hysteresis", self.options.hysteresis))
        state.setdefault("_growth_tracker", self.options.start_tracker)
        # the factors and interval stay those this run was prepared with (as LossScaler does)
        o = self.options
        state.update(growth_factor=o.growth_factor, backoff_factor=o.backoff_factor, growth_interval=o.growth_interval)
        super().load_state_dict(state)

    @property
    def scale_value(self) -> float:
        return float(self.get_scale())
