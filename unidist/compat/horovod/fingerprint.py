"""The training fingerprint (``unidist.train.fingerprint``) for ``hvd.DistributedOptimizer``.

Horovod's optimizer is given parameters, not a module, and the script calls ``loss.backward()`` itself: its
fingerprint has every step's gradient norm (after the averaging, before the wrapped optimizer steps: a script
that clips between ``synchronize()`` and ``step()`` shows the clipped norm), every parameter's norm and sum, and
the learning rates, but no loss and no rows (``unidist verify`` compares what both runs have). Made only when
``UNIDIST_FINGERPRINT`` is set; each rank reduces an even slice of every parameter, every rank holding them whole.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from unidist.checkpoint.layout import even_slice
from unidist.compat.horovod.basics import manager
from unidist.compat.horovod.process_sets import ProcessSet, comm_of
from unidist.train.fingerprint import Fingerprint, path_for, slice_squares, verify_parts

__all__ = ["attach", "record"]

def attach(named: Sequence[tuple[str, torch.Tensor]], process_set: ProcessSet, passes: int) -> Fingerprint | None:
    """A fingerprint for the optimizer of these named parameters, or None when none was asked for.

    Args:
        named: the optimizer's parameters by name (the same names on every rank).
        process_set: the ranks that average the gradients.
        passes: backward passes per step.
    """
    mgr = manager()
    if mgr.config.fingerprint is None or not process_set.included():
        return None
    comm = comm_of(process_set)
    names = [n for n, _ in named]

    def parts() -> tuple[list[str], dict[str, tuple[int, torch.Tensor]]]:
        return names, {n: even_slice(p, comm.rank, comm.size, copy=False) for n, p in named}
    header = {"backend": mgr.name, "world": mgr.size, "dp": comm.size, "zero_stage": 0, "precision": "32",
              "clip": None, "accumulation": passes, "api": "horovod"}
    made = Fingerprint(path_for(mgr.config.fingerprint), comm, header, parts)
    # Horovod averages (op=Average, its default); no module: rounding moves the gradients only
    made.attach(*verify_parts(mgr.config, None, list(named), 1.0 / comm.size))
    return made


def record(fingerprint: Fingerprint, param_groups: Sequence[dict[str, Any]]) -> None:
    """The step's line, after the wrapped optimizer's step: the averaged gradients every rank holds whole."""
    grads = [p.grad for g in param_groups for p in g["params"] if p.grad is not None]
    grad_sq = slice_squares(grads, fingerprint.comm.rank, fingerprint.comm.size)
    fingerprint.record(grad_sq, True, [g["lr"] for g in param_groups if "lr" in g])
