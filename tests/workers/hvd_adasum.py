"""Adasum (unidist.compat.horovod.adasum) under any launcher, against a float64 numpy reference.

Every rank builds every rank's inputs from seeds, so each computes the reference itself: Horovod's pairwise
formula applied in the VHDD tree order (ranks 2i and 2i+1 first, then the pairs' results, ...: for 4 ranks
``adasum(adasum(g0, g1), adasum(g2, g3))``), per tensor, in float64 (``exact``), and the same tree rounded into
the tensor's dtype after every level (``rounded``: what a float32 implementation computes, up to the order of
the dot products' float64 sums). Cases (``CASES``): several tensors of different sizes and magnitudes (norms
~1e-3..1e3) in one call, each dtype; orthogonal vectors (-> the sum), identical ones (-> the vector), opposite
pairs (-> 0), zeros, one rank zero, parallel vectors of different lengths, nearly parallel ones, sizes not
divisible by the rank count (down to 1 element on 4 ranks), a non-contiguous tensor. Then the refusals, the
Adasum optimizer against a one-process emulation of its rule (``adasum_train`` / ``emulate``), and, on the horovod
backend, real Horovod's ``allreduce(op=Adasum)`` and ``DistributedOptimizer(op=Adasum)`` on the same inputs.

Writes ``<out>/rank<R>.json``: per case the largest error against each reference (relative to the largest
|reference| element) and whether every rank holds the same result.
"""

from __future__ import annotations

import copy
import os
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from common import report_main

from unidist.compat.horovod.adasum import AdasumUnsupportedError, adasum_, check_adasum
from unidist.errors import CollectiveMismatchError, InvalidArgumentError

