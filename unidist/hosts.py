"""The hosts a job runs on, from ``--hosts h1:2,h2:2``, a hostfile, or a Slurm allocation's variables.

Pure functions of their text (or environment mapping), so ``unidist launch`` and the tests read hosts the same
way; how each launcher spells a host list is its row's business (``unidist.launch.LAUNCHERS``). Every
malformed input raises :class:`unidist.errors.HostsError` naming what was read and how to write it.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from unidist.errors import HostsError

__all__ = ["Host", "expand_nodelist", "format_hosts", "hostfile_text", "parse_hostfile", "parse_hosts",
           "read_hostfile", "slurm_hosts", "tasks_per_node"]

_NAME = r"[A-Za-z0-9_][A-Za-z0-9_.-]*"  # a host name or IPv4 address, as every launcher here accepts it
_FORMATS = "mpich `host:n`, Open MPI / DeepSpeed `host slots=n`, or a plain host name (1 slot)"


@dataclass(frozen=True)
class Host:
    """One host and the number of processes (slots) to start on it."""

    name: str
    slots: int


def _host(name: str, slots: str | None, where: str, fix: str = f"write {_FORMATS}") -> Host:
    if not re.fullmatch(_NAME, name):
        raise HostsError(f"{where}: {name!r} is not a host name; {fix}")
    count = int(slots) if slots is not None else 1
    if count < 1:
        raise HostsError(f"{where}: {name} has {count} slots; give every host at least 1 (or leave it out)")
    return Host(name, count)


def _checked(hosts: list[Host], source: str) -> list[Host]:
    if not hosts:
        raise HostsError(f"{source} names no host; list one per line as {_FORMATS}")
    seen: set[str] = set()
    for host in hosts:
        if host.name in seen:
            raise HostsError(f"{source} lists {host.name} twice; give each host once with its total slots")
        seen.add(host.name)
    return hosts


def parse_hosts(spec: str) -> list[Host]:
    """``"h1:2,h2:2"`` (a host without ``:n`` has 1 slot), the ``--hosts`` value."""
    fix = "write host:slots,host:slots (e.g. --hosts h1:2,h2:2)"
    hosts = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*([^:\s]*)(?::(\d+))?\s*", part)
        if not m or not m.group(1):
            raise HostsError(f"--hosts {spec!r}: cannot read {part!r}; {fix}")
        hosts.append(_host(m.group(1), m.group(2), f"--hosts {spec!r}", fix))
    return _checked(hosts, f"--hosts {spec!r}")


def parse_hostfile(text: str, source: str = "hostfile") -> list[Host]:
    """A hostfile in any of the formats launchers use: ``host:n`` (mpich), ``host slots=n`` (Open MPI,
    DeepSpeed; Open MPI's ``max_slots=m`` is accepted and ignored), or ``host`` alone (1 slot); ``#`` starts a
    comment, blank lines are skipped."""
    hosts = []
    for number, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        where = f"{source} line {number}"
        words = line.split()
        name, slots = words[0], None
        if ":" in name:
            m = re.fullmatch(r"([^:]*):(\d+)", name)
            if not m or len(words) > 1:
                raise HostsError(f"{where}: cannot read {line!r}; write {_FORMATS}")
            name, slots = m.group(1), m.group(2)
        for word in words[1:]:
            m = re.fullmatch(r"(slots|max_slots|max-slots)=(\d+)", word)
            if not m:
                raise HostsError(f"{where}: cannot read {word!r} in {line!r}; write {_FORMATS}")
            if m.group(1) == "slots":
                slots = m.group(2)
        hosts.append(_host(name, slots, where))
    return _checked(hosts, source)


def read_hostfile(path: str | Path) -> list[Host]:
    """:func:`parse_hostfile` of the file at ``path``; a missing file is a :class:`HostsError`."""
    try:
        text = Path(path).read_text()
    except OSError as err:
        raise HostsError(f"cannot read hostfile {str(path)!r} ({err.strerror}); give the path of a file listing "
                         f"one host per line as {_FORMATS}") from None
    return parse_hostfile(text, f"hostfile {str(path)!r}")


def expand_nodelist(nodelist: str) -> list[str]:
    """A Slurm hostlist such as ``gpu[003-005,9],cpu1`` or ``r[1-2]-n[1-2]``, in Slurm's order."""
    parts = re.findall(r"(?:[^,\[]|\[[^\]]*\])+", nodelist)
    if not nodelist.strip() or ",".join(parts) != nodelist.strip():
        raise HostsError(f"cannot parse the Slurm node list {nodelist!r}; expected e.g. gpu[003-005,9],cpu1")
    names: list[str] = []
    for part in parts:
        pieces: list[list[str]] = []
        for text, ranges in re.findall(r"([^\[]*)(?:\[([^\]]*)\])?", part):
            pieces.append([text])
            if ranges:
                pieces.append(_ranges(ranges, nodelist))
        names += ["".join(combo) for combo in itertools.product(*pieces)]
    return names


def _ranges(ranges: str, nodelist: str) -> list[str]:
    out = []
    for item in ranges.split(","):
        m = re.fullmatch(r"(\d+)(?:-(\d+))?", item.strip())
        if not m:
            raise HostsError(f"cannot parse {item!r} in the Slurm node list {nodelist!r}")
        lo, hi = m.group(1), m.group(2) or m.group(1)
        out += [str(i).zfill(len(lo)) for i in range(int(lo), int(hi) + 1)]
    return out


def tasks_per_node(spec: str) -> list[int]:
    """Slurm's tasks-per-node value, ``2(x3),1`` -> ``[2, 2, 2, 1]``."""
    counts: list[int] = []
    for part in spec.split(","):
        m = re.fullmatch(r"\s*(\d+)(?:\(x(\d+)\))?\s*", part)
        if not m:
            raise HostsError(f"cannot parse the Slurm tasks-per-node value {spec!r}; expected e.g. 2(x3),1")
        counts += [int(m.group(1))] * int(m.group(2) or 1)
    return counts


def slurm_hosts(environ: Mapping[str, str]) -> list[Host] | None:
    """The allocation's nodes and tasks per node, when ``environ`` is inside a Slurm allocation (SLURM_JOB_ID
    and SLURM_JOB_NODELIST set, with SLURM_NTASKS_PER_NODE or SLURM_TASKS_PER_NODE); None outside one."""
    if "SLURM_JOB_ID" not in environ or "SLURM_JOB_NODELIST" not in environ:
        return None
    nodes = expand_nodelist(environ["SLURM_JOB_NODELIST"])
    if environ.get("SLURM_NTASKS_PER_NODE"):
        counts = tasks_per_node(environ["SLURM_NTASKS_PER_NODE"]) * len(nodes)
    elif environ.get("SLURM_TASKS_PER_NODE"):
        counts = tasks_per_node(environ["SLURM_TASKS_PER_NODE"])
    else:
        return None
    if len(counts) < len(nodes):
        raise HostsError(f"SLURM_JOB_NODELIST names {len(nodes)} nodes but the tasks per node cover "
                         f"{len(counts)}; run inside a complete allocation, or pass --hosts")
    pairs = zip(nodes, counts[:len(nodes)], strict=True)
    return [_host(name, str(count), "the Slurm allocation") for name, count in pairs]


def format_hosts(hosts: Iterable[Host]) -> str:
    """``h1:2,h2:2``: mpiexec's ``-hosts`` and horovodrun's ``-H`` spelling."""
    return ",".join(f"{h.name}:{h.slots}" for h in hosts)


def hostfile_text(hosts: Iterable[Host], style: str) -> str:
    """A hostfile in ``style`` ``"slots"`` (``host slots=n``: DeepSpeed, Open MPI) or ``"mpich"`` (``host:n``)."""
    if style == "slots":
        return "".join(f"{h.name} slots={h.slots}\n" for h in hosts)
    if style == "mpich":
        return "".join(f"{h.name}:{h.slots}\n" for h in hosts)
    raise HostsError(f"unknown hostfile style {style!r}; use 'slots' or 'mpich'")
