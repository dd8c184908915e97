"""More horovod.torch API cases (see hvd_cases.py): broadcast, alltoall, reducescatter, input checks,
process sets, topology, join/barrier and the autograd backward passes. Importing it extends ``CASES``."""

from __future__ import annotations

from typing import Any

import numpy as np
from hvd_cases import Err, case, chunk, members, ps_err, reduce, x

# ------------------------------------------------------------------------------------------- broadcast
_BC = (3, 2)


@case("broadcast/last-root", lambda r, n: [x("bc", n - 1, _BC), True, x("bc8", n - 1, (5,), "uint8")])
def _broadcast(c: Any) -> list[Any]:
    t = c.t("bc", _BC)
    before = t.clone()
    out = c.hvd.broadcast(t, c.n - 1)
    return [out, bool(c.torch.equal(t, before)), c.hvd.broadcast(c.t("bc8", (5,), "uint8"), root_rank=c.n - 1)]


@case("broadcast_/in-place", lambda r, n: [True, x("bc", 0, _BC, "float64")])
def _broadcast_(c: Any) -> list[Any]:
    t = c.t("bc", _BC, "float64")
    return [c.hvd.broadcast_(t, 0) is t, t]


@case("broadcast_async(_)", lambda r, n: [x("bc", n - 1, _BC), True, x("bc", n - 1, _BC, "int32")])
def _broadcast_async(c: Any) -> list[Any]:
    out = c.hvd.synchronize(c.hvd.broadcast_async(c.t("bc", _BC), c.n - 1))
    t = c.t("bc", _BC, "int32")
    return [out, c.hvd.synchronize(c.hvd.broadcast_async_(t, c.n - 1)) is t, t]


@case("broadcast/bad-roots", lambda r, n: [Err("ValueError"), Err("ValueError"), Err("TypeError")])
def _bad_roots(c: Any) -> list[Any]:
    t = c.t("br", (2,))
    return [c.capture(lambda: c.hvd.broadcast(t, c.n)), c.capture(lambda: c.hvd.broadcast(t, -1)),
            c.capture(lambda: c.hvd.broadcast(t, "0"))]


# ------------------------------------------------------------------------------------------- alltoall
def _a2a(name: str, r: int, n: int, send: list[list[int]], rows: int) -> np.ndarray:
    """What rank r receives when rank q sends ``send[q][j]`` rows (in order) to rank j."""
    parts = []
    for q in range(n):
        start = sum(send[q][:r])
        parts.append(x(name, q, (rows, 2), "int64")[start:start + send[q][r]])
    return np.concatenate(parts)


def _splits(q: int, n: int) -> list[int]:
    """Rank q's uneven splits of 2n rows: 1 row to everyone, the rest to rank q % n (sum 2n - ...)."""
    s = [1] * n
    s[q % n] += n
    return s


@case("alltoall/even-no-splits", lambda r, n: [_a2a("a2", r, n, [[2] * n] * n, 2 * n)])
def _alltoall(c: Any) -> list[Any]:
    out = c.hvd.alltoall(c.t("a2", (2 * c.n, 2), "int64"))
    return [out]  # a tensor alone: no splits were passed


@case("alltoall/splits-list-and-int32-tensor",
      lambda r, n: [_a2a("a3", r, n, [_splits(q, n) for q in range(n)], 2 * n),
                    np.array([_splits(q, n)[r] for q in range(n)], dtype=np.int32)] * 2)
def _alltoall_splits(c: Any) -> list[Any]:
    t = c.t("a3", (2 * c.n, 2), "int64")
    out, got = c.hvd.alltoall(t, splits=_splits(c.r, c.n))
    out2, got2 = c.hvd.alltoall(t, splits=c.torch.tensor(_splits(c.r, c.n), dtype=c.torch.int32))
    return [out, got, out2, got2]


@case("alltoall/splits-sum-below-rows", lambda r, n: [_a2a("a4", r, n, [[1] * n] * n, 2 * n + 1)])
def _alltoall_prefix(c: Any) -> list[Any]:
    out, _ = c.hvd.alltoall(c.t("a4", (2 * c.n + 1, 2), "int64"), splits=[1] * c.n)
    return [out]


