"""What the training workers share: start the Manager, fill a report, write <out>/rank<R>.json."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import unidist


def max_diff(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor]) -> float:
    """max |got - want| over want's tensors, compared in float32."""
    return max(float((got[k].float() - w.float()).abs().max()) for k, w in want.items())


def spread(comm: Any, weights: dict[str, torch.Tensor]) -> float:
    """max over elements of (largest - smallest) across the ranks of ``comm``: 0.0 when every rank agrees."""
    flat = torch.cat([t.reshape(-1).float() for t in weights.values()])
    return float((comm.allreduce(flat, "max") - comm.allreduce(flat, "min")).abs().max())


def report_main(fill: Callable[[Any, dict[str, Any]], None]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        fill(mgr, report)
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
