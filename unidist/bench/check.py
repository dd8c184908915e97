"""What the mismatch guards cost: collectives with no check, the default one-in-K check, and every call checked
(UNIDIST_CHECK_COLLECTIVES=0 / unset / 1), and point-to-point with the default size guard against the engine's
own calls; interleaved, ratios side by side.

    mpiexec -n 2 python -m unidist.bench.check        (any launcher; rank 0 prints the tables)

Rounds alternate between the modes on the same buffer, so machine noise hits all alike; times are medians over
rounds, per call. A check is one three-word MAX allreduce (comm/check.py); by default one collective in K is
checked, K adapting so checks take about 1% of the time (the ``K`` column: the distance the ranks agreed on at
the end). The point-to-point guard is the receive status's count on MPI, a 32-byte header frame on gloo engines
(comm/mismatch.py): the second table times a ping-pong between ranks 0 and 1 through unidist, through the engine's
own calls (mpi4py, torch.distributed: its record's ``raw.p2p``), and through the engine's calls with the guard
added, whose ratio is the guard's cost.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any

import torch

import unidist
from unidist import registry
from unidist.bench.machine import line as machine_line

if TYPE_CHECKING:
    from unidist.managers.base import Manager

SIZES = (8, 512, 4096, 65536, 1 << 20, 32 << 20)
MODES = {"off": False, "1 in K": None, "every": True}


def _mode(mgr: Manager, mode: bool | None, every: tuple[int, float] | None) -> None:
    mgr.config = dataclasses.replace(mgr.config, check_collectives=mode)
    # reads the flag and restarts the countdown; the default mode goes on from the K (and check cost) it had reached
    mgr.restart_desync_check(*(every or ()))


def _time(mgr: Manager, fn: Callable[[], Any], iters: int) -> float:
    mgr.barrier()
    start = time.perf_counter()
    for _ in range(iters):
        fn()
    return (time.perf_counter() - start) / iters


def _iters(nbytes: int) -> int:
    return max(5, min(2000, (64 << 20) // max(nbytes, 1) // 8))


def collectives(mgr: Manager, sizes: list[int], rounds: int) -> list[tuple[int, dict[str, float], int]]:
    rows = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        times: dict[str, list[float]] = {m: [] for m in MODES}
        every: tuple[int, float] | None = None

        def call(t: torch.Tensor = t) -> None:
            mgr.allreduce_(t)
        for _ in range(rounds):
            for name, mode in MODES.items():
                _mode(mgr, mode, every if mode is None else None)
                times[name].append(_time(mgr, call, _iters(nbytes)))
                if mode is None:
                    every = mgr.desync_check.every, mgr.desync_check.cost
        _mode(mgr, None, None)
        rows.append((nbytes, {m: statistics.median(v) for m, v in times.items()}, every[0] if every else 0))
    return rows


P2P = Callable[[torch.Tensor, int], Any]


def _engine_p2p(mgr: Manager) -> Mapping[str, tuple[P2P, P2P]]:
    """The engine's own blocking send/recv on the world, without and with the guard unidist adds, as its record
    gives them (``unidist.registry.RawEngine.p2p``); nothing where it has none (Horovod's are unidist's side
    group)."""
    raw = registry.get(mgr.backend).raw.p2p
    return {} if raw is None else raw(mgr)


def point_to_point(mgr: Manager, sizes: list[int], rounds: int) -> list[tuple[int, dict[str, float]]]:
    """Ping-pong between ranks 0 and 1 (the others wait at the barriers), per message (half a round trip)."""
    ways: dict[str, tuple[P2P, P2P]] = {
        "unidist": (lambda t, peer: mgr.send(t, peer), lambda t, peer: mgr.recv(t, peer)), **_engine_p2p(mgr)}
    rows = []
    for nbytes in sizes:
        t = torch.zeros(max(1, nbytes // 4))
        iters = max(3, _iters(nbytes) // 4)
        times: dict[str, list[float]] = {w: [] for w in ways}

        for _ in range(rounds):
            for name, (send, recv) in ways.items():
                def pingpong(send: Any = send, recv: Any = recv, t: torch.Tensor = t) -> None:
                    if mgr.rank == 0:
                        send(t, 1)
                        recv(t, 1)
                    elif mgr.rank == 1:
                        recv(t, 0)
                        send(t, 0)
                times[name].append(_time(mgr, pingpong, iters) / 2)
        rows.append((nbytes, {w: statistics.median(v) for w, v in times.items()}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--sizes", type=int, nargs="*", default=list(SIZES), help="bytes per buffer")
    args = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        coll = collectives(mgr, args.sizes, args.rounds)
        p2p = point_to_point(mgr, args.sizes, args.rounds) if mgr.size > 1 else []
        if mgr.rank == 0:
            print(machine_line(), flush=True)
            print(f"backend={mgr.backend} ranks={mgr.size}: allreduce_ (sum, float32, in place), median us per call "
                  f"over {args.rounds} interleaved rounds")
            print(f"{'bytes':>10} {'off':>10} {'1 in K':>10} {'every':>10} {'1inK/off':>9} {'every/off':>9} "
                  f"{'K':>5}")
            for nbytes, t, every in coll:
                print(f"{nbytes:>10} {t['off'] * 1e6:>10.1f} {t['1 in K'] * 1e6:>10.1f} {t['every'] * 1e6:>10.1f} "
                      f"{t['1 in K'] / t['off']:>9.3f} {t['every'] / t['off']:>9.3f} {every:>5}")
            if p2p:
                print("send/recv ping-pong, ranks 0 and 1, median us per message: unidist's send/recv, the engine's "
                      "own calls, and the engine's calls with the size guard (guard = engine+guard / engine)")
                print(f"{'bytes':>10} {'unidist':>10} {'engine':>10} {'eng+guard':>10} {'guard':>7}")
                for nbytes, t in p2p:
                    eng, guarded = t.get("engine"), t.get("engine+guard")
                    tail = (f"{eng * 1e6:>10.1f} {guarded * 1e6:>10.1f} {guarded / eng:>7.3f}" if eng and guarded
                            else f"{'n/a':>10} {'n/a':>10} {'':>7}")
                    print(f"{nbytes:>10} {t['unidist'] * 1e6:>10.1f} {tail}")

if __name__ == "__main__":
    main()
