"""Plans: the engine's prepared arguments for the hottest calls, kept per buffer so a repeated call skips the work.

Checking a call's buffers (shapes, dtypes, rows, contiguity) and building the engine's buffer descriptions cost a
few microseconds a call: on MPI's shared memory as much as an 8-byte allreduce itself (2-3 us), and 3-5 us
beside a 64 KiB allgather, reduce_scatter or alltoall, where a call should cost within 5% of the engine's own.
The first call on a buffer (or pair of buffers) takes the checked path and, where the engine has a shortcut
(``Engine.prepared_sum``, ``Engine.prepared_blocks``), keeps what it prepared under the buffers' addresses,
shapes and dtypes; later calls on the same buffers go straight to the engine with it.

A plan is only ever made for plain contiguous tensors of a natively handled dtype, never for a call that is due
for the desync check (the communicator's countdown decides that before a plan is looked up), and the tables are
dropped whole when they grow (entries of freed buffers are harmless: an address reused by a tensor of the same
shape and dtype gets a plan that describes it exactly).
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["Plans"]

_LIMIT = 1024  # entries per table before it is dropped whole


class Plans:
    """Prepared in-place calls by (call, buffer), and prepared block calls by (call, buffer pair)."""

    __slots__ = ("_blocks", "_ones", "sums")

    def __init__(self) -> None:
        # in-place sums by (address, bytes, dtype): the hottest table, read directly by the communicator (its
        # ``get`` bound once), one lookup per call
        self.sums: dict[tuple[int, int, torch.dtype], Any] = {}
        self._ones: dict[tuple[str, int, int, torch.dtype], Any] = {}
        self._blocks: dict[tuple[Any, ...], Any] = {}

    def clear(self) -> None:
        self.sums.clear()
        self._ones.clear()
        self._blocks.clear()

    def one(self, call: str, x: torch.Tensor) -> Any:
        """The prepared in-place ``call`` (``allreduce``, ``broadcast``) on ``x`` (contiguous, checked by the
        caller), or None."""
        return self._ones.get((call, x.data_ptr(), x.nbytes, x.dtype))

    def keep_sum(self, x: torch.Tensor, prepared: Any) -> None:
        if len(self.sums) >= _LIMIT:
            self.sums.clear()
        self.sums[(x.data_ptr(), x.nbytes, x.dtype)] = prepared

    def keep_one(self, call: str, x: torch.Tensor, prepared: Any) -> None:
        if len(self._ones) >= _LIMIT:
            self._ones.clear()
        self._ones[(call, x.data_ptr(), x.nbytes, x.dtype)] = prepared

    def blocks_of(self, call: str, x: Any, out: Any) -> tuple[torch.Tensor, torch.Tensor, Any] | None:
        """(x, out, the prepared arguments) for ``call`` on this pair of plain contiguous tensors, or None."""
        if type(x) is not torch.Tensor or type(out) is not torch.Tensor or x.requires_grad or out.requires_grad \
                or not x.is_contiguous() or not out.is_contiguous():
            return None
        prepared = self._blocks.get((call, x.data_ptr(), out.data_ptr(), x.shape, out.shape, x.dtype, out.dtype))
        return None if prepared is None else (x, out, prepared)

    def keep_blocks(self, call: str, x: torch.Tensor, out: torch.Tensor, prepared: Any) -> None:
        if len(self._blocks) >= _LIMIT:
            self._blocks.clear()
        self._blocks[(call, x.data_ptr(), out.data_ptr(), x.shape, out.shape, x.dtype, out.dtype)] = prepared
