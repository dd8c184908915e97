"""Which layers each pipeline stage holds: DeepSpeed's three ``partition_method`` values, with its results.

DeepSpeed 0.19.8 (runtime/pipe/module.py ``_partition_layers``, runtime/utils.py) cuts the layer list into
``num_stages`` contiguous runs given as boundaries ``parts`` (stage s holds layers ``parts[s]:parts[s + 1]``):

- ``"uniform"``: equal counts, the first ``residual`` stages one layer more;
- ``"parameters"``: balanced by each layer's trainable parameter count;
- ``"type:<regex>"``: balanced by a weight of 1 for each layer whose class name the regex finds (case-insensitive).

"Balanced" is the linear partition problem solved by dynamic programming: minimise (largest run - smallest run),
ties going to the later cut, as DeepSpeed's solver decides them; the same weights give the same cuts, so a
script's stages hold the same layers here as under DeepSpeed (and its checkpoints the same names).
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

from unidist.errors import InvalidArgumentError

__all__ = ["METHODS", "balanced", "check_method", "uniform"]

METHODS = ("parameters", "uniform", "type:<regex>")


def check_method(method: object) -> str:
    """The method, lower-cased as DeepSpeed reads it; anything else is an InvalidArgumentError naming the three."""
    if not isinstance(method, str):
        raise InvalidArgumentError(f"PipelineModule(partition_method={method!r}) takes a string: one of "
                                   f"{', '.join(METHODS)}")
    low = method.lower()
    if low in ("parameters", "uniform"):
        return low
    if low.startswith("type:") and low[5:]:
        try:
            re.compile(low[5:])
        except re.error as exc:
            raise InvalidArgumentError(f"PipelineModule(partition_method={method!r}): {exc}") from None
        return low
    raise InvalidArgumentError(f"PipelineModule(partition_method={method!r}) is not a partition method; use one of "
                               f"{', '.join(METHODS)} (DeepSpeed's 'profile' is not implemented there either)")


def uniform(items: int, parts: int) -> list[int]:
    """Boundaries of ``parts`` runs of ``items`` layers: equal sizes, the remainder to the first runs."""
    if items <= parts:
        return [min(p, items) for p in range(parts + 1)]
    size, extra = divmod(items, parts)
    return [p * size + min(p, extra) for p in range(parts + 1)]


def balanced(weights: Sequence[float], parts: int) -> list[int]:
    """Boundaries of ``parts`` contiguous runs of ``weights`` whose sums differ least (largest - smallest)."""
    n = len(weights)
    if n <= parts:
        return uniform(n, parts)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + float(w))
    inf = math.inf
    # best[(i, j)] = (cost, largest, smallest) of the first i layers in j runs; cut[(i, j)] = where run j starts
    cost = [[inf] * (parts + 1) for _ in range(n + 1)]
    high = [[inf] * (parts + 1) for _ in range(n + 1)]
    low = [[inf] * (parts + 1) for _ in range(n + 1)]
    cut = [[0] * (parts + 1) for _ in range(n + 1)]
    cost[0][0] = high[0][0] = 0.0
    for i in range(1, n + 1):
        for j in range(1, min(i, parts) + 1):
            for k in range(i):
                run = prefix[i] - prefix[k]
                hi, lo = max(high[k][j - 1], run), min(low[k][j - 1], run)
                if cost[i][j] >= hi - lo:  # ">=": an equal cost moves the cut later, as DeepSpeed's solver
                    cost[i][j], high[i][j], low[i][j], cut[i][j] = hi - lo, hi, lo, k
    bounds = [n]
    for j in range(parts, 0, -1):
        bounds.append(cut[bounds[-1]][j])
    return bounds[::-1]


def type_weights(names: Sequence[str | None], pattern: str) -> list[int]:
    """1 for each layer whose class name ``pattern`` finds (case-insensitive), else 0; none found is an error."""
    found = re.compile(pattern, re.IGNORECASE)
    weights = [1 if name is not None and found.search(name) else 0 for name in names]
    if not any(weights):
        raise InvalidArgumentError(f"PipelineModule(partition_method='type:{pattern}'): no layer's class name "
                                   f"matches {pattern!r} (the layers: {', '.join(n or '?' for n in names)})")
    return weights
