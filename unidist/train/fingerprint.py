"""The training fingerprint: one JSON line per optimizer step, from inside, so launches can be compared.

``UNIDIST_FINGERPRINT=path`` (or ``prepare(..., fingerprint=path)``) makes every prepared optimizer record, at
the end of each optimizer step (applied or skipped), what two runs of one script must agree on: the loss passed to
``mgr.backward`` (mean over ranks and over the accumulation window), the global gradient norm before clipping,
every parameter's (and persistent buffer's) L2 norm and sum over its consolidated value, the learning rates, the
loss scale and whether the step was skipped, and three facts about the data the step saw: the rows (first dimension
of the model's first tensor input, summed over ranks and micro-batches), their sum, and a digest of which rows they
were. The first line is a header: backend, world size, ZeRO stage, precision and the clipping in effect (an engine's
own included); then a ``"step": 0`` line with the starting weights; a line is added for each checkpoint saved or
loaded. ``unidist verify`` reads these files (``unidist.verify``), and asks of its runs more through ``attach``:
random ops counted or switched off (random_ops.py), rounding injected (rounding.py), per-module probes
(probes.py).

Cost: each rank reads, in place, only its part (its ZeRO shards, DeepSpeed's stage-3 partitions, or an even 1/N
slice of what every rank holds whole: the prepared optimizer's ``fingerprint_parts``), no gather, and everything
travels in one small float64 sum-allreduce per step (two numbers per parameter); the loss's ``item()`` waits for
the device once per step.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

import torch

from unidist.checkpoint.layout import even
from unidist.comm.protocol import Comm
from unidist.config import Config
from unidist.train.probes import Probes
from unidist.train.random_ops import RandomOps
from unidist.train.rounding import Rounding
from unidist.tree import tensors

__all__ = ["FORMAT", "Fingerprint", "path_for", "slice_squares", "squares", "verify_parts"]

_GOLDEN = 1.6180339887498949  # the digest's multiplier: far from any ratio of small integers
FORMAT = 2  # the header's "unidist_fingerprint" value: bumped when a field changes meaning
_HEAD = 6  # loss sum, loss count, rows, input sum, gradient squares, input digest


def squares(tensors: Iterable[torch.Tensor]) -> float:
    """The sum of every element's square over ``tensors`` (a squared L2 norm), in float32 dots summed as Python
    floats: accurate to ~1e-7 relative, and several times cheaper than a float64 copy of a model's gradient."""
    total = 0.0
    for t in tensors:
        flat = t.detach().reshape(-1).float()
        total += float(torch.dot(flat, flat))
    return total


def slice_squares(tensors: Iterable[torch.Tensor], rank: int, size: int) -> float:
    """This rank's even slice of ``squares(tensors)`` where every rank holds the same tensors whole: the ranks'
    parts are disjoint and sum to the whole, so each reads 1/size of them."""
    total = 0.0
    for t in tensors:
        flat = t.detach().reshape(-1)
        start, end = even(flat.numel(), rank, size)
        if end > start:
            part = flat[start:end].float()
            total += float(torch.dot(part, part))
    return total


def verify_parts(config: Config, model: torch.nn.Module | None, named_params: Sequence[tuple[str, torch.Tensor]],
                 share: float) -> tuple[RandomOps | None, Rounding | None, Probes | None]:
    """What ``config``'s ``UNIDIST_FINGERPRINT_RANDOM``, ``_PERTURB`` and ``_LOCATE`` ask of a fingerprinted model
    (``Fingerprint.attach`` takes them): ``model`` None for an optimizer given parameters only (no module: no
    random-op sites, no module outputs, gradients only); ``share``: what one rank's gradient counts for in the
    average (1/N, or 1 where gradients are summed)."""
    random = None
    if model is not None and config.fingerprint_random != "keep":
        random = RandomOps(model, switch_off=config.fingerprint_random == "off")
    rounding = Rounding(model, [p for _, p in named_params], config.fingerprint_perturb) \
        if config.fingerprint_perturb else None
    probes = Probes(model, named_params, config.fingerprint_locate, share) \
        if model is not None and config.fingerprint_locate else None
    return random, rounding, probes


class Recorded(Protocol):
    """What the fingerprint reads of the optimizer it observes (a prepared optimizer: train/prepared.py)."""

    param_groups: list[dict[str, Any]]

    @property
    def loss_scale(self) -> float: ...

    @property
    def last_step_skipped(self) -> bool: ...

    def hold_gradient_norm(self, rank: int, size: int) -> None: ...

    def fingerprint_grad_sq(self, rank: int, size: int) -> tuple[float, bool]: ...


_made: dict[str, int] = {}  # fingerprints made in this process, by the path asked for


def path_for(base: str) -> str:
    """The file of the next fingerprint at ``base`` in this process (a prepared model, an hvd optimizer): ``base``
    for the first, ``base.model<i>`` after."""
    index = _made[base] = _made.get(base, -1) + 1
    return base if index == 0 else f"{base}.model{index}"


