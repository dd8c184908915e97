"""Reduction operators, importable without torch."""

from __future__ import annotations

import enum

from unidist.errors import InvalidArgumentError

__all__ = ["ReduceOp", "resolve_op"]


class ReduceOp(str, enum.Enum):
    """Elementwise reductions; a plain string with the member's value works everywhere too."""

    SUM = "sum"
    MEAN = "mean"
    MIN = "min"
    MAX = "max"
    PRODUCT = "product"


_ALIASES: dict[str, ReduceOp] = {op.value: op for op in ReduceOp}
_ALIASES.update(avg=ReduceOp.MEAN, average=ReduceOp.MEAN, prod=ReduceOp.PRODUCT)


def resolve_op(op: ReduceOp | str) -> ReduceOp:
    """Accept a member or its (case-insensitive) name; anything else is an InvalidArgumentError."""
    if isinstance(op, ReduceOp):
        return op
    if isinstance(op, str):
        found = _ALIASES.get(op.lower())
        if found is not None:
            return found
    allowed = ", ".join(repr(o.value) for o in ReduceOp)
    raise InvalidArgumentError(f"unknown reduction op {op!r}; use one of {allowed} or a unidist.ReduceOp")
