"""What the pipeline test reads back from DeepSpeedExamples' pipeline script (ours, not upstream's).

``step`` prints each step's loss at full precision on global rank 0 (DeepSpeed's own line rounds it to four
decimals); ``finish`` writes every rank's stage parameters (name -> sum and sum of squares, in float64) to
``$DS_EXAMPLE_OUT/rank<r>.json`` so the test can compare the trained weights too.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch.distributed as dist


def step(index: int, loss: Any) -> None:
    if dist.get_rank() == 0:
        print(f"pipeline-loss {index} {float(loss):.9g}", flush=True)


def finish(engine: Any) -> None:
    out = os.environ.get("DS_EXAMPLE_OUT")
    if not out:
        return
    module = engine.module
    weights = {name: [float(p.double().sum()), float(p.double().pow(2).sum())]
               for name, p in module.state_dict().items()}
    Path(out, f"rank{dist.get_rank()}.json").write_text(json.dumps(weights))