TINY = np.sqrt(sys.float_info.min)  # Horovod's guard on squared norms
MIXED = [((7,), 1e-3), ((3, 5), 1.0), ((1000,), 1e3), ((1,), 5.0), ((0,), 1.0), ((4, 4, 3), 0.1)]
DTYPES = {"f64": torch.float64, "f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- the reference
def pair(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Horovod's pairwise Adasum of the lower rank's ``a`` and ``b``, in float64."""
    dot, aa, bb = float(a @ b), float(a @ a), float(b @ b)
    ca = 1.0 - dot / aa * 0.5 if aa >= TINY else 1.0
    cb = 1.0 - dot / bb * 0.5 if bb >= TINY else 1.0
    return ca * a + cb * b  # type: ignore[no-any-return]


def tree(vectors: list[np.ndarray], dtype: torch.dtype | None = None) -> np.ndarray:
    """The VHDD tree order: neighbours first, then pairs of results; rounded into ``dtype`` per level if given."""
    cur = [v.astype(np.float64) for v in vectors]
    while len(cur) > 1:
        cur = [pair(cur[i], cur[i + 1]) for i in range(0, len(cur), 2)]
        if dtype is not None:
            cur = [torch.from_numpy(c).to(dtype).double().numpy() for c in cur]
    return cur[0]


# ---------------------------------------------------------------------------- the inputs
def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _randn(shape: tuple[int, ...], scale: float, *key: object) -> torch.Tensor:
    return torch.randn(shape, generator=_gen(*key), dtype=torch.float64) * scale


def inputs(case: str, rank: int, size: int) -> list[torch.Tensor]:
    """Rank ``rank``'s tensors for ``case`` (float64; the caller casts)."""
    kind = case.split("-")[0]
    if kind == "mixed":
        return [_randn(s, scale, case, i, rank) for i, (s, scale) in enumerate(MIXED)]
    if kind == "orthogonal":  # each rank nonzero on a slice of its own
        t = torch.zeros(16 * size + 3, dtype=torch.float64)
        t[16 * rank:16 * rank + 16] = _randn((16,), 10.0, case, rank)
        return [t]
    if kind == "identical":
        return [_randn((301,), 2.0, case), _randn((5,), 1e-3, case, 1)]
    if kind == "opposite":  # ranks 2i and 2i+1 cancel
        return [_randn((257,), 3.0, case, rank // 2) * (1 if rank % 2 == 0 else -1)]
    if kind == "zeros":
        return [torch.zeros(33, dtype=torch.float64), torch.zeros(2, 3, dtype=torch.float64)]
    if kind == "onezero":  # rank 0 zero: the guard leaves its coefficient at 1
        return [torch.zeros(40, dtype=torch.float64) if rank == 0 else _randn((40,), 1e2, case, rank)]
    if kind == "parallel":
        return [_randn((64,), 1.0, case) * (rank + 1)]
    if kind == "nearly":
        return [_randn((500,), 1e-2, case) + _randn((500,), 1e-5, case, rank)]
    if kind == "odd":
        return [_randn((n,), 1.0, case, n, rank) for n in (1, 3, 5, 1001)]
    if kind == "big":
        return [_randn((100_003,), 0.1, case, rank)]
    raise ValueError(case)


CASES = [f"mixed-{d}" for d in DTYPES] + ["orthogonal-f32", "identical-f32", "opposite-f32", "zeros-f32",
                                          "onezero-f32", "parallel-f32", "nearly-f32", "odd-f32", "odd-f64",
                                          "big-f32", "noncontig-f32"]


def _case_inputs(case: str, rank: int, size: int) -> list[torch.Tensor]:
    if case.startswith("noncontig"):
        return [_randn((7, 9), 1.0, case, rank).t()]
    return inputs(case, rank, size)


def _compare(got: list[torch.Tensor], all_inputs: list[list[torch.Tensor]], dtype: torch.dtype) -> dict[str, Any]:
    """Errors of ``got`` against the float64 tree and the per-level-rounded tree, relative to max |exact|."""
    err_exact = err_rounded = 0.0
    scale = 0.0
    for i, g in enumerate(got):
        vecs = [ins[i].to(dtype).double().reshape(-1).numpy() for ins in all_inputs]
        exact, rounded = tree(vecs), tree(vecs, dtype)
        mine = g.double().reshape(-1).numpy()
        s = float(np.abs(exact).max()) if exact.size else 0.0
        scale = max(scale, s)
        if exact.size:
            err_exact = max(err_exact, float(np.abs(mine - exact).max()) / max(s, 1e-300))
            err_rounded = max(err_rounded, float(np.abs(mine - rounded).max()) / max(s, 1e-300))
    return {"err_exact": err_exact, "err_rounded": err_rounded, "scale": scale}


def _spread(mgr: Any, got: list[torch.Tensor]) -> float:
    flat = torch.cat([g.reshape(-1).double() for g in got])
    return float((mgr.allreduce(flat, "max") - mgr.allreduce(flat, "min")).abs().max()) if flat.numel() else 0.0


def _guard(report: dict[str, Any], key: str, fn: Callable[[], dict[str, Any]]) -> None:
    start = time.perf_counter()
    try:
        report[key] = {**fn(), "seconds": round(time.perf_counter() - start, 3)}
    except Exception as err:
        report[key] = {"error": f"{type(err).__name__}: {err}", "trace": traceback.format_exc()[-3000:]}


def run_case(mgr: Any, case: str) -> dict[str, Any]:
    dtype = DTYPES[case.split("-")[-1]]
    everyone = [_case_inputs(case, r, mgr.size) for r in range(mgr.size)]
    mine = [t.to(dtype).clone() for t in everyone[mgr.rank]]
    adasum_(mgr, mine)
    out = _compare(mine, everyone, dtype)
    out["spread"] = _spread(mgr, mine)
    if case.startswith(("orthogonal", "identical", "opposite", "zeros")):  # exact by construction
        want = {"orthogonal": lambda: sum(t[0] for t in everyone), "identical": lambda: everyone[0][0],
                "opposite": lambda: everyone[0][0] * (mgr.size == 1), "zeros": lambda: everyone[0][0]}
        out["exact_match"] = bool(torch.equal(mine[0].double(), want[case.split("-")[0]]().to(dtype).double()))
    return out


# ---------------------------------------------------------------------------- refusals
def refusals(mgr: Any) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, fn in (("size3", lambda: check_adasum(3, True)), ("nonglobal", lambda: check_adasum(2, False)),
                    ("int", lambda: adasum_(mgr, [torch.ones(3, dtype=torch.int32)])),
                    ("call", lambda: adasum_(mgr, [torch.ones(4)]))):
        try:
            fn()
            out[key] = "ok"
        except (AdasumUnsupportedError, InvalidArgumentError) as err:
            out[key] = {"type": type(err).__name__, "not_impl": isinstance(err, NotImplementedError), "msg": str(err)}
    if mgr.config.check_collectives and mgr.size in (2, 4):  # ranks passing different shapes: named, no hang
        try:
            adasum_(mgr, [torch.ones(3 + mgr.rank)])
            out["mismatch"] = "ok"
        except CollectiveMismatchError as err:
            out["mismatch"] = {"type": type(err).__name__, "msg": str(err)}
    return out


# ---------------------------------------------------------------------------- the optimizer
STEPS, LR = 3, 0.05
OPT_CASES = (("sgd", 1), ("adam", 1), ("sgd", 2), ("sgd-fp16", 1))  # (optimizer[-compression], passes)


def make_model() -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))


def make_opt(kind: str, params: Any) -> torch.optim.Optimizer:
    if kind.startswith("adam"):
        return torch.optim.Adam(params, lr=LR)
    return torch.optim.SGD(params, lr=LR, momentum=0.9)


def batch(rank: int, step: int, part: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = _gen("batch", rank, step, part)
    return torch.randn(8, 6, generator=g) * 2, torch.randn(8, 2, generator=g) * 3


def _loss(model: torch.nn.Module, rank: int, step: int, part: int) -> torch.Tensor:
    x, y = batch(rank, step, part)
    return torch.nn.functional.mse_loss(model(x), y)


def adasum_train(hvd_distopt: Callable[..., Any], kind: str, rank: int, k: int = 1) -> dict[str, torch.Tensor]:
    """``STEPS`` steps of this rank's batches through ``hvd_distopt(opt, named_parameters, k, fp16)``."""
    model = make_model()
    opt = hvd_distopt(make_opt(kind, model.parameters()), model.named_parameters(), k, kind.endswith("fp16"))
    for step in range(STEPS):
        opt.zero_grad()
        for part in range(k):
            _loss(model, rank, step, part).backward()
        opt.step()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def emulate(kind: str, size: int, k: int = 1) -> dict[str, torch.Tensor]:
    """One process: each rank's local optimizer (its own state) steps from the shared weights on its own batch;
    the deltas are combined by ``tree`` (rounded per level, as adasum_ stores them: float32, or float16 for
    fp16 compression) and added."""
    dtype = torch.float16 if kind.endswith("fp16") else torch.float32
    shared = make_model()
    models = [copy.deepcopy(shared) for _ in range(size)]
    opts = [make_opt(kind, m.parameters()) for m in models]
    for step in range(STEPS):
        deltas = []
        for r in range(size):
            with torch.no_grad():
                for p, q in zip(models[r].parameters(), shared.parameters(), strict=True):
                    p.copy_(q)
            opts[r].zero_grad()
            for part in range(k):
                _loss(models[r], r, step, part).backward()
            opts[r].step()
            deltas.append([(p - q).detach() for p, q in zip(models[r].parameters(), shared.parameters(),
                                                            strict=True)])
        with torch.no_grad():
            for i, q in enumerate(shared.parameters()):
                combined = tree([d[i].reshape(-1).to(dtype).double().numpy() for d in deltas], dtype)
                q.add_(torch.from_numpy(combined).float().view(q.shape))
    return {n: p.detach().clone() for n, p in shared.named_parameters()}


def _ours(opt: torch.optim.Optimizer, named: Any, k: int, fp16: bool = False) -> Any:
    """``hvd.DistributedOptimizer(op=hvd.Adasum)`` as a script makes it (hvd.init() inside report_main's
    ``with unidist.init()`` block uses that Manager)."""
    import unidist.compat.horovod as hvd

    hvd.init()
    return hvd.DistributedOptimizer(opt, named_parameters=named, op=hvd.Adasum, backward_passes_per_step=k,
                                    compression=hvd.Compression.fp16 if fp16 else hvd.Compression.none)


def optimizer_cases(mgr: Any, report: dict[str, Any], real: Any) -> None:
    for kind, k in OPT_CASES:
        key = f"opt-{kind}-k{k}"

        def one(kind: str = kind, k: int = k) -> dict[str, Any]:
            got = adasum_train(_ours, kind, mgr.rank, k)
            want = emulate(kind, mgr.size, k)
            out = {"diff": max(float((got[n] - w).abs().max()) for n, w in want.items()),
                   "moved": max(float((got[n] - p.detach()).abs().max()) for n, p in make_model().named_parameters()),
                   "spread": _spread(mgr, list(got.values()))}
            if real is not None:
                theirs = adasum_train(lambda o, named, k, fp16: real.DistributedOptimizer(
                    o, named_parameters=named, op=real.Adasum, backward_passes_per_step=k,
                    compression=real.Compression.fp16 if fp16 else real.Compression.none), kind, mgr.rank, k)
                out["diff_real"] = max(float((got[n] - t).abs().max()) for n, t in theirs.items())
            return out
        _guard(report, key, one)
    model = make_model()
    wrapped = _ours(torch.optim.SGD(model.parameters(), lr=LR), model.named_parameters(), 1)
    report["opt-class"] = {"is_sgd": isinstance(wrapped, torch.optim.SGD), "name": type(wrapped).__name__}


# ---------------------------------------------------------------------------- real Horovod
def real_horovod(mgr: Any) -> Any:
    """horovod.torch when this backend runs on it (then it is initialized), else None."""
    if mgr.backend != "horovod":
        return None
    import horovod.torch as real

    return real


def compare_real(mgr: Any, real: Any) -> dict[str, Any]:
    """Real Horovod's allreduce(op=Adasum) of the same inputs, per tensor and grouped, against ours."""
    out: dict[str, Any] = {"mpi_enabled": bool(real.mpi_enabled())}
    for case in ("mixed-f32", "mixed-f64", "mixed-f16", "odd-f32", "big-f32", "nearly-f32"):
        dtype = DTYPES[case.split("-")[-1]]
        mine = [t.to(dtype) for t in inputs(case, mgr.rank, mgr.size)]
        ours = [t.clone() for t in mine]
        adasum_(mgr, ours)
        try:
            grouped = real.grouped_allreduce([t.clone() for t in mine], op=real.Adasum, name=f"ga.{case}")
            single = [real.allreduce(t.clone(), op=real.Adasum, name=f"a.{case}.{i}") for i, t in enumerate(mine)]
        except Exception as err:
            out[case] = {"error": f"{type(err).__name__}: {err}"}
            continue
        scale = max(float(t.abs().max()) for t in ours if t.numel())
        out[case] = {
            "single": max(float((a - b).abs().max()) for a, b in zip(ours, single, strict=True) if a.numel()) / scale,
            "grouped": max(float((a - b).abs().max()) for a, b in zip(ours, grouped, strict=True) if a.numel()) / scale,
            "bitwise_single": all(torch.equal(a, b) for a, b in zip(ours, single, strict=True)),
        }
    return out


# ---------------------------------------------------------------------------- timing
def timing(mgr: Any, n: int = 1 << 20, reps: int = 10) -> dict[str, float]:
    t = torch.randn(n, generator=_gen("time", mgr.rank))
    out: dict[str, float] = {}
    for key, fn in (("adasum_ms", lambda: adasum_(mgr, [t])), ("allreduce_sum_ms", lambda: mgr.allreduce_(t))):
        fn()
        mgr.barrier()
        start = time.perf_counter()
        for _ in range(reps):
            fn()
        out[key] = (time.perf_counter() - start) / reps * 1e3
    return out


def fill(mgr: Any, report: dict[str, Any]) -> None:
    _guard(report, "refusals", lambda: refusals(mgr))
    if mgr.size & (mgr.size - 1):
        return  # 3 ranks: the refusal is the whole test
    for case in CASES:
        _guard(report, case, lambda case=case: run_case(mgr, case))
    real = real_horovod(mgr)
    if real is not None:
        _guard(report, "real", lambda: compare_real(mgr, real))
    optimizer_cases(mgr, report, real if real is not None and real.mpi_enabled() else None)
    if os.environ.get("ADASUM_TIME"):
        _guard(report, "timing", lambda: timing(mgr))


if __name__ == "__main__":
    report_main(fill)
