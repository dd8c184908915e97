"""Models built inside ``mgr.partitioned_build()`` against the same models built whole, under any launcher
(tests/multiproc/test_partitioned_build.py).

For each zoo model named in ``--models``: built partitioned (recording the bytes this rank then holds: its slices,
and the placeholders' one element each) and built whole; both prepared at ``--stage`` in ``--precision``, trained 3
steps with the zoo's optimizer; rank 0 writes ``<out>`` (JSON): per model the bytes held after the build, the
whole model's bytes, how far training moved the whole build, and the largest difference of the full state dicts
before and after training; and ``modifier``: whether an edit the last rank made alone inside
``gathered(modifier_rank=last)`` in a build reached every rank.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from zoo.models import ZOO

import unidist
from unidist.train import zero_init

parser = argparse.ArgumentParser()
parser.add_argument("--models", required=True)
parser.add_argument("--stage", type=int, default=3)
parser.add_argument("--precision", default="32")
parser.add_argument("--out", type=Path, required=True)
args = parser.parse_args(unidist.script_args())


def held(model: torch.nn.Module) -> int:
    """Bytes this rank holds for the model's parameters: each one's data, and its slice where partitioned."""
    total = 0
    for p in model.parameters():
        total += p.untyped_storage().nbytes()
        if zero_init.is_partitioned(p):
            total += -(-p.numel() // zero_init.comm_of(p).size) * p.element_size()
    return total


def diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


with unidist.init() as mgr:
    out: dict[str, object] = {}
    # GatheredParameters' modifier rank inside the build: the last rank's edit, made on it alone, reaches every rank
    with mgr.partitioned_build():
        lin = torch.nn.Linear(5, 3)
        with zero_init.gathered([lin.weight], modifier_rank=mgr.size - 1), torch.no_grad():
            if mgr.rank == mgr.size - 1:
                lin.weight.fill_(5.0)
    zero_init.materialize([lin.weight])
    out["modifier"] = mgr.allreduce(torch.tensor([float((lin.weight == 5.0).all())]), "min").item() == 1.0
    for name in args.models.split(","):
        entry = ZOO[name]
        with mgr.partitioned_build():
            parted = entry.build()
        built_held = held(parted)
        whole = entry.build()
        total = sum(p.numel() * p.element_size() for p in whole.parameters())
        pairs = []
        for model in (parted, whole):
            prepared, opt = mgr.prepare(model, entry.optimizer(model), zero_stage=args.stage,
                                        precision=args.precision)
            pairs.append((prepared, opt))
        first = mgr.full_state_dict(pairs[1][0])
        start = diff(mgr.full_state_dict(pairs[0][0]), first)
        for step in range(3):
            rows = entry.batch(step)
            for prepared, opt in pairs:
                opt.zero_grad()
                loss, _ = entry.loss(prepared, rows, step)
                mgr.backward(loss)
                opt.step()
        end = diff(mgr.full_state_dict(pairs[0][0]), mgr.full_state_dict(pairs[1][0]))
        moved = diff(mgr.full_state_dict(pairs[1][0]), first)  # training changed the weights
        out[name] = {"held": built_held, "total": total, "start": start, "end": end, "moved": moved,
                     "world": mgr.size}
    if mgr.rank == 0:
        args.out.write_text(json.dumps(out))
