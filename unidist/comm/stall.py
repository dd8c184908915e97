"""The stall inspector's judgement: given where every rank is, why is this rank's wait not over?

Pure functions over what the watchdog gathered (watchdog.py: heartbeat files on this host, the liveness
channel for other hosts; regions.py: what a position holds). A rank that waits longer than
``UNIDIST_STALL_WARNING`` compares its call with each rank the call needs (the members of its engine, or the
peer of a send/recv) and finds one of:

- **desync**: another call at the same place (same engine, same number, different kind, dtype, size, op or
  root), a rank already past this place, or a rank waiting in a call of an engine this rank belongs to at
  another place (this rank has not reached it, a cycle where neither can go on, or has passed it). The job
  cannot finish; it ends now with a ``CollectiveMismatchError``.
- **gone**: a rank is dead, stopped or unreachable.
- **straggler**: a rank has not arrived and is still computing.
- **blocked**: a rank has not arrived because it waits in another call (on peers this rank does not wait for).
- **engine**: every rank is in this very call: the wait is inside the engine (a large message, a slow link).

Ranks whose position is not visible (no heartbeat yet, no liveness channel) are left out, and never make a
desync: a verdict is only as strong as what was seen.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = ["KINDS", "Seen", "Verdict", "classify", "headline", "made", "members", "place"]

# the verdicts, most telling first: the one a stall is reported as is the first any rank gets
KINDS = ("desync", "gone", "straggler", "blocked", "engine")


@dataclass(frozen=True)
class Seen:
    """What the watchdog learned of one rank: ``state`` is ``alive``, ``dead``, ``stopped`` or ``unreachable``
    (``why``: the watchdog's own words for the last three); ``position`` is regions.position()'s dict as that
    rank's heartbeat carried it (None when not visible)."""

    rank: int
    host: str
    state: str = "alive"
    position: Mapping[str, Any] | None = None
    why: str = ""


@dataclass(frozen=True)
class Verdict:
    """The stall's kind (one of KINDS, or ``unknown`` when no needed rank could be seen) and one line per rank
    the call needs, saying where it is."""

    kind: str
    lines: list[str] = field(default_factory=list)

    def text(self) -> str:
        return "; ".join(self.lines)


def members(key: str, size: int) -> tuple[int, ...]:
    """The world ranks of the engine a sequence ``key`` names (regions.Seq): every rank for the world and for
    engine regions, the listed ranks for ``group 0,2#1``."""
    if key.startswith("group "):
        return tuple(int(r) for r in key.removeprefix("group ").partition("#")[0].split(","))
    return tuple(range(size))


def place(key: str, n: int) -> str:
    """Collective ``n`` of the engine ``key`` names, in the user's words: ``collective #5 of all ranks``,
    ``collective #2 of the group of ranks 0,2``, ``exchange #1 of all ranks`` (regions.REGIONS, numbered apart:
    DeepSpeed's and Horovod's own exchanges, the barrier ranks meet in when they leave)."""
    return f"{_noun(key, 1)} #{n} of {_whose(key)}"


def made(key: str, n: int) -> str:
    """How many collectives a rank has made on the engine ``key`` names: ``7 collectives of all ranks``."""
    return f"{n} {_noun(key, n)} of {_whose(key)}"


def _noun(key: str, n: int) -> str:
    noun = "exchange" if key == "regions" else "collective"
    return noun if n == 1 else noun + "s"


def _whose(key: str) -> str:
    if key.startswith("group "):
        ranks, _, k = key.removeprefix("group ").partition("#")
        nth = int(k) + 1 if k.isdigit() else 1  # groups of the very same members are told apart by when made
        return f"the group of ranks {ranks}" if nth == 1 else f"the {_ordinal(nth)} group of ranks {ranks}"
    return "all ranks"


def _ordinal(n: int) -> str:
    last = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{last}"


def _where(call: Mapping[str, Any] | None) -> str:
    if call is None:
        return "computing"
    at = f" at {call['at']}" if call.get("at") else ""
    on = f" ({place(str(call['on']), int(call['n']))})" if "on" in call else ""
    return f"waiting in {call['kind']}{call['args']}{at}{on}"


def _kind(call: Mapping[str, Any]) -> str:
    return str(call["kind"]).removeprefix("group ").split(" ")[0]


def _judge(me: int, size: int, mine: Mapping[str, Any], mycall: Mapping[str, Any], other: Seen) -> tuple[str, str]:
    """One rank's part in this rank's stall: (verdict kind or ``arrived``/``unseen``, the line saying why)."""
    r, host = other.rank, other.host
    if other.state != "alive":
        return "gone", other.why or f"rank {r} is {other.state} on host {host}"
    if other.position is None:
        return "unseen", f"rank {r} on host {host}: where it is could not be seen"
    pos, call = other.position, other.position.get("call")
    said = f"rank {r} on host {host} is {_where(call)}"
    if "on" not in mycall:  # this rank is in a send or recv with ``peer``
        if call is not None and call.get("peer") == me and "on" not in call:
            if _kind(call) == _kind(mycall):  # both send, or both receive: each waits for the other
                return "desync", f"{said}: both ranks {_kind(call)} to each other"
            return "arrived", said
        return _not_arrived(me, size, mine, call, said)
    key, n = mycall["on"], mycall["n"]
    theirs = int(pos.get("seqs", {}).get(key, 0))
    if call is not None and call.get("on") == key and call.get("n") == n:
        if call.get("sig") != mycall.get("sig"):
            return "desync", f"{said}: a different call at the same place"
        return "arrived", said
    if theirs > n:
        return "desync", f"{said}, already past {place(key, n)} (it has made {made(key, theirs)})"
    if theirs == n:
        return "desync", f"{said}: its {place(key, n)} was another call"
    return _not_arrived(me, size, mine, call, said + f", not yet at {place(key, n)} (it has made {made(key, theirs)})")


def _not_arrived(me: int, size: int, mine: Mapping[str, Any], call: Mapping[str, Any] | None,
                 said: str) -> tuple[str, str]:
    if call is None:
        return "straggler", said
    if "on" in call:
        # it waits in a collective of an engine this rank belongs to, at a place this rank is not at: this rank
        # has not reached it (each waits for the other) or has passed it (it cannot complete)
        if me in members(str(call["on"]), size):
            mine_n = int(mine.get("seqs", {}).get(call["on"], 0))
            return "desync", (f"{said}, which this rank has not reached: each waits for the other" if mine_n < call["n"]
                              else f"{said}, which this rank has already entered in another call")
        return "blocked", said
    if call.get("peer") == me:  # it waits on this rank point-to-point, this rank on it in a collective
        return "desync", f"{said}, for this rank, which is in a collective: each waits for the other"
    return "blocked", said


def classify(me: int, size: int, mine: Mapping[str, Any], others: Sequence[Seen]) -> Verdict:
    """Why this rank (``me``, at position ``mine``, which is waiting) is stalled, from what was seen of the
    other ranks."""
    mycall = mine.get("call")
    if mycall is None:
        return Verdict("unknown", ["this rank is not waiting"])
    if "on" in mycall:
        needed = set(members(str(mycall["on"]), size)) - {me}
    else:
        needed = {mycall.get("peer")} - {None, me}
    found: dict[str, list[str]] = {}
    for other in sorted(others, key=lambda s: s.rank):
        if other.rank in needed:
            kind, line = _judge(me, size, mine, mycall, other)
            found.setdefault(kind, []).append(line)
    kind = next((k for k in KINDS[:-1] if k in found), "engine" if "arrived" in found else "unknown")
    lines = [f"rank {me} is {_where(mycall)}"]
    for k in (*KINDS, "arrived", "unseen"):
        lines += found.get(k, [])
    return Verdict(kind, lines)


def headline(kind: str) -> str:
    """What a verdict means for the user, in one sentence."""
    return {
        "desync": "ranks are in different calls: a rank skipped, added or reordered a collective",
        "gone": "a rank this call needs is gone",
        "straggler": "a rank this call needs has not arrived: it is still computing (a straggler)",
        "blocked": "a rank this call needs is waiting in another call, on other ranks",
        "engine": "every rank is in this call: the wait is inside the engine (a large message, a slow link or an "
                  "engine problem)",
        "unknown": "no rank this call needs could be seen",
    }[kind]
