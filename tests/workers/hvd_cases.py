"""The table of horovod.torch API cases run by tests/workers/hvd_api.py, with numpy's expected results.

Each case runs one call pattern on ``hvd`` (unidist.compat.horovod or the real horovod.torch) with per-rank
deterministic inputs (``x(case, rank, shape, dtype)``: floats ~100, ints in +-1000) and returns a list of
items (tensors, ints, bools, None); ``want(r, n)`` recomputes the same list with numpy from the same inputs
and Horovod's documented math (Average = sum * postscale / size, prescale per rank before the sum, integers
scaled in double and truncated), or ``Err(builtin)`` for an exception. ``horovod=False`` marks cases where
unidist deliberately differs (Horovod crashes or accepts garbage there): the real-Horovod run skips them.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

FLOATS = ("float16", "float32", "float64")


@dataclass(frozen=True)
class Err:
    """An expected exception: the builtin class it must be (Horovod's)."""

    base: str


@dataclass(frozen=True)
class Case:
    name: str
    run: Callable[[Any], list[Any]]  # ctx -> items
    want: Callable[[int, int], Any]  # (rank, size) -> items or Err
    min_size: int = 1
    horovod: bool = True  # also run on real Horovod
    checked: bool = False  # only under UNIDIST_CHECK_COLLECTIVES=1 (unidist's desync check)


def x(case: str, r: int, shape: Sequence[int], dtype: str = "float32") -> np.ndarray:
    """Rank r's input of a case: the same in the worker and the test process."""
    rng = np.random.default_rng(zlib.crc32(f"{case}/{r}".encode()))
    if dtype in FLOATS:
        scale = 10.0 if dtype == "float16" else 100.0
        return np.asarray(rng.standard_normal(shape) * scale).astype(dtype)
    lo, hi = {"uint8": (0, 255), "int8": (-100, 100)}.get(dtype, (-1000, 1000))
    return np.asarray(rng.integers(lo, hi, size=shape)).astype(dtype)


def scale(a: np.ndarray, f: float) -> np.ndarray:
    """Horovod's scaling: in double, truncated toward zero for integers."""
    if f == 1.0:
        return a
    out = a.astype(np.float64) * f
    return (np.trunc(out) if a.dtype.kind in "iu" else out).astype(a.dtype)


def reduce(case: str, ranks: Sequence[int], shape: Sequence[int], dtype: str, op: str, pre: float = 1.0,
           post: float = 1.0) -> np.ndarray:
    ins = [scale(x(case, r, shape, dtype), pre).astype(np.float64 if dtype in FLOATS else np.int64)
           for r in ranks]
    if op in ("sum", "avg"):
        total = np.sum(ins, axis=0)
    else:
        total = {"min": np.min, "max": np.max, "prod": np.prod}[op](ins, axis=0)
    factor = post / len(ranks) if op == "avg" else post
    if dtype in FLOATS:
        return (total * factor).astype(dtype)
    return scale(total, factor).astype(dtype)


def rows_of(n_rows: int, n: int) -> list[int]:
    return [len(c) for c in np.array_split(np.arange(n_rows), n)]


def chunk(a: np.ndarray, n: int, r: int) -> np.ndarray:
    bounds = np.cumsum([0, *rows_of(a.shape[0], n)])
    return a[bounds[r]:bounds[r + 1]]


def members(n: int) -> list[int]:
    """The registered process set used by the cases: the even ranks (n >= 2)."""
    return list(range(0, n, 2))


def ps_err(r: int, n: int, value: Any) -> Any:
    return value if r in members(n) else Err("ValueError")


# ------------------------------------------------------------------------------------------- the table
CASES: list[Case] = []


def case(name: str, want: Callable[[int, int], Any], *, min_size: int = 1, horovod: bool = True,
         checked: bool = False) -> Callable[[Callable[[Any], list[Any]]], Callable[[Any], list[Any]]]:
    def deco(fn: Callable[[Any], list[Any]]) -> Callable[[Any], list[Any]]:
        CASES.append(Case(name, fn, want, min_size, horovod, checked))
        return fn
    return deco


def _ar(case_name: str, shape: tuple[int, ...], dtype: str, op: str | None, pre: float = 1.0, post: float = 1.0,
        **kw: Any) -> None:
    hop = {"avg": "Average", "sum": "Sum", "min": "Min", "max": "Max", "prod": "Product", None: None}[op]

    def run(c: Any) -> list[Any]:
        t = c.t(case_name, shape, dtype)
        before = t.clone()
        args = dict(kw)
        if hop is not None:
            args["op"] = getattr(c.hvd, hop)
        if pre != 1.0 or post != 1.0:
            args.update(prescale_factor=pre, postscale_factor=post)
        out = c.hvd.allreduce(t, **args)
        return [out, bool(c.torch.equal(t, before))]

    def want(r: int, n: int) -> Any:
        return [reduce(case_name, range(n), shape, dtype, op or "avg", pre, post), True]
    CASES.append(Case(case_name, run, want))


_ar("allreduce/avg/f32", (5, 3), "float32", None)
_ar("allreduce/avg/f64/named", (7,), "float64", "avg", name="grad.w")
_ar("allreduce/avg/f16", (6,), "float16", "avg")
_ar("allreduce/avg/i32-truncates", (9,), "int32", "avg")
_ar("allreduce/sum/i64", (4, 2), "int64", "sum")
_ar("allreduce/min/f32", (8,), "float32", "min")
_ar("allreduce/max/i32", (8,), "int32", "max")
_ar("allreduce/pre-post/f64", (5,), "float64", "sum", 0.5, 3.0)
_ar("allreduce/pre/i32-truncates-per-rank", (9,), "int32", "sum", 0.5)
_ar("allreduce/avg-post/i64", (9,), "int64", "avg", 1.0, 3.0)
_ar("allreduce/max-pre-post/i64", (6,), "int64", "max", 0.5, 3.0)
_ar("allreduce/min-negative-pre/f32", (6,), "float32", "min", -1.0)


@case("allreduce/product/f64", lambda r, n: [np.prod([1 + x("pr", q, (5,), "float64") / 1000 for q in range(n)],
                                                     axis=0)])
def _product(c: Any) -> list[Any]:
    return [c.hvd.allreduce(1 + c.t("pr", (5,), "float64") / 1000, op=c.hvd.Product)]


@case("allreduce/average=False-is-sum", lambda r, n: [reduce("af", range(n), (4,), "float32", "sum")])
def _average_false(c: Any) -> list[Any]:
    return [c.hvd.allreduce(c.t("af", (4,), "float32"), average=False)]


@case("allreduce/op-and-average", lambda r, n: Err("ValueError"))
def _both(c: Any) -> list[Any]:
    return [c.hvd.allreduce(c.t("ao", (2,)), average=True, op=c.hvd.Sum)]


@case("allreduce_/in-place", lambda r, n: [True, reduce("ip", range(n), (3, 3), "float32", "avg")])
def _inplace(c: Any) -> list[Any]:
    t = c.t("ip", (3, 3))
    out = c.hvd.allreduce_(t)
    return [out is t, t]


@case("allreduce_async/poll-sync", lambda r, n: [True, reduce("as", range(n), (4,), "float64", "sum"), True,
                                                 None, Err("ValueError")])
def _async(c: Any) -> list[Any]:
    t = c.t("as", (4,), "float64")
    before = t.clone()
    h = c.hvd.allreduce_async(t, op=c.hvd.Sum)
    polled = c.hvd.poll(h)
    out = c.hvd.synchronize(h)
    return [isinstance(polled, bool), out, bool(c.torch.equal(t, before)), c.hvd.synchronize(h),
            c.capture(lambda: c.hvd.poll(h))]


@case("allreduce_async_/in-place", lambda r, n: [True, reduce("ai", range(n), (4,), "int64", "avg", 1.0, 2.0)])
def _async_(c: Any) -> list[Any]:
    t = c.t("ai", (4,), "int64")
    h = c.hvd.allreduce_async_(t, postscale_factor=2.0)
    return [c.hvd.synchronize(h) is t, t]


@case("handles/unknown", lambda r, n: [None, Err("ValueError")])
def _unknown(c: Any) -> list[Any]:
    return [c.hvd.synchronize(987654), c.capture(lambda: c.hvd.poll(987654))]


# Real Horovod refuses the second name only while the first op is still queued on that rank: measured, rank 1
# sometimes finds it done already (a race); here a name is held until synchronize(), so the refusal is certain.
@case("names/in-flight-duplicate", lambda r, n: [Err("ValueError"), reduce("nd", range(n), (2,), "float32", "avg")],
      horovod=False)
def _dup_name(c: Any) -> list[Any]:
    h = c.hvd.allreduce_async(c.t("nd", (2,)), name="same")
    err = c.capture(lambda: c.hvd.allreduce_async(c.t("nd", (2,)), name="same"))
    return [err, c.hvd.synchronize(h)]


def _g_want(r: int, n: int) -> Any:
    return [reduce("g1", range(n), (3,), "float32", "sum", 1.0, 0.5), reduce("g2", range(n), (2, 2), "int32", "sum",
                                                                            1.0, 0.5)]


@case("grouped_allreduce/mixed-dtypes", _g_want)
def _grouped(c: Any) -> list[Any]:
    return list(c.hvd.grouped_allreduce([c.t("g1", (3,)), c.t("g2", (2, 2), "int32")], op=c.hvd.Sum,
                                        postscale_factor=0.5))


@case("grouped_allreduce_/in-place", lambda r, n: [True, True, *_g_want(r, n)])
def _grouped_(c: Any) -> list[Any]:
    ts = [c.t("g1", (3,)), c.t("g2", (2, 2), "int32")]
    outs = c.hvd.grouped_allreduce_(ts, op=c.hvd.Sum, postscale_factor=0.5)
    return [outs[0] is ts[0], outs[1] is ts[1], *ts]


@case("grouped_allreduce_async(_)", lambda r, n: [*_g_want(r, n), *_g_want(r, n)])
def _grouped_async(c: Any) -> list[Any]:
    h1 = c.hvd.grouped_allreduce_async([c.t("g1", (3,)), c.t("g2", (2, 2), "int32")], op=c.hvd.Sum,
                                       postscale_factor=0.5)
    ts = [c.t("g1", (3,)), c.t("g2", (2, 2), "int32")]
    h2 = c.hvd.grouped_allreduce_async_(ts, op=c.hvd.Sum, postscale_factor=0.5)
    return [*c.hvd.synchronize(h1), *c.hvd.synchronize(h2)]


@case("grouped_allreduce/empty", lambda r, n: Err("ValueError"))
def _grouped_empty(c: Any) -> list[Any]:
    return [c.hvd.grouped_allreduce([])]


# ------------------------------------------------------------------------------------------- allgather
def _ag(case_name: str, n: int, dtype: str = "float32", ranks: Sequence[int] | None = None) -> np.ndarray:
    return np.concatenate([x(case_name, q, (q + 1, 2), dtype) for q in (ranks if ranks is not None else range(n))])


@case("allgather/uneven-rows", lambda r, n: [_ag("ag", n), _ag("ag8", n, "int8")])
def _allgather(c: Any) -> list[Any]:
    return [c.hvd.allgather(c.t("ag", (c.r + 1, 2))), c.hvd.allgather(c.t("ag8", (c.r + 1, 2), "int8"))]


@case("allgather_async", lambda r, n: [_ag("ag", n)])
def _allgather_async(c: Any) -> list[Any]:
    return [c.hvd.synchronize(c.hvd.allgather_async(c.t("ag", (c.r + 1, 2))))]


@case("allgather/0-d", lambda r, n: Err("IndexError"))
def _allgather_0d(c: Any) -> list[Any]:
    return [c.hvd.allgather(c.torch.tensor(1.0))]


@case("grouped_allgather(+async)", lambda r, n: [_ag("ag", n), _ag("ag8", n, "int8")] * 2)
def _grouped_allgather(c: Any) -> list[Any]:
    ts = [c.t("ag", (c.r + 1, 2)), c.t("ag8", (c.r + 1, 2), "int8")]
    return [*c.hvd.grouped_allgather(ts), *c.hvd.synchronize(c.hvd.grouped_allgather_async(ts))]


@case("names/mismatch-checked", lambda r, n: [Err("RuntimeError"), reduce("nm", range(n), (2,), "float32", "avg")],
      min_size=2, horovod=False, checked=True)
def _name_mismatch(c: Any) -> list[Any]:
    """Horovod matches calls by name: ranks naming one call differently would each wait for the other name.
    unidist's check mode compares names (CollectiveMismatchError, a RuntimeError) before any data moves."""
    return [c.capture(lambda: c.hvd.allreduce(c.t("nm", (2,)), name=f"rank{c.r}")), c.hvd.allreduce(c.t("nm", (2,)))]


@case("in-place/parameters", lambda r, n: [True, reduce("pp", range(n), (3,), "float32", "sum", 2.0), True,
                                           x("pq", 0, (2,)), True])
def _parameters(c: Any) -> list[Any]:
    """In-place ops write parameters (leaves that require grad) outside autograd, as Horovod's kernels do."""
    p = c.torch.nn.Parameter(c.t("pp", (3,)))
    q = c.torch.nn.Parameter(c.t("pq", (2,)))
    h = c.hvd.allreduce_async_(p, op=c.hvd.Sum, prescale_factor=2.0)
    return [c.hvd.synchronize(h) is p, p, c.hvd.broadcast_(q, 0) is q, q, p.requires_grad]
