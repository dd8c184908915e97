"""Tensors and arrays in and out of collectives: the dtype tables and the conversions every call shares.

Collectives take a ``torch.Tensor`` or a ``numpy.ndarray`` and give back the same kind. Internally every
engine works on contiguous torch tensors; these helpers make them (sharing memory where possible) and turn
results back into what the caller passed.
"""

from __future__ import annotations

import pickle
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from unidist.errors import InvalidArgumentError
from unidist.ops import ReduceOp

__all__ = ["BOOL_OP", "DTYPE_ID", "NP_DTYPES", "SUPPORTED_DTYPES", "Tensorish", "bad_dtype", "from_bytes",
           "inplace_tensor", "output", "row_numel", "rows_like", "split_sizes", "to_bytes", "to_tensor"]

Tensorish = torch.Tensor | np.ndarray

SUPPORTED_DTYPES: tuple[torch.dtype, ...] = (
    torch.float16, torch.bfloat16, torch.float32, torch.float64,
    torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8, torch.bool,
)
DTYPE_ID = {dt: i for i, dt in enumerate(SUPPORTED_DTYPES)}
NP_DTYPES = frozenset(np.dtype(n) for n in ("float16", "float32", "float64", "int8", "int16", "int32",
                                             "int64", "uint8", "bool"))
# On 0/1 bytes, max is logical or and min logical and: numpy's meaning of + and * on bool arrays.
BOOL_OP = {ReduceOp.SUM: ReduceOp.MAX, ReduceOp.MAX: ReduceOp.MAX,
           ReduceOp.PRODUCT: ReduceOp.MIN, ReduceOp.MIN: ReduceOp.MIN}


def split_sizes(n: int, parts: int) -> list[int]:
    """numpy.array_split's sizes: the first ``n % parts`` parts get one extra row."""
    q, r = divmod(n, parts)
    return [q + 1] * r + [q] * (parts - r)


def bad_dtype(dtype: object) -> InvalidArgumentError:
    names = ", ".join(str(d).replace("torch.", "") for d in SUPPORTED_DTYPES)
    return InvalidArgumentError(f"dtype {dtype} is not supported by unidist collectives; supported: {names}")


def to_tensor(x: Tensorish) -> tuple[torch.Tensor, bool]:
    """A contiguous tensor that may share x's memory (read-only use), and whether x was numpy."""
    if isinstance(x, torch.Tensor):
        if x.dtype not in DTYPE_ID:
            raise bad_dtype(x.dtype)
        if x.requires_grad:
            x = x.detach()
        return (x if x.is_contiguous() else x.contiguous()), False
    if isinstance(x, np.ndarray):
        if x.dtype not in NP_DTYPES:
            raise bad_dtype(x.dtype)
        if not (x.flags.c_contiguous and x.flags.writeable):
            x = np.ascontiguousarray(x) if x.flags.writeable else np.array(x, order="C")
        return torch.from_numpy(x), True
    raise InvalidArgumentError(
        f"collectives take a torch.Tensor or a numpy.ndarray, got {type(x).__name__}; "
        "use broadcast_object/allgather_object for other Python objects"
    )


def inplace_tensor(x: Tensorish) -> tuple[torch.Tensor, Callable[[], None] | None]:
    """A contiguous tensor over x's memory when possible, else a copy plus a write-back."""
    if isinstance(x, np.ndarray):
        if not x.flags.writeable:
            raise InvalidArgumentError("in-place collective on a read-only numpy array; pass a writable one")
        if x.dtype not in NP_DTYPES:
            raise bad_dtype(x.dtype)
        if x.flags.c_contiguous:
            return torch.from_numpy(x), None
        tmp = torch.from_numpy(np.ascontiguousarray(x))
        return tmp, lambda: np.copyto(x, tmp.numpy())
    if isinstance(x, torch.Tensor):
        if x.dtype not in DTYPE_ID:
            raise bad_dtype(x.dtype)
        t = x.detach() if x.requires_grad else x
        if t.is_contiguous():
            return t, None
        tmp_t = t.contiguous()

        def writeback() -> None:
            t.copy_(tmp_t)
        return tmp_t, writeback
    raise InvalidArgumentError(f"in-place collectives take a torch.Tensor or a numpy.ndarray, got {type(x).__name__}")


def output(t: torch.Tensor, as_numpy: bool) -> Any:
    return t.numpy() if as_numpy else t


def out_tensor(out: Any, like: torch.Tensor, rows: int, call: str) -> torch.Tensor:
    """The caller's ``out=`` buffer as a tensor over its memory, checked to hold ``rows`` rows of ``like``'s
    shape and dtype (reusing one buffer saves an allocation per call: fresh large buffers page-fault)."""
    if type(out) is torch.Tensor and out.dtype is like.dtype and out.dim() == like.dim() and out.is_contiguous() \
            and not out.requires_grad and out.shape[0] == rows and out.shape[1:] == like.shape[1:] \
            and out.get_device() == like.get_device():
        return out  # the common case, in as few attribute reads as possible
    if isinstance(out, np.ndarray) and out.flags.c_contiguous and out.flags.writeable and out.dtype in NP_DTYPES:
        o = torch.from_numpy(out)
    elif isinstance(out, torch.Tensor) and out.is_contiguous() and not out.requires_grad:
        o = out
    else:
        raise InvalidArgumentError(f"{call}(out=...) takes a contiguous, writable torch.Tensor or numpy.ndarray "
                                   f"(not requiring grad), got {type(out).__name__}")
    want = (rows, *like.shape[1:])
    if o.dtype != like.dtype or tuple(o.shape) != want or o.device != like.device:
        raise InvalidArgumentError(
            f"{call}(out=...) must be {str(like.dtype).replace('torch.', '')}{list(want)} on {like.device}, got "
            f"{str(o.dtype).replace('torch.', '')}{list(o.shape)} on {o.device}")
    return o


def rows_like(t: torch.Tensor, rows: int) -> torch.Tensor:
    """An uninitialised tensor with ``rows`` rows shaped like t's rows."""
    return t.new_empty([rows, *t.shape[1:]])


def row_numel(t: torch.Tensor) -> int:
    n = 1
    for d in t.shape[1:]:
        n *= d
    return n


def to_bytes(obj: Any) -> torch.Tensor:
    """A pickled object as a uint8 tensor (object collectives move it as bytes)."""
    return torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)


def from_bytes(data: np.ndarray) -> Any:
    """Unpickle what a peer sent: peers of one job are trusted (see README, Security)."""
    return pickle.loads(data.tobytes())