@case("alltoall_async/pair", lambda r, n: [_a2a("a2", r, n, [[2] * n] * n, 2 * n),
                                           np.array([2] * n, dtype=np.int32)])
def _alltoall_async(c: Any) -> list[Any]:
    return list(c.hvd.synchronize(c.hvd.alltoall_async(c.t("a2", (2 * c.n, 2), "int64"))))


@case("alltoall/bad-splits", lambda r, n: [Err("ValueError")] * 4, min_size=2)
def _alltoall_bad(c: Any) -> list[Any]:
    t = c.t("a5", (2 * c.n + 1, 2), "int64")
    return [c.capture(lambda: c.hvd.alltoall(t)),  # rows not divisible, no splits
            c.capture(lambda: c.hvd.alltoall(t, splits=[1] * (c.n + 1))),
            c.capture(lambda: c.hvd.alltoall(t, splits=[2 * c.n + 1] * c.n)),
            c.capture(lambda: c.hvd.alltoall(t, splits=c.torch.tensor([1] * c.n)))]  # int64 splits


# ------------------------------------------------------------------------------------------- reducescatter
@case("reducescatter/avg-uneven-rows", lambda r, n: [chunk(reduce("rs", range(n), (2 * n + 1, 3), "float32", "avg"),
                                                           n, r), True])
def _reducescatter(c: Any) -> list[Any]:
    t = c.t("rs", (2 * c.n + 1, 3))
    before = t.clone()
    return [c.hvd.reducescatter(t), bool(c.torch.equal(t, before))]


@case("reducescatter/sum-pre-post-i32", lambda r, n: [chunk(reduce("rsi", range(n), (2 * n,), "int32", "sum", 0.5,
                                                                   3.0), n, r)])
def _reducescatter_int(c: Any) -> list[Any]:
    return [c.hvd.reducescatter(c.t("rsi", (2 * c.n,), "int32"), op=c.hvd.Sum, prescale_factor=0.5,
                                postscale_factor=3.0)]


@case("reducescatter/avg-i64-truncates", lambda r, n: [chunk(reduce("rsa", range(n), (n + 1,), "int64", "avg"), n,
                                                             r)])
def _reducescatter_avg_int(c: Any) -> list[Any]:
    return [c.hvd.reducescatter(c.t("rsa", (c.n + 1,), "int64"))]


@case("reducescatter_async+grouped(+async)",
      lambda r, n: [chunk(reduce("rs", range(n), (2 * n + 1, 3), "float32", "avg"), n, r),
                    chunk(reduce("rs", range(n), (2 * n + 1, 3), "float32", "avg"), n, r),
                    chunk(reduce("rsi", range(n), (2 * n,), "int32", "sum"), n, r)] * 2)
def _reducescatter_async(c: Any) -> list[Any]:
    a = c.hvd.synchronize(c.hvd.reducescatter_async(c.t("rs", (2 * c.n + 1, 3))))
    ts = [c.t("rs", (2 * c.n + 1, 3)), c.t("rsi", (2 * c.n,), "int32")]
    g1 = c.hvd.grouped_reducescatter([ts[0]])
    g2 = c.hvd.grouped_reducescatter([ts[1]], op=c.hvd.Sum)
    h = c.hvd.synchronize(c.hvd.grouped_reducescatter_async([ts[0]]))
    h2 = c.hvd.synchronize(c.hvd.grouped_reducescatter_async([ts[1]], op=c.hvd.Sum))
    return [a, *g1, *g2, a, *h, *h2]


@case("reducescatter/min-and-0-d", lambda r, n: [Err("RuntimeError"), Err("ValueError")])
def _reducescatter_bad(c: Any) -> list[Any]:
    return [c.capture(lambda: c.hvd.reducescatter(c.t("rb", (2 * c.n,)), op=c.hvd.Min)),
            c.capture(lambda: c.hvd.reducescatter(c.torch.tensor(3.0)))]


