"""Every rank's random number generators, saved in a checkpoint and restored from it.

A resumed run draws the same dropout masks, shuffles and noise as the uninterrupted one only if each rank's
generators continue where they were: torch's CPU generator, the rank's CUDA device's (where CUDA is initialised),
numpy's global ``RandomState`` and Python's ``random`` (Accelerate's ``save_state`` and Megatron's checkpoints keep
the same four). ``capture`` turns one rank's states into tensors and plain numbers (a checkpoint loads with
``torch.load(weights_only=True)``); the trainer gathers every rank's into the checkpoint's ``extra`` under
``KEY``, and ``restore`` gives each rank its own back. At another world size the ranks the checkpoint has a state
for get theirs and the others keep their own; ``restore`` returns the line that says which.
"""

from __future__ import annotations

import random
from typing import Any

import torch

__all__ = ["KEY", "capture", "restore"]

KEY = "unidist.rng"  # every rank's states, by rank, in a checkpoint's extra


def capture() -> dict[str, Any]:
    """This rank's generator states, as tensors and numbers."""
    version, words, gauss = random.getstate()
    state: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "random": {"version": version, "words": torch.tensor(words, dtype=torch.int64), "gauss": gauss},
    }
    # this rank's device only: reading every visible device's would open a CUDA context on each, in every rank
    if torch.cuda.is_available() and torch.cuda.is_initialized():  # type: ignore[no-untyped-call]
        state["cuda"] = torch.cuda.get_rng_state()
    try:
        import numpy as np
    except ImportError:
        return state
    kind, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)
    state["numpy"] = {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                      "has_gauss": int(has_gauss), "cached": float(cached)}
    return state


def _set(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    r = state["random"]
    random.setstate((r["version"], tuple(int(w) for w in r["words"].tolist()), r["gauss"]))
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(cuda)  # the current device: the rank's, as at the save
    n = state.get("numpy")
    if n is not None:
        import numpy as np

        np.random.set_state((n["kind"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"],
                             n["cached"]))


def restore(states: list[dict[str, Any]], rank: int, size: int) -> str | None:
    """Give this rank its state from ``states`` (one per rank of the run that saved them).

    Returns, on rank 0, a line saying what was restored where the world sizes differ (None otherwise)."""
    if rank < len(states):
        _set(states[rank])
    if rank != 0 or len(states) == size:
        return None
    if len(states) < size:
        keep = "keeps its" if len(states) == size - 1 else "keep their"
        return (f"load_checkpoint: random generator states restored on {_ranks(0, len(states) - 1)}; "
                f"{_ranks(len(states), size - 1)} {keep} own (the checkpoint was written by {len(states)} ranks)")
    return (f"load_checkpoint: random generator states restored on {_ranks(0, size - 1)}; the states of "
            f"{_ranks(size, len(states) - 1)} of the {len(states)} that wrote the checkpoint have no rank here")


def _ranks(first: int, last: int) -> str:
    return f"rank {first}" if first == last else f"ranks {first}-{last}"
