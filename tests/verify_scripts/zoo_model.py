"""A model of the zoo (tests/zoo) trained as users write it, for ``unidist verify``; a mistake planted on request.

A Hugging Face GPT-2, BERT or Llama from its config, or torch's ``nn.Transformer``, with its dropout on (0.1, as
they ship), the zoo's optimizer (AdamW lr 1e-3 weight decay 0.01 for the Hugging Face models, SGD lr 0.05 momentum
0.9 weight decay 5e-4 for torch's), ``clip_grad_norm=1.0``, ``mgr.loader`` over a fixed data set with a global batch
of 8 rows split across the ranks (``8 // mgr.size`` each), ``--steps`` optimizer steps. Correct as written: every
launch must agree with one process.

``--plant`` (``PLANT`` in the environment wins, so that each ``verify --launch "PLANT=lr mpiexec -n 2"`` can plant
its own) adds one mistake users make when porting, or changes what the script asks for:

- ``batch``: the per-rank batch not divided by the world size (every rank takes 8 rows);
- ``lr``, ``wd``: the learning rate, or the weight decay, scaled by the world size;
- ``shuffle``: the data shuffled with a seed that depends on the rank;
- ``ds-clip``: gradient clipping only in a DeepSpeed config, passed on the deepspeed backend only, nowhere else;
- ``noclip``: no clipping anywhere (what ``ds-clip`` does off DeepSpeed: the run it must be compared with; on
  DeepSpeed it also shows that DeepSpeed's own default, clipping at 1.0, is neutralised).
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path
from typing import Any

import torch

import unidist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # tests/, for the zoo
from zoo.models import BATCH, ZOO, with_dropout

PLANTS = ("none", "batch", "lr", "wd", "shuffle", "ds-clip", "noclip")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="gpt2", choices=("gpt2", "bert", "llama", "torch_transformer"))
    parser.add_argument("--precision", default="32")
    parser.add_argument("--zero", type=int, default=0)
    parser.add_argument("--dropout", type=float, default=0.1)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--plant", default="none", choices=PLANTS)
    args = parser.parse_args(unidist.script_args())
    args.plant = os.environ.get("PLANT") or args.plant
    if args.plant not in PLANTS:
        parser.error(f"PLANT={args.plant!r}: one of {', '.join(PLANTS)}")
    torch.set_num_threads(1)
    entry = ZOO[args.model]
    with unidist.init() as mgr:
        model = with_dropout(args.model, args.dropout)
        opt = entry.optimizer(model)
        scale = mgr.size if args.plant in ("lr", "wd") else 1
        for group in opt.param_groups:
            group["lr" if args.plant == "lr" else "weight_decay"] *= scale
        clip: dict[str, Any] = {} if args.plant == "noclip" else {"clip_grad_norm": 1.0}
        if args.plant == "ds-clip":
            clip = {"deepspeed_config": {"gradient_clipping": 1.0}} if mgr.backend == "deepspeed" else {}
        model, opt = mgr.prepare(model, opt, zero_stage=args.zero, precision=args.precision, **clip)
        rows = [{k: v[i] for k, v in entry.batch(s).items()} for s in range(args.steps) for i in range(BATCH)]
        per_rank = BATCH if args.plant == "batch" else BATCH // mgr.size
        seed = {"seed": mgr.rank, "shuffle": True} if args.plant == "shuffle" else {}
        for step, batch in enumerate(mgr.loader(rows, batch_size=per_rank, drop_last=True, **seed)):
            loss, _ = entry.loss(model, batch, step)
            mgr.backward(loss)
            opt.step()
            opt.zero_grad()
        if mgr.is_main:
            print(f"{args.model} plant={args.plant}: ranks={mgr.size} last loss {loss.item():.5f}", flush=True)


if __name__ == "__main__":
    main()
