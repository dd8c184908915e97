"""The timeline's hooks for the layers above the engines: ``span``, ``mark`` and ``flush``.

The training layer (bucket launches and waits, backward, step, ZeRO gathers, pipeline sends), DeepSpeed's and
Horovod's gradient exchanges, the watchdog and the stall inspector say what they are doing here; the timeline
(``UNIDIST_TIMELINE``, comm/timeline.py) records it beside every engine call. This module imports nothing and
holds no state but the recorder, so a call costs one test of ``active`` when the timeline is off: the training
loop's fast path stays what it was.
"""

from __future__ import annotations

import contextlib
from contextlib import AbstractContextManager as ContextManager
from typing import Any, Protocol

__all__ = ["active", "flush", "install", "mark", "recorder", "region", "span", "uninstall"]


class Recorder(Protocol):
    """What comm/timeline.py's recorder offers the hooks."""

    def span(self, kind: str, stream: str, args: dict[str, Any]) -> ContextManager[None]: ...

    def mark(self, kind: str, args: dict[str, Any]) -> None: ...

    def flush(self) -> str | None: ...


active = False  # True while a timeline records (a Manager started with UNIDIST_TIMELINE set)
_recorder: Recorder | None = None
_NULL: ContextManager[None] = contextlib.nullcontext()  # reusable: entering it does nothing


def install(recorder: Recorder) -> None:
    """Route the hooks to ``recorder`` (comm/timeline.py does, when a Manager starts with the timeline on)."""
    global _recorder, active
    _recorder, active = recorder, True


def uninstall() -> None:
    """Back to doing nothing (the Manager's shutdown, after the trace is written)."""
    global _recorder, active
    _recorder, active = None, False


def recorder() -> Recorder | None:
    """The installed recorder (None when the timeline is off)."""
    return _recorder


def span(kind: str, /, **args: Any) -> ContextManager[None]:
    """``with span("bucket launch", bucket=3, tensor=buf):`` records the block as one complete event on this
    rank's training stream: start, duration and ``args`` (a tensor is recorded as its bytes and dtype). When
    the timeline is off it returns a shared no-op context: one bool test."""
    if not active or _recorder is None:
        return _NULL
    return _recorder.span(kind, "train", args)


def region(kind: str, /, **args: Any) -> ContextManager[None]:
    """Like :func:`span`, on the communication stream: an engine's own exchange that unidist's engine calls do
    not see (DeepSpeed's and Horovod's gradient reduction), counted with the engine calls."""
    if not active or _recorder is None:
        return _NULL
    return _recorder.span(kind, "comm", args)


def mark(kind: str, /, **args: Any) -> None:
    """An instant event on this rank: ``mark("stall", call="allreduce", waited=31.2)``. The stall inspector and
    the watchdog mark what they saw before they end a job; a test marks where its counted section begins and
    ends. Nothing happens when the timeline is off."""
    if active and _recorder is not None:
        _recorder.mark(kind, args)


def flush() -> str | None:
    """Write this rank's events so far to its part file (``<UNIDIST_TIMELINE>.rank<r>.json``, itself a
    Chrome trace) and return its path; None when the timeline is off. Whoever ends a job without the
    Manager's orderly shutdown (the watchdog on a timeout, the stall inspector) calls this first, so the
    ranks' traces survive the job: ``unidist timeline merge`` joins the parts afterwards."""
    if active and _recorder is not None:
        return _recorder.flush()
    return None
