"""The torch backend (torch.distributed) and torch.distributed's own calls for the benchmarks; deepspeed.comm
spells them alike, so its record reuses ``torch_like_calls`` (and, since DeepSpeed runs on torch.distributed,
``torch_like_p2p``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from unidist.engines.training import unidist_training
from unidist.registry import Backend, Launch, register


def _manager() -> type[Any]:
    from unidist.engines.torch.manager import TorchManager

    return TorchManager


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


def _raw_calls(mgr: Any) -> dict[str, Callable[[Any], Callable[[], Any]]]:
    import torch.distributed as dist

    return torch_like_calls(dist, mgr.size)


def _raw_grad_mean(mgr: Any) -> Callable[[Any], None]:
    import torch.distributed as dist

    return torch_like_mean(dist, mgr.size)


def _raw_p2p(mgr: Any) -> dict[str, tuple[Callable[[Any, int], Any], Callable[[Any, int], Any]]]:
    import torch.distributed as dist

    return torch_like_p2p(dist)


BACKEND = register(Backend(
    name="torch",
    manager_name="TorchManager",
    manager=_manager,
    strategy=unidist_training,
    requires=("torch",),
    install="from the unidist clone: pip install -c constraints.txt torch (the tested CPU build; an unpinned torch can "
            "pull a CUDA build of several GB)",
    launcher="torchrun",
    implied_by=("torchrun", "env"),
    engine="torch.distributed",
    raw_calls=_raw_calls,
    raw_grad_mean=_raw_grad_mean,
    raw_p2p=_raw_p2p,
    algorithms={"*": "gloo"},
    env_prefixes=("GLOO_", "NCCL_", "TORCH_"),
    launches=(Launch("torchrun", "torchrun-{n}", (2,), bench="torch"),
              Launch("mpich", "torch-under-mpiexec-{n}", (3,), {"UNIDIST_BACKEND": "torch"})),
))
