"""DeepSpeed 0.19.8's learning-rate schedules, on any torch optimizer, without DeepSpeed installed.

A DeepSpeed config's ``"scheduler": {"type": "WarmupLR", "params": {...}}`` must move the learning rate exactly as
DeepSpeed does on every backend, so these classes keep DeepSpeed's names, argument names, defaults and formulas
(``deepspeed/runtime/lr_schedules.py``; written here from its semantics, cited by line) and its stepping convention:
``last_batch_iteration`` starts at -1, the constructor already writes the iteration -1 learning rate into the
optimizer (WarmupLR: ``warmup_min_lr``; WarmupCosineLR: 0), and ``step()`` advances one iteration, so the first
optimizer step runs at the constructor's rate. ``state_dict()`` is ``{'last_batch_iteration': it}``, as DeepSpeed
checkpoints it. The engine steps them once per applied optimizer step (never on an overflow-skipped one).
"""

from __future__ import annotations

import difflib
import logging
import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError

__all__ = ["OneCycle", "WarmupCosineLR", "WarmupDecayLR", "WarmupLR", "build_scheduler"]

_log = logging.getLogger(__name__)
LOG, LINEAR = "log", "linear"  # warmup_type values (lr_schedules.py:60-61)


def _torch_optimizer(optimizer: Any) -> torch.optim.Optimizer:
    """The torch optimizer whose param groups to drive: ``optimizer`` or a wrapper's ``.optimizer``
    (DeepSpeed's get_torch_optimizer, lr_schedules.py:289-298)."""
    if isinstance(optimizer, torch.optim.Optimizer):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    if isinstance(inner, torch.optim.Optimizer):
        return inner
    raise TypeError(f"{type(optimizer).__name__} is not a subclass of torch.optim.Optimizer")


def _per_group(optimizer: torch.optim.Optimizer, value: Any, name: str) -> list[Any]:
    """One value per param group: a scalar repeated, or a list/tuple of the right length."""
    groups = len(optimizer.param_groups)
    if isinstance(value, (list, tuple)):
        if len(value) != groups:
            raise ValueError(f"expected {groups} value for {name}, got {len(value)}")
        return list(value)
    return [value] * groups


def _write_lrs(optimizer: torch.optim.Optimizer, lrs: Sequence[float]) -> list[Any]:
    """Set each group's lr (in place when it is a tensor) and return the groups' lrs."""
    for group, lr in zip(optimizer.param_groups, lrs, strict=False):
        if isinstance(group["lr"], torch.Tensor):
            group["lr"].fill_(lr.squeeze() if isinstance(lr, torch.Tensor) else lr)
        else:
            group["lr"] = lr
    return [group["lr"] for group in optimizer.param_groups]


def _warmup_steps(n: Any) -> int:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"warmup_num_steps must be a positive integer, got {n}")
    return max(2, n)  # DeepSpeed never warms up over fewer than 2 steps (lr_schedules.py:753)


def _warmup_type(kind: str) -> str:
    if kind not in (LOG, LINEAR):
        _log.warning("Using unknown warmup_type: %s. The increasing function is set to default (log)", kind)
        return LOG
    return kind


def _warmup_fraction(it: int, steps: int, kind: str) -> float:
    """How far warmup is at iteration ``it`` (< steps): log(it+1)/log(steps) or it/steps (the log one as
    DeepSpeed rounds it: log(it+1) times a precomputed 1/log(steps), lr_schedules.py:753,796)."""
    return (1.0 / math.log(steps)) * math.log(it + 1) if kind == LOG else it / steps


class _Schedule:
    """What the four schedules share: the iteration counter, step(), the last lrs and the state dict."""

    optimizer: torch.optim.Optimizer
    last_batch_iteration: int
    _last_lr: list[Any] | None = None

    def get_lr(self) -> list[Any]:
        raise NotImplementedError

    def get_last_lr(self) -> list[Any]:
        """The learning rates the last ``step()`` (or the constructor) wrote."""
        if self._last_lr is None:
            raise RuntimeError("need to call step() first")
        return self._last_lr

    def step(self, last_batch_iteration: int | None = None) -> None:
        """Advance to the next iteration (or to ``last_batch_iteration``) and write its learning rates."""
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def state_dict(self) -> dict[str, int]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]


