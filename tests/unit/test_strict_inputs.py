"""Strict inputs: each bad value fails at start or at the call with a typed error that names the culprit.

One table: (what is wrong, how to trigger it, the error type, a text the message must contain). Variables are
refused when the Manager starts (Config.from_env); arguments at the call. The local backend is a real
one-process Manager; launcher-specific inputs are covered where a launcher matters (test_failures.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

import unidist
from unidist.errors import ConfigError, InvalidArgumentError, UnidistError

# the calls' tensors and prepare's models are CPU tensors: the Manager is told the CPU, so that a GPU machine runs
# the same table (each case starts with no UNIDIST_* variable of the caller's, so this is set by the case itself)
LOCAL_ON_CPU = {"UNIDIST_BACKEND": "local", "UNIDIST_DEVICE": "cpu"}


def _start(env: dict[str, str]) -> Callable[[Any], None]:
    def go(monkeypatch: Any) -> None:
        for k, v in env.items():
            monkeypatch.setenv(k, v)
        with unidist.init():
            pass
    return go


def _call(fn: Callable[[Any], Any]) -> Callable[[Any], None]:
    def go(monkeypatch: Any) -> None:
        for k, v in LOCAL_ON_CPU.items():
            monkeypatch.setenv(k, v)
        with unidist.init() as mgr:
            fn(mgr)
    return go


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(4, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _prepare(**kw: Any) -> Callable[[Any], Any]:
    def go(mgr: Any) -> Any:
        return mgr.prepare(*_model(), **kw)
    return go


def _prepare_twice(mgr: Any) -> None:
    model, opt = _model()
    mgr.prepare(model, opt)
    mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


T = torch.ones(4)
CASES: list[tuple[str, Callable[[Any], None], type[BaseException], str]] = [
    ("timeout inf", _start({"UNIDIST_TIMEOUT": "inf"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("timeout 1e15", _start({"UNIDIST_TIMEOUT": "1e15"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("timeout nan", _start({"UNIDIST_TIMEOUT": "nan"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("timeout negative", _start({"UNIDIST_TIMEOUT": "-1"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("timeout zero", _start({"UNIDIST_TIMEOUT": "0"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("timeout text", _start({"UNIDIST_TIMEOUT": "ten"}), ConfigError, "UNIDIST_TIMEOUT"),
    ("zero stage 4", _start({"UNIDIST_ZERO_STAGE": "4"}), ConfigError, "UNIDIST_ZERO_STAGE"),
    ("zero stage 1.5", _start({"UNIDIST_ZERO_STAGE": "1.5"}), ConfigError, "UNIDIST_ZERO_STAGE"),
    ("bucket 0", _start({"UNIDIST_BUCKET_MB": "0"}), ConfigError, "UNIDIST_BUCKET_MB"),
    ("bucket text", _start({"UNIDIST_BUCKET_MB": "big"}), ConfigError, "UNIDIST_BUCKET_MB"),
    ("compression", _start({"UNIDIST_COMPRESSION": "zip"}), ConfigError, "UNIDIST_COMPRESSION"),
    ("check flag", _start({"UNIDIST_CHECK_COLLECTIVES": "maybe"}), ConfigError, "UNIDIST_CHECK_COLLECTIVES"),
    ("log level", _start({"UNIDIST_LOG_LEVEL": "LOUD"}), ConfigError, "UNIDIST_LOG_LEVEL"),
    ("device gpu", _start({"UNIDIST_DEVICE": "gpu"}), ConfigError, "UNIDIST_DEVICE"),
    ("device cuda:x", _start({"UNIDIST_DEVICE": "cuda:x"}), ConfigError, "UNIDIST_DEVICE"),
    ("backend syntax", _start({"UNIDIST_BACKEND": "Bad Name"}), ConfigError, "UNIDIST_BACKEND"),
    ("config timeout inf", lambda mp: unidist.Config(timeout=float("inf")), ConfigError, "UNIDIST_TIMEOUT"),
    ("config zero 5", lambda mp: unidist.Config(zero_stage=5), ConfigError, "UNIDIST_ZERO_STAGE"),
    ("root out of range", _call(lambda m: m.broadcast(T, root=1)), InvalidArgumentError, "root=1"),
    ("root negative", _call(lambda m: m.broadcast(T, root=-1)), InvalidArgumentError, "root=-1"),
    ("root text", _call(lambda m: m.broadcast(T, root="0")), InvalidArgumentError, "root='0'"),
    ("root float", _call(lambda m: m.broadcast(T, root=0.0)), InvalidArgumentError, "root=0.0"),
    ("root bool", _call(lambda m: m.broadcast(T, root=True)), InvalidArgumentError, "root=True"),
    ("root numpy out of range", _call(lambda m: m.broadcast(T, root=np.int64(3))), InvalidArgumentError, "root=3"),
    ("op unknown", _call(lambda m: m.allreduce(T, op="median")), InvalidArgumentError, "median"),
    ("op None", _call(lambda m: m.allreduce(T, op=None)), InvalidArgumentError, "None"),
    ("mean of ints", _call(lambda m: m.allreduce(torch.ones(4, dtype=torch.int32), op="mean")),
     InvalidArgumentError, "op='mean'"),
    ("complex dtype", _call(lambda m: m.allreduce(torch.ones(4, dtype=torch.complex64))), InvalidArgumentError,
     "complex64"),
    ("list input", _call(lambda m: m.allreduce([1.0, 2.0])), InvalidArgumentError, "list"),
    ("dest out of range", _call(lambda m: m.send(T, dest=5)), InvalidArgumentError, "dest=5"),
    ("source out of range", _call(lambda m: m.recv(T, source=3)), InvalidArgumentError, "source=3"),
    ("tag negative", _call(lambda m: m.send(T, dest=0, tag=-1)), InvalidArgumentError, "tag=-1"),
    ("tag too big", _call(lambda m: m.send(T, dest=0, tag=40000)), InvalidArgumentError, "tag=40000"),
    ("alltoall splits", _call(lambda m: m.alltoall(T, splits=[3])), InvalidArgumentError, "splits"),
    ("reduce_scatter 0-d", _call(lambda m: m.reduce_scatter(torch.tensor(1.0))), InvalidArgumentError,
     "reduce_scatter"),
    ("scatter None at root", _call(lambda m: m.scatter(None)), InvalidArgumentError, "scatter"),
    ("new_group unknown rank", _call(lambda m: m.new_group([5])), InvalidArgumentError, "5"),
    ("new_group duplicate", _call(lambda m: m.new_group([0, 0])), InvalidArgumentError, "0"),
    ("prepare zero stage", _call(_prepare(zero_stage=4)), InvalidArgumentError, "zero_stage"),
    ("prepare bucket", _call(_prepare(bucket_mb=0)), InvalidArgumentError, "bucket_mb"),
    ("prepare clip", _call(_prepare(clip_grad_norm=-1.0)), InvalidArgumentError, "clip_grad_norm"),
    ("prepare passes", _call(_prepare(backward_passes_per_step=0)), InvalidArgumentError,
     "backward_passes_per_step"),
    ("prepare unknown keyword", _call(_prepare(gradient_clipping=1.0)), InvalidArgumentError, "clip_grad_norm"),
    ("prepare compression", _call(_prepare(compression="zip")), InvalidArgumentError, "compression"),
    ("prepare twice", _call(_prepare_twice), InvalidArgumentError, "prepare"),
]


def test_at_least_forty_cases() -> None:
    assert len(CASES) >= 40


@pytest.mark.parametrize(("trigger", "error", "names"), [pytest.param(c[1], c[2], c[3], id=c[0]) for c in CASES])
def test_bad_input_is_a_typed_error_naming_the_culprit(monkeypatch: Any, trigger: Callable[[Any], None],
                                                      error: type[BaseException], names: str) -> None:
    for var in list(__import__("os").environ):
        if var.startswith("UNIDIST_"):
            monkeypatch.delenv(var)
    with pytest.raises(error) as info:
        trigger(monkeypatch)
    assert isinstance(info.value, UnidistError)
    assert names in str(info.value), str(info.value)


def test_integer_like_roots_are_accepted() -> None:
    with unidist.init(environ=LOCAL_ON_CPU) as mgr:
        for root in (np.int64(0), np.int32(0), torch.tensor(0)):
            assert torch.equal(mgr.broadcast(T, root=root), T)
