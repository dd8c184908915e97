"""The precision modes, one table: each mode's dtypes and how it casts and scales.

``prepare(precision=)`` (``UNIDIST_PRECISION``) takes one of these names. Everything that depends on a mode reads
its row here, never its name: the trainer and ZeRO (what the parameters, gradients, reductions and optimizer are
in: train/precision.py), the DeepSpeed translations (engines/deepspeed/config.py, compat/deepspeed/config.py), the
fingerprint and ``unidist verify``'s bound (the weights' rounding unit). A new mode is one row.

The base layer: plain Python, no torch (requests are checked before torch is imported), so dtypes are torch's
attribute names (``getattr(torch, name)``).

- ``"32"``: float32 everywhere (the default).
- ``"bf16-mixed"`` / ``"fp16-mixed"``: the forward under ``torch.autocast``; parameters, gradients, reductions and
  optimizer state float32 (the parameters are the master weights). fp16 scales the loss (GradScaler's rule).
- ``"bf16-true"``: the model itself bfloat16, and its gradients, reductions and optimizer state. No master copy.
- ``"bf16-master"``: a bfloat16 model (forward, gradients, their averaging all in bfloat16) whose optimizer steps
  float32 *master copies*, written back rounded to bfloat16 after each step: DeepSpeed's ``bf16`` section, FSDP2's
  ``MixedPrecisionPolicy(param_dtype=torch.bfloat16)`` with float32 parameters sharded.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["EPSILON", "MODES", "PRECISIONS", "Mode", "masters_of"]

# machine epsilon (torch.finfo(dtype).eps) of each dtype a mode names, kept here so the base layer needs no torch
EPSILON = {"float32": 2.0**-23, "bfloat16": 2.0**-7, "float16": 2.0**-10}


@dataclass(frozen=True)
class Mode:
    """One precision mode's row (dtypes as torch attribute names)."""

    name: str
    params: str  # the module's parameters, and so their gradients
    compute: str  # what the forward computes in
    reduce: str  # what gradients are averaged in
    master: str  # what the optimizer steps and keeps its state in (== params: no master copy)
    autocast: bool  # the forward runs under torch.autocast(compute) over params
    scaled: bool  # dynamic loss scaling (fp16)

    @property
    def keeps_masters(self) -> bool:
        """The optimizer steps copies in another dtype than the parameters, written back after each step."""
        return self.master != self.params

    @property
    def weight_eps(self) -> float:
        """The machine epsilon of the parameters' dtype: the rounding of the weights a run reports."""
        return EPSILON[self.params]

    @property
    def low(self) -> bool:
        """Some of the arithmetic is below float32 (results then depend on how a batch is split)."""
        return self.compute != "float32" or self.params != "float32"


MODES: dict[str, Mode] = {m.name: m for m in (
    Mode("32", "float32", "float32", "float32", "float32", autocast=False, scaled=False),
    Mode("bf16-mixed", "float32", "bfloat16", "float32", "float32", autocast=True, scaled=False),
    Mode("fp16-mixed", "float32", "float16", "float32", "float32", autocast=True, scaled=True),
    Mode("bf16-true", "bfloat16", "bfloat16", "bfloat16", "bfloat16", autocast=False, scaled=False),
    Mode("bf16-master", "bfloat16", "bfloat16", "bfloat16", "float32", autocast=False, scaled=False),
)}
PRECISIONS = tuple(MODES)  # the names, in the order the docs list them


def masters_of(params: str) -> Mode | None:
    """The mode whose model is ``params`` (a dtype name) with float32 master copies: what DeepSpeed's ``bf16``
    (and ``fp16``) section means. None where no mode is that (today: float16, whose DeepSpeed section maps to
    ``"fp16-mixed"``, autocast with the same loss scaling)."""
    return next((m for m in MODES.values() if m.params == params and m.master == "float32" and m.keeps_masters),
                None)
