"""A per-rank Gantt chart of a timeline (``unidist timeline summarize PATH --plot out.png``).

Two rows per rank: the engine calls (collectives by kind; async launches light, their waits dark) and the
training spans (backward, step, bucket launches and waits, ZeRO gathers, pipeline sends). Marks (a stall, a
timeout) are red lines. matplotlib comes with the ``examples`` extra and is imported only here.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

__all__ = ["plot"]

_COLOURS = {"allreduce": "tab:blue", "allgather": "tab:green", "broadcast": "tab:purple", "barrier": "tab:gray",
            "reduce_scatter": "tab:olive", "alltoall": "tab:cyan", "send": "tab:orange", "recv": "tab:brown",
            "backward": "#9ecae1", "step": "#fdae6b", "bucket launch": "tab:blue", "bucket wait": "tab:red",
            "zero gather": "tab:green", "zero refresh": "tab:green", "pipeline send": "tab:orange",
            "pipeline recv": "tab:brown"}


def _colour(name: str, cat: str) -> str:
    base = name.removesuffix(" launch").removesuffix(" wait") if cat in ("launch", "wait") else name
    base = base.removeprefix("group ")
    if cat == "region":
        return "tab:pink"
    if cat == "wait":  # an async call's wait: dark, its launch the kind's own colour
        return "#08306b"
    return _COLOURS.get(base, "tab:gray")


def plot(events: Sequence[dict[str, Any]], out: str, *, window: tuple[float, float] | None = None) -> None:
    """Draw ``events`` (a trace's, ``bench.timeline.load``) to the PNG ``out``; ``window`` is (start, end)
    in ms of the trace's clock."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    ranks = sorted({e["pid"] for e in events})
    lo, hi = (window[0] * 1000, window[1] * 1000) if window else (-float("inf"), float("inf"))
    fig, ax = plt.subplots(figsize=(11, 1.0 + 0.9 * len(ranks)))
    labels: list[str] = []
    ticks: list[float] = []
    used: dict[str, str] = {}
    for i, r in enumerate(ranks):
        for j, tid in enumerate((1, 0)):
            y = (len(ranks) - 1 - i) * 2.4 + j * 1.1
            ticks.append(y + 0.45)
            labels.append(f"rank {r} " + ("training" if tid == 1 else "engine calls"))
            bars: dict[str, list[tuple[float, float]]] = {}
            for e in events:
                if e["pid"] != r or e.get("tid") != tid or e.get("ph") != "X":
                    continue
                a, b = e["ts"], e["ts"] + e["dur"]
                if b < lo or a > hi:
                    continue
                colour = _colour(e["name"], e.get("cat", ""))
                bars.setdefault(colour, []).append((a / 1000, max(e["dur"], 0.5) / 1000))
                used.setdefault(e["name"].removeprefix("group "), colour)
            for colour, spans in bars.items():
                alpha = 0.5 if tid == 1 else 0.9
                ax.broken_barh(spans, (y, 0.9), facecolors=colour, alpha=alpha, linewidth=0)
        for e in events:
            if e["pid"] == r and e.get("cat") == "mark" and lo <= e["ts"] <= hi:
                ax.axvline(e["ts"] / 1000, color="red", linewidth=0.8)
    ax.set_yticks(ticks, labels)
    ax.set_xlabel("ms since the start of the trace")
    if window:
        ax.set_xlim(*window)
    handles = [Patch(color=c, label=n) for n, c in list(used.items())[:14]]
    ax.legend(handles=handles, loc="upper center", bbox_to_anchor=(0.5, -0.25), ncol=5, fontsize=8, frameon=False)
    ax.set_title("unidist timeline: per-rank engine calls and training spans")
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    plt.close(fig)
