"""What the test reads back from a run of cifar10_deepspeed.py: each step's loss, and the final weights.

The script calls ``step(loss, model_engine)`` after each ``model_engine.step()`` and ``finish(model_engine)`` at
the end (its two marked ``(5)`` lines); ``finish`` writes ``$DS_EXAMPLE_OUT/rank<r>.pt`` and forgets the steps, so
the harness can run the script again in the same process. Nothing is written when DS_EXAMPLE_OUT is unset.

It also keeps what the script prints (its "Finished Training" and test accuracy lines: a tee on stdout from the
first import on), so the test can compare those too. Per step it keeps the rank's loss (its micro batch's mean),
the engine's lr and ``get_global_grad_norm()`` (DeepSpeed reports it from its ZeRO optimizers and None at stage 0
in fp32; the test computes the norm itself too).

The weights are read as one process would hold them: under ZeRO stage 3 each rank keeps only a shard, so they are
gathered first, through whichever engine partitioned them (real DeepSpeed's GatheredParameters, or the running
unidist Manager's gathered_parameters): this is the test reading the result, not the script's API.
"""

from __future__ import annotations

import contextlib
import io
import os
import sys
from typing import Any

import torch

OUT_ENV = "DS_EXAMPLE_OUT"

_steps: list[dict[str, Any]] = []
_printed: list[str] = []


class _Tee(io.TextIOBase):
    """Stdout that also keeps each completed line (launchers prefix or interleave ranks; this is the rank's own)."""

    def __init__(self, stream: Any) -> None:
        self._stream = stream
        self._line = ""

    def write(self, text: str) -> int:
        self._stream.write(text)
        self._line += text
        *done, self._line = self._line.split("\n")
        _printed.extend(done)
        return len(text)

    def flush(self) -> None:
        self._stream.flush()


if not isinstance(sys.stdout, _Tee):
    sys.stdout = _Tee(sys.stdout)


def _number(value: Any) -> float | None:
    """A float from DeepSpeed's tensor-or-float-or-None reports."""
    if value is None:
        return None
    return float(value.item() if isinstance(value, torch.Tensor) else value)


def step(loss: torch.Tensor, engine: Any) -> None:
    """Keep this step's loss, lr and the engine's global gradient norm."""
    lrs = engine.get_lr()
    _steps.append({"loss": float(loss.detach().float().item()), "lr": _number(lrs[0]) if lrs else None,
                   "grad_norm": _number(engine.get_global_grad_norm())})


def _gathered(module: torch.nn.Module) -> Any:
    """A block inside which ``module``'s parameters are whole (a no-op unless ZeRO stage 3 sharded them)."""
    params = list(module.parameters())
    if any(hasattr(p, "ds_id") for p in params):  # real DeepSpeed's stage 3 (also compat under the deepspeed launcher)
        import deepspeed

        return deepspeed.zero.GatheredParameters(params)
    state = sys.modules.get("unidist.compat.deepspeed.state")  # only a compat run has imported it
    mgr = state.running() if state is not None else None
    if mgr is not None:
        return mgr.gathered_parameters(module)
    return contextlib.nullcontext()


def finish(engine: Any) -> None:
    """Write this rank's steps and final weights (collective under stage 3: every rank calls it)."""
    module = engine.module
    with _gathered(module):
        weights = {k: v.detach().clone().float() for k, v in module.state_dict().items()}
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    world = torch.distributed.get_world_size() if torch.distributed.is_initialized() else 1
    out = os.environ.get(OUT_ENV)
    if out:
        os.makedirs(out, exist_ok=True)
        torch.save({"weights": weights, "steps": list(_steps), "printed": list(_printed), "rank": rank,
                    "world_size": world},
                   os.path.join(out, f"rank{rank}.pt"))
    _steps.clear()
    _printed.clear()
