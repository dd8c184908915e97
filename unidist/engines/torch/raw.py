"""torch.distributed's own calls as its users write them, for the benchmarks' raw columns, and gloo's algorithms
for the cost model; deepspeed.comm spells them alike, so DeepSpeed's raw.py reuses ``torch_like_calls`` (and, since
DeepSpeed runs on torch.distributed, ``torch_like_p2p``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.registry import RawEngine


def torch_like_calls(d: Any, n: int) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    """The raw calls of ``torch.distributed`` or ``deepspeed.comm`` (default group, sum)."""
    # torch >= 2.13 renamed the flat-tensor calls (the old names warn); deepspeed.comm keeps the old ones
    gather = getattr(d, "all_gather_single", None) or d.all_gather_into_tensor
    scatter = getattr(d, "reduce_scatter_single", None) or d.reduce_scatter_tensor

    def allreduce(x: Any) -> Callable[[], Any]:
        return lambda: d.all_reduce(x)

    def allgather(x: Any) -> Callable[[], Any]:
        out = x.new_empty(n * x.numel())
        return lambda: gather(out, x)

    def broadcast(x: Any) -> Callable[[], Any]:
        return lambda: d.broadcast(x, 0)

    def reduce_scatter(x: Any) -> Callable[[], Any]:
        out = x.new_empty(x.numel() // n)
        return lambda: scatter(out, x)

    def alltoall(x: Any) -> Callable[[], Any]:
        out = x.new_empty(x.shape)
        return lambda: d.all_to_all_single(out, x)

    return {"allreduce": allreduce, "allgather": allgather, "broadcast": broadcast,
            "reduce_scatter": reduce_scatter, "alltoall": alltoall}


def torch_like_mean(d: Any, n: int) -> Callable[[Any], None]:
    """torch has no average op on gloo: sum, then divide, as hand-written loops do."""
    def mean(g: Any) -> None:
        d.all_reduce(g)
        g.div_(n)
    return mean


def torch_like_p2p(d: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    """The blocking send/recv of ``torch.distributed`` (default group), and the same with the 32-byte header frame
    unidist's gloo path adds (``unidist.comm.mismatch.Framing``)."""
    from unidist.comm import mismatch

    def send(t: Any, peer: int) -> Any:
        return d.send(t, peer)

    def recv(t: Any, peer: int) -> Any:
        return d.recv(t, peer)

    framing = mismatch.Framing(lambda t, peer, tag: send(t, peer), lambda t, peer, tag: recv(t, peer))
    return {"engine": (send, recv),
            "engine+guard": (lambda t, peer: framing.send(t, peer, 0), lambda t, peer: framing.recv(t, peer, 0))}


def _calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import torch.distributed as dist

    return torch_like_calls(dist, mgr.size)


def _grad_mean(mgr: Any) -> Callable[[Any], None]:
    import torch.distributed as dist

    return torch_like_mean(dist, mgr.size)


def _p2p(mgr: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    import torch.distributed as dist

    return torch_like_p2p(dist)


def _start() -> Callable[[], None]:
    """torch.distributed as a torchrun script starts it: the default group from the launcher's variables (NCCL
    where CUDA is, else gloo)."""
    import torch
    import torch.distributed as dist

    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    dist.barrier()
    return dist.destroy_process_group


RAW = RawEngine(
    api="torch.distributed",
    calls=_calls,
    grad_mean=_grad_mean,
    p2p=_p2p,
    start=_start,
    algorithms={"*": "gloo"},
)
