"""Strict inputs under a real launcher (issue 12): the bad values whose meaning depends on the world size or
on the engine, each asserting the error type and that the message names the culprit. The one-process table is
tests/unit/test_strict_inputs.py; this one runs inside the collective suite's launch on every launcher.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
import torch

import unidist

Row = tuple[str, Callable[[], Any], type[BaseException], str]


def _prepare_twice(mgr: Any) -> None:
    model = torch.nn.Linear(4, 2)
    mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def _deepspeed(mgr: Any, config: dict[str, Any]) -> Callable[[], Any]:
    def go() -> Any:
        model = torch.nn.Linear(4, 2)
        return mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), deepspeed_config=config)
    return go


def rows(mgr: Any) -> list[Row]:
    """Every row raises on every rank before any message moves, so a failing row cannot desynchronise the rest."""
    n, t = mgr.size, torch.ones(3)
    bad, config = unidist.InvalidArgumentError, unidist.ConfigError
    table: list[Row] = [
        ("root = size", lambda: mgr.broadcast(t, root=n), bad, f"root={n}"),
        ("root numpy = size", lambda: mgr.broadcast(t, root=np.int64(n)), bad, f"root={n}"),
        ("root tensor = size", lambda: mgr.broadcast(t, root=torch.tensor(n)), bad, f"root={n}"),
        ("root float tensor", lambda: mgr.broadcast(t, root=torch.tensor(0.0)), bad, "root="),
        ("scatter root = -1", lambda: mgr.scatter(t, root=-1), bad, "root=-1"),
        ("gather root = size", lambda: mgr.gather(t, root=n), bad, f"root={n}"),
        ("send dest = size", lambda: mgr.send(t, dest=n), bad, f"dest={n}"),
        ("recv source = size", lambda: mgr.recv(t, source=n), bad, f"source={n}"),
        ("new_group rank = size", lambda: mgr.new_group([0, n]), bad, str(n)),
        ("alltoall splits of other length", lambda: mgr.alltoall(torch.ones(n + 1), splits=[1] * (n + 1)), bad,
         "splits"),
        ("scatter of a list", lambda: mgr.scatter([t] * n if mgr.rank == 0 else None), bad,
         "got list" if mgr.rank == 0 else "root rank 0 rejected its input"),
        ("prepare twice", lambda: _prepare_twice(mgr), bad, "prepare"),
    ]
    if n > 1:  # alone, a rank has a mailbox
        table += [("send to itself", lambda: mgr.send(t, dest=mgr.rank), bad, f"dest={mgr.rank}"),
                  ("recv from itself", lambda: mgr.recv(t, source=mgr.rank), bad, f"source={mgr.rank}")]
    if mgr.backend == "deepspeed":
        table += [
            ("deepspeed unknown top-level key", _deepspeed(mgr, {"gradient_cliping": 1.0}), config,
             "'gradient_cliping' (did you mean 'gradient_clipping'?)"),
            ("deepspeed misplaced section key", _deepspeed(mgr, {"stage": 2}), config, "'stage'"),
            ("deepspeed unknown section key", _deepspeed(mgr, {"zero_optimization": {"stagee": 1}}), config,
             "stagee"),
            ("deepspeed removed feature", _deepspeed(mgr, {"amp": {"enabled": True}}), config, "AMP"),
        ]
    return table


def check(mgr: Any) -> list[str]:
    """The rows that did not raise the expected error naming the culprit."""
    failed = []
    for name, trigger, error, names in rows(mgr):
        try:
            trigger()
        except error as err:
            if not isinstance(err, unidist.UnidistError) or names not in str(err):
                failed.append(f"{name}: message does not name {names!r}: {err}")
            continue
        except Exception as err:  # any other type is the failure reported
            failed.append(f"{name}: {type(err).__name__} instead of {error.__name__}: {err}")
            continue
        failed.append(f"{name}: no error")
    return failed
