"""LocalManager: a world of one process, so every script also runs as plain ``python script.py``."""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Sequence

import torch

from unidist.errors import InvalidArgumentError, LaunchEnvironmentError
from unidist.managers.base import Manager
from unidist.ops import ReduceOp

__all__ = ["LocalManager"]


class LocalManager(Manager):
    """Every collective is the identity on one rank; send/recv to self goes through a mailbox."""

    name = "local"

    def _start(self) -> None:
        if self.launch.size > 1:
            raise LaunchEnvironmentError(
                f"LocalManager runs one process, but the {self.launch.launcher} launcher started "
                f"{self.launch.size}; unset UNIDIST_BACKEND=local or pick a multi-process backend"
            )
        self._rank, self._size, self._local_rank, self._local_size, self._node_rank = 0, 1, 0, 1, 0
        self._mailbox: dict[int, deque[torch.Tensor]] = defaultdict(deque)

    def _shutdown(self) -> None:
        self._mailbox.clear()

    def _barrier(self) -> None:
        return None

    def _broadcast(self, t: torch.Tensor, root: int) -> None:
        return None

    def _allreduce(self, send: torch.Tensor, recv: torch.Tensor, op: ReduceOp) -> None:
        if send is not recv:
            recv.copy_(send)

    def _allgather(self, send: torch.Tensor, recv: torch.Tensor, counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1))

    def _alltoall(self, send: torch.Tensor, recv: torch.Tensor, send_counts: Sequence[int],
                  recv_counts: Sequence[int]) -> None:
        recv.view(-1).copy_(send.view(-1)[: recv_counts[0]])

    def _send(self, t: torch.Tensor, dest: int, tag: int) -> None:
        self._mailbox[tag].append(t.clone())

    def _recv(self, t: torch.Tensor, source: int, tag: int) -> None:
        box = self._mailbox.get(tag)
        if not box:
            raise InvalidArgumentError(f"recv(tag={tag}) on a one-process world with no matching send: it would "
                                       "wait forever")
        msg = box.popleft()
        if msg.shape != t.shape or msg.dtype != t.dtype:
            raise InvalidArgumentError(f"recv buffer {tuple(t.shape)} {t.dtype} does not match the message "
                                       f"{tuple(msg.shape)} {msg.dtype}")
        t.copy_(msg)