# ------------------------------------------------------------------------------------------- input checks
@case("inputs/refused", lambda r, n: [Err("AttributeError"), Err("ValueError"), Err("ValueError"),
                                      Err("ValueError"), Err("ValueError"), Err("RuntimeError")])
def _inputs(c: Any) -> list[Any]:
    t = c.torch
    return [c.capture(lambda: c.hvd.allreduce(np.ones(3))),
            c.capture(lambda: c.hvd.allreduce(t.ones(2, dtype=t.bool))),
            c.capture(lambda: c.hvd.allreduce(t.ones(2, dtype=t.bfloat16))),
            c.capture(lambda: c.hvd.allreduce(t.ones(2, dtype=t.uint8))),
            c.capture(lambda: c.hvd.allreduce(t.ones(4, 4).t())),
            c.capture(lambda: c.hvd.allreduce(t.ones(2), op=17))]


# ------------------------------------------------------------------------------------------- process sets
@case("process_set/collectives", lambda r, n: [len(members(n)), r in members(n), ps_err(r, n, members(n).index(r)
      if r in members(n) else 0), ps_err(r, n, reduce("pa", members(n), (4,), "float32", "sum")),
      ps_err(r, n, x("pb", members(n)[-1], (3,))), ps_err(r, n, np.concatenate([x("pg", q, (q + 1,))
                                                                              for q in members(n)])),
      ps_err(r, n, None)], min_size=2)
def _ps(c: Any) -> list[Any]:
    ps = c.ps
    return [ps.size(), ps.included(), c.capture(ps.rank),
            c.capture(lambda: c.hvd.allreduce(c.t("pa", (4,)), op=c.hvd.Sum, process_set=ps)),
            c.capture(lambda: c.hvd.broadcast(c.t("pb", (3,)), members(c.n)[-1], process_set=ps)),
            c.capture(lambda: c.hvd.allgather(c.t("pg", (c.r + 1,)), process_set=ps)),
            c.capture(lambda: c.hvd.barrier(process_set=ps))]


@case("process_set/root-outside-set", lambda r, n: [ps_err(r, n, Err("ValueError"))], min_size=2)
def _ps_root(c: Any) -> list[Any]:
    return [c.capture(lambda: c.hvd.broadcast(c.t("pr", (2,)), 1, process_set=c.ps))]


@case("process_set/add-remove", lambda r, n: [[n - 1], reduce("px", [n - 1], (3,), "float64", "avg") if r == n - 1
                                              else Err("ValueError"), Err("ValueError"), True, False, False, None],
      min_size=2)
def _ps_dynamic(c: Any) -> list[Any]:
    last = c.hvd.add_process_set([c.n - 1])
    out = c.capture(lambda: c.hvd.allreduce(c.t("px", (3,), "float64"), process_set=last))
    dup = c.capture(lambda: c.hvd.add_process_set(c.hvd.ProcessSet([c.n - 1])))
    removed = c.hvd.remove_process_set(last)
    return [last.ranks, out, dup, removed, c.hvd.remove_process_set(last),
            c.hvd.remove_process_set(c.hvd.global_process_set), last.process_set_id]


# ------------------------------------------------------------------------------------------- basics
@case("basics/topology", lambda r, n: [r, n, True, True, True, True, None])
def _topology(c: Any) -> list[Any]:
    h = c.hvd
    ok = 0 <= h.local_rank() < h.local_size() and 0 <= h.cross_rank() < h.cross_size()
    return [h.rank(), h.size(), ok, h.is_initialized(), all(type(f()) is int for f in (
        h.rank, h.size, h.local_rank, h.local_size, h.cross_rank, h.cross_size)),
        type(h.nccl_built()) is int and type(h.mpi_built()) is bool, h.init()]


@case("join+barrier", lambda r, n: [True, None])
def _join(c: Any) -> list[Any]:
    last = c.hvd.join()
    same = c.hvd.allgather(c.torch.tensor([last])).tolist()
    return [type(last) is int and 0 <= last < c.n and len(set(same)) == 1, c.hvd.barrier()]


