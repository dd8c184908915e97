"""The collective suite on groups, under any launcher at 3 or 4 ranks.

- ``split/``: every case of the collective suite on ``mgr.split(rank % 2)``, with a world allreduce between
  cases so group and world calls interleave;
- ``subset/``: the same on ``mgr.new_group([0, n-1])`` (other ranks must get None and run nothing);
- ``reversed/``: the suite again on ``split(rank % 2, key=-rank)``, each group ordered backwards; and
  ``reversed``: ``split(0, key=-rank)`` orders the world backwards (ranks, broadcast root, allgather order);
- ``solo``: groups of one rank (``new_group([1])``, ``split(rank)``);
- ``errors``: mismatched ``new_group`` lists, roots and peers outside the group;
- ``dp``: data parallel within both ``split(rank % 2)`` groups at once, each group its own model, against
  one process trained on that group's whole batch.
Results go to ``<out>/rank<R>.json`` as ``{name: "ok" | "FAIL: ..."}``, as collectives.py writes them.
"""

from __future__ import annotations

import argparse
import json
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import collectives

import unidist

SKIP = {"topology", "no_warnings", "listens_on_loopback_only", "strict_inputs"}  # world-only cases
STEPS, BATCH = 4, 12
sample = collectives.sample  # a dozen cases per collective (tests/multiproc/test_group_suite.py names it here)


def record(results: dict[str, str], name: str, fn: Callable[[], Any]) -> None:
    try:
        fn()
        results[name] = "ok"
    except Exception as err:
        results[name] = f"FAIL: {type(err).__name__}: {err}"


def suite_on(group: Any, prefix: str, mgr: Any, results: dict[str, str], sampled: int = 0) -> None:
    """Run the suite on ``group`` (None on ranks outside it), a world allreduce after every case.

    Groups can differ in size, and so in their number of cases, and non-members run none; every rank
    therefore pads to the longest plan so all ranks make the same number of world calls.
    """
    cases = [] if group is None else [(n, f) for n, f in collectives.plan(group.size) if n not in SKIP]
    if sampled:
        cases = sample(cases, sampled)
    rounds = int(mgr.allreduce(torch.tensor([len(cases)]), "max").item())
    for i in range(rounds):
        if i < len(cases):
            name, fn = cases[i]
            record(results, prefix + name, lambda fn=fn: fn(group))
        world: dict[str, str] = {}
        record(world, "w", lambda i=i: _world_check(mgr, i))  # every rank calls it every round
        if results.get("world-interleaved", "ok") == "ok":  # keep the first failure
            results["world-interleaved"] = world["w"]


def _world_check(mgr: Any, i: int) -> None:
    got = mgr.allreduce(torch.full((2,), float(mgr.rank + i)))
    want = float(sum(range(mgr.size)) + mgr.size * i)
    assert got.tolist() == [want] * 2, f"world allreduce after group case {i}: {got.tolist()} != {want}"


def reversed_order(mgr: Any) -> None:
    g = mgr.split(0, key=-mgr.rank)
    n = mgr.size
    assert tuple(g.ranks) == tuple(reversed(range(n))), g.ranks
    assert (g.rank, g.size) == (n - 1 - mgr.rank, n)
    assert g.broadcast(torch.tensor([float(mgr.rank)]), root=0).item() == n - 1  # group root 0 is world n-1
    rows = g.allgather(torch.full((mgr.rank + 1, 1), float(mgr.rank))).reshape(-1).tolist()
    assert rows == [float(w) for w in reversed(range(n)) for _ in range(w + 1)], rows


def solo(mgr: Any) -> None:
    one = mgr.new_group([1])
    assert (one is not None) == (mgr.rank == 1), one
    if one is not None:
        assert (one.rank, one.size, tuple(one.ranks)) == (0, 1, (1,))
        assert one.allreduce(torch.arange(3.0)).tolist() == [0.0, 1.0, 2.0]
        assert one.broadcast_object({"a": 1}) == {"a": 1}
    alone = mgr.split(mgr.rank)
    assert tuple(alone.ranks) == (mgr.rank,) and alone.allgather(torch.ones(2)).tolist() == [1.0, 1.0]


