"""TEMPORARY minimal stand-in (the lead's bootstrap); helper CONFIG's lr_schedules.py replaces it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

__all__ = ["WarmupLR", "build_scheduler"]


class WarmupLR:
    def __init__(self, optimizer: Any, warmup_min_lr: float = 0.0, warmup_max_lr: float = 0.001,
                 warmup_num_steps: int = 1000, warmup_type: str = "log", last_batch_iteration: int = -1) -> None:
        self.optimizer, self.min, self.max = optimizer, warmup_min_lr, warmup_max_lr
        self.n, self.type, self.last_batch_iteration = max(2, warmup_num_steps), warmup_type, last_batch_iteration
        self._set()

    def _set(self) -> None:
        it = self.last_batch_iteration
        if it < 0:
            gamma = 0.0
        elif it < self.n:
            gamma = math.log(it + 1) / math.log(self.n) if self.type == "log" else it / self.n
        else:
            gamma = 1.0
        for g in self.optimizer.param_groups:
            g["lr"] = self.min + (self.max - self.min) * gamma

    def step(self, last_batch_iteration: int | None = None) -> None:
        self.last_batch_iteration = self.last_batch_iteration + 1 if last_batch_iteration is None \
            else last_batch_iteration
        self._set()

    def get_lr(self) -> list[float]:
        return [g["lr"] for g in self.optimizer.param_groups]

    def state_dict(self) -> dict[str, Any]:
        return {"last_batch_iteration": self.last_batch_iteration}

    def load_state_dict(self, sd: Mapping[str, Any]) -> None:
        self.last_batch_iteration = sd["last_batch_iteration"]
        self._set()


def build_scheduler(section: Mapping[str, Any], optimizer: Any) -> Any:
    return WarmupLR(optimizer, **section.get("params", {}))