# ------------------------------------------------------------------------------------------- autograd
def _w(name: str, r: int, shape: tuple[int, ...]) -> np.ndarray:
    return x(name, r, shape, "float64")


@case("grad/allreduce-sum", lambda r, n: [sum(_w("wa", q, (4,)) for q in range(n))])
def _grad_ar(c: Any) -> list[Any]:
    t = c.t("ga", (4,), "float64").requires_grad_()
    (c.hvd.allreduce(t, op=c.hvd.Sum) * c.t("wa", (4,), "float64")).sum().backward()
    return [t.grad]


@case("grad/grouped-allreduce-avg", lambda r, n: [sum(_w("wg", q, (3,)) for q in range(n)) / n])
def _grad_gar(c: Any) -> list[Any]:
    t = c.t("gg", (3,), "float64").requires_grad_()
    (c.hvd.grouped_allreduce([t])[0] * c.t("wg", (3,), "float64")).sum().backward()
    return [t.grad]


def _ag_grad(r: int, n: int) -> Any:
    full = sum(x("wl", q, (n * (n + 1) // 2, 2), "float64") for q in range(n)) / n
    off = sum(q + 1 for q in range(r))
    return [full[off:off + r + 1]]


@case("grad/allgather", _ag_grad)
def _grad_ag(c: Any) -> list[Any]:
    t = c.t("gl", (c.r + 1, 2), "float64").requires_grad_()
    (c.hvd.allgather(t) * c.t("wl", (c.n * (c.n + 1) // 2, 2), "float64")).sum().backward()
    return [t.grad]


@case("grad/broadcast", lambda r, n: [sum(_w("wb", q, (3,)) for q in range(n)) / n * (r == n - 1)])
def _grad_bc(c: Any) -> list[Any]:
    t = c.t("gb", (3,), "float64").requires_grad_()
    (c.hvd.broadcast(t, c.n - 1) * c.t("wb", (3,), "float64")).sum().backward()
    return [t.grad]


@case("grad/alltoall", lambda r, n: [np.concatenate([_w("wt", q, (2 * n,))[2 * r:2 * r + 2] for q in range(n)])])
def _grad_a2a(c: Any) -> list[Any]:
    t = c.t("gt", (2 * c.n,), "float64").requires_grad_()
    (c.hvd.alltoall(t) * c.t("wt", (2 * c.n,), "float64")).sum().backward()
    return [t.grad]


@case("grad/reducescatter-sum", lambda r, n: [np.concatenate([n * chunk(_w("wr", q, (2 * n + 1,)), n, q)
                                                              for q in range(n)])])
def _grad_rs(c: Any) -> list[Any]:
    t = c.t("gr", (2 * c.n + 1,), "float64").requires_grad_()
    rows = [len(v) for v in np.array_split(np.arange(2 * c.n + 1), c.n)]
    w = c.t("wr", (2 * c.n + 1,), "float64")[sum(rows[:c.r]):sum(rows[:c.r + 1])]
    (c.hvd.reducescatter(t, op=c.hvd.Sum) * w).sum().backward()
    return [t.grad]



@case("edges/0-d-and-empty", lambda r, n: [reduce("e0", range(n), (), "float64", "avg"), x("e1", n - 1, (), "float32"),
                                           np.zeros((0, 3), np.float32), np.concatenate([x("e2", q, (q, 2))
                                                                                        for q in range(n)]),
                                           np.zeros((0, 2), np.float32), np.zeros((0, 2), np.float32)])
def _edges(c: Any) -> list[Any]:
    """0-d tensors reduce and broadcast; empty ones (and ranks with no rows) go through every collective."""
    t = c.torch
    return [c.hvd.allreduce(c.t("e0", (), "float64")), c.hvd.broadcast(c.t("e1", ()), c.n - 1),
            c.hvd.allreduce(t.ones(0, 3)), c.hvd.allgather(c.t("e2", (c.r, 2))), c.hvd.reducescatter(t.ones(0, 2)),
            c.hvd.alltoall(t.ones(0, 2))]
