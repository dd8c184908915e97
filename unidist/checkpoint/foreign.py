"""Loading a checkpoint another engine wrote: the format found from the files, said in one log line, checked against
what its own files declare, and read into any layout through the same ``Layout.load`` as unidist's own format.

A foreign format has no digests: what is checked is what its files declare. Before anything changes, every model
entry and every optimizer parameter is matched by name and shape (numel included) on every rank, and a checkpoint
with no optimizer state when an optimizer is passed is refused; after the load, each parameter's optimizer scalars
(Adam's step) must equal the file's. The files are read slice by slice (DeepSpeed's memory-mapped, DCP's chunk by
chunk), so a rank whose layout shards the state reads only its part.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import torch

from unidist.checkpoint.agree import World, agree
from unidist.checkpoint.dcp_files import DCPFiles
from unidist.checkpoint.dcp_files import find as find_dcp
from unidist.checkpoint.deepspeed_files import DEEPSPEED_KEY, DeepSpeedFiles
from unidist.checkpoint.deepspeed_files import find as find_deepspeed
from unidist.checkpoint.layout import Layout, check_params
from unidist.errors import CheckpointError, CheckpointMismatchError, InvalidArgumentError

__all__ = ["DEEPSPEED_KEY", "Foreign", "detect", "load"]

_log = logging.getLogger("unidist")


class Foreign(Protocol):
    """What loading needs of another engine's files (deepspeed_files.py, dcp_files.py)."""

    dir: Path
    groups: list[list[str]]  # the optimizer's parameter names, per param group
    settings: list[dict[str, Any]]  # each param group's settings
    params: list[str]

    def describe(self) -> str: ...

    def bind(self, names: list[str]) -> None: ...

    def canonical(self, name: str) -> str: ...

    def model_shapes(self) -> dict[str, tuple[int, ...]]: ...

    def dtype_of(self, name: str) -> torch.dtype: ...

    def state_keys(self) -> dict[str, list[str]]: ...

    def scalars(self) -> dict[str, dict[str, Any]]: ...

    def optimizer_classes(self) -> set[str] | None: ...

    def optimizer_name(self) -> str: ...

    def extra(self) -> dict[str, Any]: ...

    def files(self) -> list[Path]: ...

    def read(self, kind: str, name: str, key: str, start: int, end: int) -> torch.Tensor: ...


def detect(path: Path) -> Foreign | None:
    """The foreign checkpoint at ``path`` (DeepSpeed's, or torch DCP's), or None when it is neither (then it is
    read, or refused, as unidist's own)."""
    tag_dir = find_deepspeed(path)
    if tag_dir is not None:
        return DeepSpeedFiles(tag_dir)
    dcp_dir = find_dcp(path)
    return DCPFiles(dcp_dir) if dcp_dir is not None else None


def _fits(src: Foreign, layout: Layout, with_optimizer: bool, path: Path) -> None:
    """The first difference between what the files declare and the model/optimizer, as a CheckpointMismatchError."""
    saved = src.model_shapes()
    for name, want in layout.describe()["model"].items():
        got = saved.get(name)
        if got is None:
            raise CheckpointMismatchError(f"{path}: the model has {name!r} {tuple(want['shape'])} but the checkpoint "
                                          "does not: is it this model's?")
        if tuple(got) != tuple(want["shape"]):
            raise CheckpointMismatchError(f"{path}: {name!r} is {tuple(got)} in the checkpoint and "
                                          f"{tuple(want['shape'])} in the model")
    mine = layout.describe()["model"]
    extra = [n for n in saved if n not in mine]
    if extra:
        raise CheckpointMismatchError(f"{path}: the checkpoint has {extra[0]!r}, which the model does not")
    if not with_optimizer:
        return
    if not src.state_keys():
        raise CheckpointMismatchError(f"{path} holds no optimizer state; load it with optimizer=None (the weights "
                                      "only)")
    family, target = src.optimizer_classes(), type(layout.optimizer).__name__
    if family is not None and target not in family:
        raise CheckpointMismatchError(f"{path} holds the state of {src.optimizer_name()} optimizer and this one is "
                                      f"{target}: pass one of {sorted(family)}, or optimizer=None")
    check_params(path, {n: gi for gi, g in enumerate(src.groups) for n in g}, layout.describe()["optimizer"],
                 src.canonical)
    if len(src.settings) != len(layout.optimizer.param_groups):
        raise CheckpointMismatchError(f"{path} has {len(src.settings)} param groups and the optimizer "
                                      f"{len(layout.optimizer.param_groups)}")


def load(mgr: World, src: Foreign, layout: Layout, path: Path) -> dict[str, Any]:
    """Load ``src`` into ``layout`` (``layout.optimizer`` None: the model only); returns what the files hold
    beside the model and optimizer (``src.extra()``). Every rank of ``mgr`` calls it."""
    with_optimizer = layout.optimizer is not None
    problem: BaseException | None = None
    try:
        if tuple(layout.ranks) != tuple(range(mgr.size)):
            raise InvalidArgumentError(f"load_checkpoint({str(path)!r}): another engine's checkpoint loads into a "
                                       "model prepared over the whole world (without prepare(group=...))")
        if with_optimizer:
            src.bind(list(layout.describe()["optimizer"]["params"]))
        _fits(src, layout, with_optimizer, path)
    except (CheckpointError, InvalidArgumentError) as err:
        problem = err
    agree(mgr, problem)
    if mgr.rank == 0:
        _log.warning("load_checkpoint(%s): %s", src.dir, src.describe())
    keys = src.state_keys() if with_optimizer else {}
    scalars = src.scalars() if with_optimizer else {}
    meta = {"param_groups": src.settings if with_optimizer else [], "scalars": scalars}
    layout.load(src.read, meta, keys)
    wrong = []
    if with_optimizer:
        now = layout.meta()["scalars"]
        wrong = [f"{k!r} of {n!r}" for n, st in scalars.items() for k, v in st.items()
                 if n in now and not _same(now[n].get(k), v)]
    agree(mgr, CheckpointMismatchError(f"{path}: after the load, the optimizer scalar {wrong[0]} differs from the "
                                       "file's: the load went wrong; load another checkpoint before training")
          if wrong else None)
    return src.extra()


def _same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and \
            torch.equal(a.detach().cpu().to(b.dtype), b.detach().cpu())
    return bool(a == b)