def errors(mgr: Any) -> None:
    """Ranks passing different lists get a CollectiveMismatchError on every rank, not a hang in the engine;
    roots and peers are group ranks, so a world rank past the group's size is refused."""
    mine = [0, mgr.size - 1] if mgr.rank == 0 else [0, 1]
    err = caught(unidist.CollectiveMismatchError, lambda: mgr.new_group(mine), "mismatched new_group lists")
    assert f"rank 0: [0, {mgr.size - 1}]" in str(err), err
    g = mgr.split(mgr.rank % 2)
    for what, call in (("broadcast root", lambda: g.broadcast(torch.ones(1), root=g.size)),
                       ("send dest", lambda: g.send(torch.ones(1), dest=g.size))):
        err = caught(unidist.InvalidArgumentError, call, what + " outside the group")
        assert str(g.size - 1) in str(err), err  # the message gives the group's rank range


def caught(exc: type[BaseException], fn: Callable[[], Any], what: str) -> BaseException:
    try:
        fn()
    except exc as err:
        return err
    raise AssertionError(f"{what}: accepted, expected {exc.__name__}")


def make_model(color: int) -> torch.nn.Module:
    torch.manual_seed(10 + color)  # the two groups start from different models
    return torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def batch(color: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * color + step)
    x = torch.randn(BATCH, 6, generator=g)
    return x, 10 * torch.stack([x[:, 0] - x[:, 1], x[:, 2] * x[:, 3]], dim=1)


def data_parallel(mgr: Any, out: dict[str, Any]) -> None:
    color = mgr.rank % 2
    dp = mgr.split(color)
    model = make_model(color) if dp.rank == 0 else torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))  # prepare broadcasts the group root's
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9), group=dp)
    per = BATCH // dp.size
    mine = slice(dp.rank * per, (dp.rank + 1) * per)
    ref = make_model(color)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.01, momentum=0.9)
    for step in range(STEPS):
        x, y = batch(color, step)
        mgr.backward(torch.nn.functional.mse_loss(model(x[mine]), y[mine]))
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        torch.nn.functional.mse_loss(ref(x), y).backward()
        ref_opt.step()
    flat = torch.cat([p.detach().reshape(-1) for p in mgr.unwrap(model).parameters()])
    want = torch.cat([p.detach().reshape(-1) for p in ref.parameters()])
    out["dp_max_diff"] = float((flat - want).abs().max())
    out["dp_group_spread"] = float((dp.allreduce(flat, "max") - dp.allreduce(flat, "min")).abs().max())
    sums = mgr.allgather_object((color, float(flat.sum())))
    out["dp_groups_differ"] = len({s for c, s in sums}) == len({c for c, _ in sums}) == min(2, mgr.size)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--sample", nargs="?", const=12, type=int, default=0, metavar="N",
                        help="about N cases per collective (default 12) instead of all")
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        results: dict[str, Any] = {}
        split = mgr.split(mgr.rank % 2)
        suite_on(split, "split/", mgr, results, ns.sample)
        subset = mgr.new_group([0, mgr.size - 1])
        results["subset-membership"] = "ok" if (subset is not None) == (mgr.rank in (0, mgr.size - 1)) else \
            f"FAIL: rank {mgr.rank} got {subset!r}"
        suite_on(subset, "subset/", mgr, results, ns.sample)
        backwards = mgr.split(mgr.rank % 2, key=-mgr.rank)
        suite_on(backwards, "reversed/", mgr, results, ns.sample)
        mgr.barrier()
        record(results, "reversed", lambda: reversed_order(mgr))
        record(results, "solo", lambda: solo(mgr))
        record(results, "errors", lambda: errors(mgr))
        extra: dict[str, Any] = {}
        record(results, "dp", lambda: data_parallel(mgr, extra))
        results["_meta"] = json.dumps({"backend": mgr.backend, "size": mgr.size, **extra})
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(results, indent=1))
        mgr.barrier()
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(3)
