"""Slurm/pdsh host lists: ``h[1-3,5],login`` <-> ``["h1", "h2", "h3", "h5", "login"]`` (the stand-ins' shared
notation; only a bracket range at the end of a name, which is all the simulated cluster's names need), and
Slurm's tasks-per-node spelling ``2(x2),1``."""

from __future__ import annotations

import re
from collections.abc import Sequence


def expand(spec: str) -> list[str]:
    """Every host of a host list, in order."""
    hosts: list[str] = []
    for m in re.finditer(r"([^,\[]+)(?:\[([^\]]*)\])?", spec):
        prefix, ranges = m.group(1), m.group(2)
        if ranges is None:
            hosts.append(prefix)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            width = len(lo)
            hosts += [f"{prefix}{i:0{width}d}" for i in range(int(lo), int(hi or lo) + 1)]
    return hosts


def compress(hosts: Sequence[str]) -> str:
    """The shortest usual spelling: runs of ``name<number>`` folded into ``name[a-b,c]`` (order kept)."""
    out: list[str] = []
    i = 0
    while i < len(hosts):
        m = re.fullmatch(r"(.*?)(\d+)", hosts[i])
        if not m:
            out.append(hosts[i])
            i += 1
            continue
        prefix, nums, width = m.group(1), [int(m.group(2))], len(m.group(2))  # n08: zero-padded, width kept
        j = i + 1
        while j < len(hosts) and (n := re.fullmatch(re.escape(prefix) + r"(\d+)", hosts[j])) and \
                len(n.group(1)) == width and int(n.group(1)) > nums[-1]:
            nums.append(int(n.group(1)))
            j += 1
        if len(nums) == 1:
            out.append(hosts[i])
        else:
            parts, start = [], nums[0]
            for a, b in zip(nums, [*nums[1:], None], strict=True):
                if b != a + 1:
                    parts.append(f"{start:0{width}d}" if start == a else f"{start:0{width}d}-{a:0{width}d}")
                    start = b
            out.append(f"{prefix}[{','.join(parts)}]")
        i = j
    return ",".join(out)


def tasks_per_node(counts: list[int]) -> str:
    """Slurm's spelling: ``2(x2),1``."""
    out: list[str] = []
    for c in counts:
        if out and out[-1].split("(")[0] == str(c):
            last = out[-1]
            n = int(last[last.index("x") + 1:-1]) if "(" in last else 1
            out[-1] = f"{c}(x{n + 1})"
        else:
            out.append(str(c))
    return ",".join(out)