class WarmupLR(_Schedule):
    """lr = min + (max - min) * gamma, gamma rising over ``warmup_num_steps`` (log or linear), then max
    (lr_schedules.py:725-790). ``warmup_max_lr`` None: each group's lr at construction."""

    def __init__(self, optimizer: Any, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = None,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG, last_batch_iteration: int = -1) -> None:
        steps = _warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        if warmup_max_lr is None:
            warmup_max_lr = [group["lr"] for group in self.optimizer.param_groups]
        self.min_lrs = _per_group(self.optimizer, warmup_min_lr, "min_lr")
        self.max_lrs = _per_group(self.optimizer, warmup_max_lr, "max_lr")
        self.delta_lrs = [hi - lo for hi, lo in zip(self.max_lrs, self.min_lrs, strict=False)]
        self.warmup_num_steps = steps
        self.warmup_type = _warmup_type(warmup_type)
        self.last_batch_iteration = last_batch_iteration
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type) if it < self.warmup_num_steps else 1.0

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < 0:  # before the first step: the minimum
            return list(self.min_lrs)
        gamma = self._gamma()
        return [lo + delta * gamma for lo, delta in zip(self.min_lrs, self.delta_lrs, strict=False)]


class WarmupDecayLR(WarmupLR):
    """WarmupLR, then a linear decay to 0 at ``total_num_steps`` (lr_schedules.py:814-840)."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_lr: Any = 0.0, warmup_max_lr: Any = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = LOG, last_batch_iteration: int = -1) -> None:
        self.total_num_steps = total_num_steps
        super().__init__(optimizer, warmup_min_lr, warmup_max_lr, warmup_num_steps, warmup_type,
                         last_batch_iteration)
        if total_num_steps < self.warmup_num_steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)

    def _gamma(self) -> float:
        it = self.last_batch_iteration
        if it < self.warmup_num_steps:
            return _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
        return max(0.0, float(self.total_num_steps - it) / float(max(1.0, self.total_num_steps
                                                                     - self.warmup_num_steps)))


class WarmupCosineLR(_Schedule):
    """lr = each group's initial lr x a ratio: warmup from ``warmup_min_ratio`` to 1, then a cosine down to
    ``cos_min_ratio`` at ``total_num_steps`` (lr_schedules.py:865-960); 0 before the first step."""

    def __init__(self, optimizer: Any, total_num_steps: int, warmup_min_ratio: float = 0.0,
                 warmup_num_steps: int = 1000, cos_min_ratio: float = 0.0001, warmup_type: str = LOG,
                 last_batch_iteration: int = -1) -> None:
        steps = _warmup_steps(warmup_num_steps)
        self.optimizer = _torch_optimizer(optimizer)
        self.total_num_steps = total_num_steps
        self.last_batch_iteration = last_batch_iteration
        self.cos_min_ratio = cos_min_ratio
        self.warmup_type = _warmup_type(warmup_type)
        self.warmup_min_ratio = warmup_min_ratio
        self.warmup_num_steps = steps
        if total_num_steps < steps:
            _log.warning("total_num_steps %s is less than warmup_num_steps %s", total_num_steps, warmup_num_steps)
        self.org_lrs = [g["lr"].clone() if isinstance(g["lr"], torch.Tensor) else g["lr"]
                        for g in self.optimizer.param_groups]
        if last_batch_iteration == -1:
            self._last_lr = _write_lrs(self.optimizer, self.get_lr())

    def get_lr_ratio(self) -> float:
        it = self.last_batch_iteration
        if it < 0:
            return 0.0
        if it < self.warmup_num_steps:
            frac = _warmup_fraction(it, self.warmup_num_steps, self.warmup_type)
            return self.warmup_min_ratio + frac * (1.0 - self.warmup_min_ratio)
        # cosine progress clamped to [0, 1]: the ratio rests at cos_min_ratio past the end (lr_schedules.py:936-945)
        progress = min(1.0, (it - self.warmup_num_steps + 1) / max(1, self.total_num_steps - self.warmup_num_steps))
        return max(0.0, self.cos_min_ratio + (1.0 - self.cos_min_ratio) * (1 + math.cos(math.pi * progress)) / 2)

    def get_lr(self) -> list[Any]:
        if self.last_batch_iteration < 0:
            return [0.0 for _ in self.org_lrs]
        ratio = self.get_lr_ratio()
        return [lr * ratio for lr in self.org_lrs]


class OneCycle(_Schedule):
    """The 1cycle policy (lr_schedules.py:483-700): lr rises from ``cycle_min_lr`` to ``cycle_max_lr`` over
    ``cycle_first_step_size`` iterations, falls back over ``cycle_second_step_size`` (optionally in stairs), then
    decays as ``min_lr / (1 + decay_lr_rate * k / decay_step_size)``. With ``cycle_momentum`` (default True) and an
    optimizer that has ``betas``, beta1 cycles inversely between ``cycle_max_mom`` and ``cycle_min_mom`` and beta2 is
    set to 0.99, as DeepSpeed does; optimizers without betas get no momentum cycling (DeepSpeed warns the same)."""

    def __init__(self, optimizer: Any, cycle_min_lr: Any, cycle_max_lr: Any, decay_lr_rate: float = 0.0,
                 cycle_first_step_size: float = 2000, cycle_second_step_size: float | None = None,
                 cycle_first_stair_count: int = 0, cycle_second_stair_count: int | None = None,
                 decay_step_size: float = 0, cycle_momentum: bool = True, cycle_min_mom: Any = 0.8,
                 cycle_max_mom: Any = 0.9, decay_mom_rate: float = 0.0, last_batch_iteration: int = -1) -> None:
        self.optimizer = opt = _torch_optimizer(optimizer)
        first = float(cycle_first_step_size)
        second = float(cycle_second_step_size) if cycle_second_step_size is not None else first
        if first <= 0:
            raise ValueError(f"cycle_first_step_size must be positive, got {first}")
        if second < 0:
            raise ValueError(f"cycle_second_step_size must be non-negative, got {second}")
        self.first_step_size, self.second_step_size = first, second
        self.total_size = first + second
        self.step_ratio = first / self.total_size
        self.first_stair_count = cycle_first_stair_count
        self.second_stair_count = cycle_first_stair_count if cycle_second_stair_count is None \
            else cycle_second_stair_count
        self.decay_step_size = decay_step_size
        no_decay = math.isclose(decay_step_size, 0)
        self.min_lrs = _per_group(opt, cycle_min_lr, "cycle_min_lr")
        self.max_lrs = _per_group(opt, cycle_max_lr, "cycle_max_lr")
        if last_batch_iteration == -1:
            _write_lrs(opt, self.min_lrs)
        self.decay_lr_rate = decay_lr_rate
        self.skip_lr_decay = no_decay or math.isclose(decay_lr_rate, 0)
        self.skip_mom_decay = no_decay
        self.cycle_momentum = cycle_momentum
        if cycle_momentum and "betas" not in opt.defaults:
            _log.warning("cycle_momentum is disabled because optimizer %s does not support momentum, no betas "
                         "attribute in defaults", type(opt).__name__)
            self.cycle_momentum = False
        elif cycle_momentum:
            self.decay_mom_rate = decay_mom_rate
            self.min_moms = [(m, 0.99) for m in _per_group(opt, cycle_min_mom, "cycle_min_mom")]
            self.max_moms = [(m, 0.99) for m in _per_group(opt, cycle_max_mom, "cycle_max_mom")]
            if last_batch_iteration == -1:
                for betas, group in zip(self.min_moms, opt.param_groups, strict=False):
                    group["betas"] = betas
            self.skip_mom_decay = self.skip_mom_decay or math.isclose(decay_mom_rate, 0)
        self.last_batch_iteration = last_batch_iteration

    def _scale(self) -> float:
        """Where in the triangle the next iteration is: 0 at the bottom, 1 at the peak."""
        it = self.last_batch_iteration + 1
        x = 1.0 + it / self.total_size - math.floor(1 + it / self.total_size)
        if x <= self.step_ratio:
            scale, stairs = x / self.step_ratio, self.first_stair_count
        else:
            scale, stairs = (x - 1) / (self.step_ratio - 1), self.second_stair_count
        if stairs > 0:  # flat stairs, quantised from the integer position (lr_schedules.py:620-632)
            pos = it % self.total_size
            if pos <= self.first_step_size:
                where = pos * stairs / self.first_step_size
            else:
                where = (self.total_size - pos) * stairs / self.second_step_size
            scale = math.floor(where) / stairs
        return scale

    def get_lr(self) -> list[float]:
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            return [lo + (hi - lo) * scale for lo, hi in zip(self.min_lrs, self.max_lrs, strict=False)]
        if self.skip_lr_decay:
            return list(self.min_lrs)
        # 1 + rate * (k / size): DeepSpeed's rounding order (lr_schedules.py:664-666)
        factor = 1 + self.decay_lr_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [lo / factor for lo in self.min_lrs]

    def get_mom(self) -> list[tuple[float, float]] | None:
        if not self.cycle_momentum:
            return None
        if self.last_batch_iteration < self.total_size:
            scale = self._scale()
            pairs = zip(self.min_moms, self.max_moms, strict=False)
            return [(hi[0] - (hi[0] - lo[0]) * scale, lo[1]) for lo, hi in pairs]
        if self.skip_mom_decay:
            return list(self.max_moms)
        factor = 1 + self.decay_mom_rate * ((self.last_batch_iteration - self.total_size + 1) / self.decay_step_size)
        return [(b0 * factor, b1) for b0, b1 in self.max_moms]

    def step(self, batch_iteration: int | None = None) -> None:  # DeepSpeed's argument name differs here
        super().step(batch_iteration)
        moms = self.get_mom()
        if moms is not None:
            for group, betas in zip(self.optimizer.param_groups, moms, strict=False):
                group["betas"] = betas


SCHEDULES: Mapping[str, type] = {c.__name__: c for c in (WarmupLR, WarmupDecayLR, WarmupCosineLR, OneCycle)}


def build_scheduler(section: Mapping[str, Any] | None, optimizer: Any) -> Any:
    """The config's ``scheduler`` section, built over ``optimizer``; None without one.

    ``type`` is looked up among the four above, then in ``torch.optim.lr_scheduler`` (case-sensitive, as
    DeepSpeed does, engine.py:1923-1936); ``params`` become keyword arguments. An unknown type or parameter is a
    DeepSpeedConfigError naming it (DeepSpeed asserts / raises TypeError at initialize)."""
    if section is None:
        return None
    name = section.get("type")
    params = dict(section.get("params") or {})
    if not isinstance(name, str):
        raise DeepSpeedConfigError(f"scheduler.type must be a string naming a schedule, got {name!r}")
    cls = SCHEDULES.get(name)
    if cls is None:
        cls = getattr(torch.optim.lr_scheduler, name, None)
        if not (isinstance(cls, type) and issubclass(cls, torch.optim.lr_scheduler.LRScheduler)):
            base = torch.optim.lr_scheduler.LRScheduler
            known = sorted(SCHEDULES) + sorted(n for n, v in vars(torch.optim.lr_scheduler).items()
                                               if isinstance(v, type) and issubclass(v, base) and n[0] != "_")
            close = difflib.get_close_matches(name, known, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise DeepSpeedConfigError(f"scheduler.type {name!r} is neither a DeepSpeed schedule "
                                       f"({', '.join(SCHEDULES)}) nor in torch.optim.lr_scheduler{hint}")
    try:
        return cls(optimizer, **params)
    except TypeError as err:
        raise DeepSpeedConfigError(f"scheduler {name}: bad params {sorted(params)}: {err}") from None