class Fingerprint:
    """Records one prepared model's steps. Made by ``prepare``; every rank calls ``record`` at the end of each
    optimizer step (the prepared optimizer does), and rank 0 writes.

    Args:
        path: the file rank 0 writes (truncated when the first step is recorded).
        comm: the data-parallel communicator the model is prepared over.
        header: what the run is (backend, world size, stage, precision, clipping, accumulation).
        parts: every entry's name (parameters and persistent buffers, alike on every rank), and this rank's part of
            each, the ranks' parts disjoint and together the whole (the prepared optimizer's ``fingerprint_parts``:
            values ``(start, flat)``, views; a rank may hold nothing of an entry).
        model: the user's module, whose forward's first tensor input gives the rows and the batch's digest (None:
            not known, as for ``hvd.DistributedOptimizer``, which is given parameters only).
    """

    def __init__(self, path: str, comm: Comm, header: Mapping[str, Any],
                 parts: Callable[[], tuple[Sequence[str], Mapping[str, tuple[int, torch.Tensor]]]],
                 model: torch.nn.Module | None = None) -> None:
        self.path, self.comm, self.header, self.parts = path, comm, dict(header), parts
        self.step = 0
        self._loss = torch.zeros((), dtype=torch.float64)
        self._losses = 0
        self._rows = 0
        self._inputs = 0.0
        self._digest = 0.0
        self._names: list[str] = []
        self._file: Any = None
        self.hook = None if model is None else model.register_forward_pre_hook(self._on_forward, with_kwargs=True)
        # what a verify run adds (attach()): random ops counted or switched off, rounding injected, per-module probes
        self.random: RandomOps | None = None
        self.rounding: Rounding | None = None
        self.probes: Probes | None = None

    def attach(self, random: RandomOps | None = None, rounding: Rounding | None = None,
               probes: Probes | None = None) -> None:
        """What a ``unidist verify`` run asks of this fingerprint beyond the step (``UNIDIST_FINGERPRINT_RANDOM``,
        ``_PERTURB``, ``_LOCATE``): their settings go in the header, their findings in the lines."""
        self.random, self.rounding, self.probes = random, rounding, probes
        if random is not None:
            self.header["random"] = "off" if random.switch_off else "count"
        if rounding is not None:
            self.header["perturb"] = rounding.seed
        if probes is not None:
            self.header["locate"] = probes.last

    # ------------------------------------------------------------------ what the step saw
    def _on_forward(self, module: torch.nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not (module.training and torch.is_grad_enabled()):
            return  # evaluation forwards are not part of a step
        first = next(iter(tensors((args, kwargs))), None)
        if first is not None and first.dim() > 0:
            self._rows += int(first.shape[0])
            wide = first.detach().double()
            self._inputs += float(wide.sum())
            # the sum alone lets other rows collide (token ids: two batches summing to 2012 were seen); each value
            # through a sine first, it cannot in practice, and it still adds up across ranks in any row order
            self._digest += float(torch.sin(wide * _GOLDEN + 0.5).sum())

    def add_loss(self, loss: torch.Tensor) -> None:
        """The loss one backward pass was given (before any scaling), kept on its device until the step."""
        self._loss = self._loss.to(loss.device) + loss.detach().double().sum()
        self._losses += 1

    # ------------------------------------------------------------------ the step (a step observer: prepared.py)
    def before_step(self, opt: Recorded) -> None:
        """The gradient norm kept where the optimizer's step consumes the gradients (DeepSpeed's engine)."""
        opt.hold_gradient_norm(self.comm.rank, self.comm.size)

    def after_step(self, opt: Recorded) -> None:
        """The step's line, from what ``opt`` reports (every rank, at every optimizer step)."""
        grad_sq, partitioned = opt.fingerprint_grad_sq(self.comm.rank, self.comm.size)
        self.record(grad_sq, partitioned, [g["lr"] for g in opt.param_groups if "lr" in g], opt.loss_scale,
                    opt.last_step_skipped)

    def record(self, grad_sq: float, partitioned: bool, lrs: Sequence[float], loss_scale: float = 1.0,
               skipped: bool = False) -> None:
        """Reduce this rank's part and write the step's line (rank 0). Every rank calls it at the same step.

        Args:
            grad_sq: this rank's part of the squared global gradient norm before clipping (inf: a skipped step).
            partitioned: whether the ranks' parts are disjoint (ZeRO's shards), or each holds the whole value.
            lrs: the learning rate of each parameter group.
            loss_scale: the fp16 loss scale after the step (1.0 without one).
            skipped: the step was not applied (inf/nan in the gradient).
        """
        self.step += 1
        if not partitioned and self.comm.rank != 0:
            grad_sq = 0.0  # every rank holds the whole value: count it once
        loss = float(self._loss.cpu()) if self._losses else 0.0
        head = torch.tensor([loss, float(self._losses), float(self._rows), self._inputs, grad_sq, self._digest],
                            dtype=torch.float64)
        probed = self.probes.take(self.comm.device) if self.probes is not None else None
        total = self._reduce(head, probed)
        self._loss, self._losses, self._rows = torch.zeros((), dtype=torch.float64), 0, 0
        self._inputs = self._digest = 0.0
        randoms = self.random.take() if self.random is not None else None
        if self.comm.rank == 0:
            extra: dict[str, Any] = {}
            if randoms:
                extra["random"] = randoms
            if probed is not None and self.probes is not None:
                extra["probes"] = self.probes.line(total[-probed.numel():].tolist())
            self._write(total, lrs, loss_scale, skipped, extra)
        if self.probes is not None and self.step >= self.probes.last:
            # verify --locate's re-run ends here, on every rank at the same step: the steps after are not needed
            self.close()
            raise SystemExit(0)

    def start(self) -> None:
        """The starting weights, as line ``"step": 0`` (every rank calls it once, after prepare): what two runs
        begin from, so that verify can tell different starting weights from a different first step."""
        total = self._reduce(torch.zeros(_HEAD, dtype=torch.float64), None)
        if self.comm.rank == 0:
            t = total.tolist()
            self._line({"step": 0, "params": self._params(t)})

    def _reduce(self, head: torch.Tensor, probed: torch.Tensor | None) -> torch.Tensor:
        """``head``, then two numbers per entry (its squares and its sum over this rank's part), then ``probed``,
        summed over the ranks in one allreduce."""
        names, pieces = self.parts()
        if not self._names:
            self._names = sorted(names)
        zero = torch.zeros(2, dtype=torch.float64)
        stats = []
        for name in self._names:
            piece = pieces.get(name)
            if piece is None or not piece[1].numel():
                stats.append(zero)
                continue
            # float32 on the piece's own device: BLAS's dot and torch's pairwise sum are accurate to ~1e-7 relative,
            # far inside verify's tolerances, and 8x cheaper than a float64 copy on a CPU
            flat = piece[1].detach().reshape(-1).float()
            stats.append(torch.stack((torch.dot(flat, flat), flat.sum())).to("cpu", torch.float64))
        vec = torch.cat([head, *stats]).to(self.comm.device)
        if probed is not None:
            vec = torch.cat([vec, probed])
        return self.comm.allreduce(vec, "sum").cpu()

    def _params(self, t: Sequence[float]) -> dict[str, list[float]]:
        return {n: [math.sqrt(max(t[_HEAD + 2 * i], 0.0)), t[_HEAD + 2 * i + 1]] for i, n in enumerate(self._names)}

    def _write(self, total: torch.Tensor, lrs: Sequence[float], loss_scale: float, skipped: bool,
               extra: Mapping[str, Any]) -> None:
        t = total.tolist()
        count = t[1] / self.comm.size  # backward passes per rank in this step
        params = self._params(t)
        line = {
            "step": self.step,
            "loss": t[0] / t[1] if t[1] else None,
            "grad_norm": math.sqrt(t[4]) if math.isfinite(t[4]) else None,
            "param_norm": math.sqrt(sum(v[0] ** 2 for v in params.values())),
            "param_sum": sum(v[1] for v in params.values()),
            "lr": [float(v) for v in lrs],
            "loss_scale": float(loss_scale),
            "skipped": bool(skipped),
            "rows": int(t[2]),
            "inputs": t[3],
            "digest": t[5],
            "passes": count,
            "params": params,
            **extra,
        }
        self._line(line)

    def _line(self, line: Mapping[str, Any]) -> None:
        """Write one line (rank 0), the header first."""
        if self._file is None:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self._file = open(self.path, "w", buffering=1)
            head = {"unidist_fingerprint": FORMAT, **self.header, "argv": [os.path.basename(sys.argv[0]),
                                                                           *sys.argv[1:]]}
            self._file.write(json.dumps(head) + "\n")
        self._file.write(json.dumps(line, allow_nan=True) + "\n")

    def event(self, kind: str, path: str | os.PathLike[str]) -> None:
        """A checkpoint saved or loaded (``kind``: "save" or "load") after ``self.step`` steps: a line of its own
        (rank 0), so that verify can tell a launch that resumed from one that trained from the start."""
        if self.comm.rank == 0:
            self._line({"event": kind, "path": os.path.abspath(os.fspath(path)), "after_step": self.step})

    def close(self) -> None:
        """Detach the hooks (the forward's, and what attach() added) and close the file."""
        if self.hook is not None:
            self.hook.remove()
            self.hook = None
        for part in (self.random, self.rounding, self.probes):
            if part is not None:
                part.close()
        self.random = self.rounding = self.probes = None
        if self._file is not None:
            self._file.close()
            self._file = None
