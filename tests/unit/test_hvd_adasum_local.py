"""Adasum in one process: the refusals, the VHDD layout, the reference itself, the worker's cases on the local
backend (one rank: the identity), and the Adasum optimizer's protocol against plain torch.

The multi-rank math is tests/multiproc/test_hvd_adasum.py's; here is what one process can check.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from hvd_adasum import CASES, OPT_CASES, fill, pair, tree

import unidist
from unidist.compat.horovod.adasum import AdasumUnsupportedError, adasum_, check_adasum, final_spans
from unidist.compat.horovod.adasum_optimizer import adasum_optimizer
from unidist.compat.horovod.compression import Compression
from unidist.compat.horovod.process_sets import global_process_set
from unidist.errors import InvalidArgumentError, UnidistError

OPT_KEYS = [f"opt-{kind}-k{k}" for kind, k in OPT_CASES]


@pytest.fixture(scope="module")
def mgr() -> Iterator[Any]:
    with unidist.init(environ={}) as m:
        yield m


@pytest.mark.parametrize("size", [0, 3, 5, 6, 12])
def test_non_power_of_two_is_refused(size: int) -> None:
    with pytest.raises(AdasumUnsupportedError, match=r"^Running Adasum with non-power of 2 ranks is not supported"):
        check_adasum(size, True)
    assert issubclass(AdasumUnsupportedError, NotImplementedError) and issubclass(AdasumUnsupportedError,
                                                                                 UnidistError)


def test_non_global_is_refused_first() -> None:
    with pytest.raises(NotImplementedError, match=r"^Adasum does not support non-global process sets yet"):
        check_adasum(3, False)  # Horovod checks the process set before the rank count


@pytest.mark.parametrize("size", [1, 2, 4, 8, 1024])
def test_powers_of_two_pass(size: int) -> None:
    check_adasum(size, True)


@pytest.mark.parametrize("n", [0, 1, 2, 3, 7, 8, 1001])
@pytest.mark.parametrize("size", [2, 4, 8])
def test_final_spans_tile_the_buffer(n: int, size: int) -> None:
    """After the halving levels the ranks' spans cover [0, n) once, in bit-reversed rank order, within one
    element of each other (Horovod's halves: the lower rank keeps ``count >> 1``)."""
    spans = final_spans(n, size)
    bits = size.bit_length() - 1
    order = sorted(range(size), key=lambda r: int(format(r, f"0{bits}b")[::-1], 2))
    at = 0
    for r in order:
        assert spans[r][0] == at, (spans, order)
        at = spans[r][1]
    assert at == n
    lengths = [b - a for a, b in spans]
    assert max(lengths) - min(lengths) <= 1  # halves within one element at every level


def test_reference_pair_cases() -> None:
    """The test's float64 reference on vectors whose Adasum is known in closed form."""
    rng = np.random.default_rng(0)
    g = rng.normal(size=50) * 1e2
    h = np.zeros(50)
    h[:25], g[:25] = rng.normal(size=25), 0.0
    assert np.allclose(pair(g, h), g + h, rtol=0, atol=0)  # orthogonal: the sum
    assert np.array_equal(pair(g, g), g)  # identical: the vector itself
    assert np.allclose(pair(g, 2 * g), 1.5 * g, rtol=1e-15)  # a.b = 2|g|^2: 0 * g + 0.75 * 2g
    assert np.array_equal(pair(g, -g), np.zeros(50))  # opposite: both coefficients 1.5, they cancel
    tiny = np.full(50, 1e-80)  # |tiny|^2 = 5e-159 < sqrt(DBL_MIN): its coefficient stays 1
    assert np.array_equal(pair(tiny, g), tiny + (1.0 - float(tiny @ g) / float(g @ g) * 0.5) * g)
    vs = [rng.normal(size=9) for _ in range(4)]
    assert np.array_equal(tree(vs), pair(pair(vs[0], vs[1]), pair(vs[2], vs[3])))  # the VHDD tree order


def test_worker_cases_on_one_rank(mgr: Any) -> None:
    """One rank: every case of the worker is the identity, and the optimizer is the plain optimizer."""
    report: dict[str, Any] = {}
    fill(mgr, report)
    for key in CASES:
        case = report[key]
        assert "error" not in case and case["err_exact"] == 0.0 and case["spread"] == 0.0, (key, case)
    for key in OPT_KEYS:
        # one rank: Horovod's plain optimizer (p - lr*g, nothing compressed: nothing is reduced) against the
        # emulation's start + delta (one rounding; with fp16 the emulation rounds the delta to float16)
        tol = 1e-3 if "fp16" in key else 1e-7
        assert report[key]["diff"] <= tol and report[key]["moved"] > 0.1, (key, report[key])
    assert report["refusals"]["call"] == "ok"


def test_integer_tensors_are_refused(mgr: Any) -> None:
    with pytest.raises(InvalidArgumentError, match="floating-point"):
        adasum_(mgr, [torch.ones(3), torch.ones(2, dtype=torch.int64)])


def _setup(k: int = 1) -> tuple[torch.nn.Module, torch.optim.Optimizer, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    return model, inner, adasum_optimizer(inner, model.named_parameters(), Compression.none, k, global_process_set)


def _backward(model: torch.nn.Module, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    model(torch.randn(5, 4, generator=g)).pow(2).mean().backward()


def test_optimizer_is_the_users_class_on_its_param_groups(mgr: Any) -> None:
    _, inner, opt = _setup()
    assert isinstance(opt, torch.optim.SGD) and type(opt).__name__ == "SGD"
    assert all(a is b for a, b in zip(opt.param_groups, inner.param_groups, strict=True))
    opt.param_groups[0]["lr"] = 0.05  # a scheduler's change reaches both
    assert inner.param_groups[0]["lr"] == 0.05


def test_one_rank_equals_plain_torch(mgr: Any) -> None:
    """One rank: start + Adasum(delta) is start + delta, the plain optimizer's step (momentum kept locally)."""
    model, _, opt = _setup()
    ref = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    ref.load_state_dict(model.state_dict())
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            _backward(m, step)
            o.step()
    for p, q in zip(model.parameters(), ref.parameters(), strict=True):
        assert torch.allclose(p, q, rtol=0, atol=1e-7), (p, q)  # start + (new - start): one float32 rounding


def test_protocol_refusals(mgr: Any) -> None:
    model, _, opt = _setup()
    _backward(model, 0)
    with pytest.raises(AssertionError, match=r"zero_grad\(\) was called after loss\.backward"):
        opt.zero_grad()
    with pytest.raises(AssertionError, match="more than backward_passes_per_step"):
        _backward(model, 1)
    opt.step()
    opt.zero_grad()
    with pytest.raises(AssertionError, match="Skipping synchronization is not supported"), opt.skip_synchronize():
        pass
    opt.synchronize()  # a no-op, as Horovod's


def test_step_without_backward_and_unused_parameter(mgr: Any) -> None:
    """A parameter without a gradient gets the local step in step() (a zero delta for plain SGD)."""
    model, _, opt = _setup(k=2)
    before = [p.detach().clone() for p in model.parameters()]
    opt.zero_grad()
    opt.step()
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))
    _backward(model, 0)  # one of two passes: step() does the local step itself
    opt.step()
    assert any(not torch.equal(p, b) for p, b in zip(model.parameters(), before, strict=True))


@pytest.mark.parametrize("named", [[("a", 1)], "dup", "missing"])
def test_named_parameters_are_checked(mgr: Any, named: Any) -> None:
    model = torch.nn.Linear(2, 2)
    params = list(model.named_parameters())
    if named == "dup":
        named = [("w", params[0][1]), ("w", params[1][1])]
    elif named == "missing":
        named = params[:1]
    else:
        named = [p[1] for p in params]
    with pytest.raises(InvalidArgumentError):
        adasum_optimizer(torch.optim.SGD(model.parameters(), lr=0.1), named, Compression.none, 1,
                         global_process_set)

