"""A launch's fingerprint file, read: its header, its starting weights, its steps, its checkpoint events.

The file is ``unidist.train.fingerprint``'s: a header line, then a ``"step": 0`` line with the starting weights
(prepared models; not ``hvd.DistributedOptimizer``'s, which is made before the weights are broadcast), one line per
optimizer step, and a line per checkpoint saved or loaded (``"event"``). Lines of format 1 (before the start line
and the events) are read too.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from unidist.errors import InvalidArgumentError

__all__ = ["Run", "read", "sites"]

FORMATS = (1, 2)


@dataclass
class Run:
    """One launch's fingerprint."""

    label: str
    header: dict[str, Any]
    steps: list[dict[str, Any]]
    start: dict[str, Any] | None = None  # the "step": 0 line (the starting weights), where written
    events: list[dict[str, Any]] = field(default_factory=list)  # checkpoints saved and loaded, in order

    @property
    def precision(self) -> str:
        return str(self.header.get("precision", "32"))

    def random_calls(self) -> dict[str, int]:
        """Every random call the run made, by ``site:op``, summed over its steps (none where they were not
        counted: see the header's ``random``)."""
        total: dict[str, int] = {}
        for s in self.steps:
            for key, n in (s.get("random") or {}).items():
                total[key] = total.get(key, 0) + int(n)
        return total

    def loads(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "load"]

    def saves(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e.get("event") == "save"]


def read(path: str | Path, label: str) -> Run:
    """A fingerprint file as a Run; an InvalidArgumentError if it is not one."""
    lines = [json.loads(s) for s in Path(path).read_text().splitlines() if s.strip()]
    if not lines or lines[0].get("unidist_fingerprint") not in FORMATS:
        raise InvalidArgumentError(f"{path} is not a unidist fingerprint (its first line is no header of format "
                                   f"{' or '.join(map(str, FORMATS))})")
    run = Run(label, lines[0], [])
    for line in lines[1:]:
        if "event" in line:
            run.events.append(line)
        elif line.get("step") == 0:
            run.start = line
        else:
            run.steps.append(line)
    return run


def sites(calls: Mapping[str, int]) -> dict[str, dict[str, int]]:
    """``site:op`` counts grouped by op: ``{op: {site: calls}}``."""
    out: dict[str, dict[str, int]] = {}
    for key, n in calls.items():
        site, _, op = key.rpartition(":")
        out.setdefault(op, {})[site] = out.setdefault(op, {}).get(site, 0) + n
    return out
