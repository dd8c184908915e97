"""``engine.save_checkpoint`` / ``engine.load_checkpoint``: DeepSpeed's directory protocol and DeepSpeed's files.

DeepSpeed's protocol is kept: ``save_dir/<tag>/`` per checkpoint (tag default ``global_step{N}``), ``save_dir/latest``
holding the newest tag (no newline), ``load_checkpoint(dir)`` reading it and returning ``(path, client_state)``, or
``(None, None)`` with a warning when there is none. The files inside the tag directory are DeepSpeed's own
(``mp_rank_00_model_states.pt`` and the ZeRO partition files, unidist.checkpoint.deepspeed_writer), so a script
trained here resumes under real DeepSpeed at the same data-parallel size and stage (DeepSpeed's own rule), and here
at any launcher, world size and stage (unidist.checkpoint.deepspeed_files reads them, as it reads what real
DeepSpeed wrote, counters and scheduler state included). Where DeepSpeed's format is not written (a 16-bit model
at stage 0, a pipeline or MoE engine, stage 3 without DeepSpeed installed: ``_not_deepspeeds`` says why, once, in
the log) the files are unidist's (``mgr.save_checkpoint``'s format), which unidist loads anywhere and
``unidist checkpoint export`` turns into a state dict; the engine's counters and scheduler travel in its ``extra``.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from unidist.checkpoint.deepspeed_writer import unsupported
from unidist.checkpoint.foreign import DEEPSPEED_KEY
from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError
from unidist.compat.deepspeed.missing import uncovered
from unidist.errors import CheckpointError, InvalidArgumentError
from unidist.parallel.moe import MoE

__all__ = ["LATEST", "load", "save"]

# ``deepspeed.checkpoint`` is also DeepSpeed's universal-checkpoint package: its constants are not here, and say so
__getattr__ = uncovered(__name__)

LATEST = "latest"
_KEY = "deepspeed_compat"  # the extra entry holding the engine's part
_log = logging.getLogger("unidist.compat.deepspeed")
_said: dict[str, bool] = {}  # each reason for unidist's format is logged once


def save(engine: Any, save_dir: str | os.PathLike[str], tag: Any, client_state: dict[str, Any] | None,
         save_latest: bool, exclude_frozen_parameters: bool) -> bool:
    """``engine.save_checkpoint`` (see there)."""
    if not save_dir:
        raise InvalidArgumentError("engine.save_checkpoint(save_dir=...) needs a directory")
    if exclude_frozen_parameters:
        raise DeepSpeedUnsupportedError("save_checkpoint(exclude_frozen_parameters=True) is not supported by "
                                        "unidist.compat.deepspeed: every parameter is saved")
    if client_state is not None and not isinstance(client_state, dict):
        raise InvalidArgumentError(f"save_checkpoint(client_state=...) takes a dict, got {type(client_state).__name__}")
    mgr = engine.manager
    tag = f"global_step{engine.global_steps}" if tag is None else str(tag)
    _check_same_tag(mgr, tag)
    scheduler = engine.lr_scheduler
    client = dict(client_state or {})
    counters, scheduled = engine.counters(), scheduler.state_dict() if scheduler is not None else None
    directory = Path(save_dir)
    _agree(mgr, lambda: directory.mkdir(parents=True, exist_ok=True), "save_checkpoint: cannot create")
    why = _not_deepspeeds(engine)
    if why is None:
        # client_state keys become keyword arguments: none may be one of save_checkpoint's own
        own = {n for n, a in inspect.signature(mgr.save_checkpoint).parameters.items() if a.kind != a.VAR_KEYWORD}
        clash = sorted(set(client) & own)
        if clash:
            raise InvalidArgumentError(f"save_checkpoint(client_state=...): {clash} cannot be client-state keys here "
                                       "(they name save_checkpoint's own arguments); rename them")
        head = {**counters, "lr_scheduler": scheduled, "ds_config": engine.config}
        mgr.save_checkpoint(directory / tag, engine.prepared_model, engine.optimizer, format="deepspeed",
                            **{DEEPSPEED_KEY: head}, **client)
    else:
        if not _said.get(why):
            _said[why] = True
            _log.warning("engine.save_checkpoint: writing unidist's format to %s, which real DeepSpeed cannot read "
                         "(%s); unidist loads it at any world size and stage, and `unidist checkpoint export` gives "
                         "the model's state dict", directory / tag, why)
        part = {"client_state": client, "counters": counters, "lr_scheduler": scheduled}
        mgr.save_checkpoint(directory / tag, engine.prepared_model, engine.optimizer, **{_KEY: part})
    if save_latest:
        def write_latest() -> None:
            tmp = directory / f".{LATEST}.tmp"
            tmp.write_text(tag)  # DeepSpeed writes the bare tag
            os.replace(tmp, directory / LATEST)

        _agree(mgr, write_latest, "save_checkpoint: cannot write the latest file in")
    else:
        mgr.barrier()
    return True


def load(engine: Any, load_dir: str | os.PathLike[str], tag: Any, load_module_strict: bool,
         load_optimizer_states: bool, load_lr_scheduler_states: bool, load_module_only: bool,
         custom_load_fn: Any) -> tuple[Any, Any]:
    """``engine.load_checkpoint`` (see there)."""
    if custom_load_fn is not None:
        raise DeepSpeedUnsupportedError("load_checkpoint(custom_load_fn=...) is not supported by "
                                        "unidist.compat.deepspeed")
    if not load_module_strict:
        raise DeepSpeedUnsupportedError("load_checkpoint(load_module_strict=False) is not supported by "
                                        "unidist.compat.deepspeed: every parameter must match")
    mgr = engine.manager
    directory = Path(load_dir)
    # rank 0 resolves the tag and every rank follows its answer: ranks that saw different files would otherwise
    # part ways here, some returning or raising while the others wait in the load's collectives
    found: tuple[str, str] | None = _resolve(directory, tag) if mgr.rank == 0 else None
    if mgr.size > 1:
        found = mgr.broadcast_object(found, 0)
    if found is None:  # cannot happen: rank 0 always resolves; a typed error rather than an unpacking one
        raise CheckpointError("engine.load_checkpoint: rank 0's view of the checkpoint did not arrive")
    kind, value = found
    if kind == "missing":
        _log.warning("Unable to find latest file at %s, if trying to load latest checkpoint please ensure this file "
                     "exists or pass an explicit checkpoint tag when loading a checkpoint.", value)
        return None, None
    if kind == "error":
        raise CheckpointError(value)
    path = directory / value
    with_optimizer = load_optimizer_states and not load_module_only and engine.optimizer is not None
    extra = mgr.load_checkpoint(path, engine.prepared_model, engine.optimizer if with_optimizer else None)
    part = extra.get(_KEY)
    if part is None:
        written = extra.pop(DEEPSPEED_KEY, None)  # real DeepSpeed wrote it: its engine counters and scheduler
        if written is None:  # a checkpoint mgr.save_checkpoint wrote directly: weights (and optimizer) only
            return str(path), {}
        part = {"client_state": extra, "counters": written, "lr_scheduler": written.get("lr_scheduler")}
    if not load_module_only:
        engine.restore_counters(part["counters"])
        saved = part.get("lr_scheduler")
        if load_lr_scheduler_states and saved is not None and engine.lr_scheduler is not None:
            engine.lr_scheduler.load_state_dict(saved)
    return str(path), dict(part["client_state"])


def _not_deepspeeds(engine: Any) -> str | None:
    """Why this engine's checkpoint cannot be in DeepSpeed's format (None: it is)."""
    if engine.not_deepspeeds_files is not None:
        return str(engine.not_deepspeeds_files)
    if any(isinstance(m, MoE) for m in engine.module.modules()):
        return "a model with MoE layers (DeepSpeed writes one file per expert)"
    dtype = torch.float16 if engine.fp16_enabled() else torch.bfloat16 if engine.bfloat16_enabled() else torch.float32
    return unsupported(engine.zero_optimization_stage(), dtype, engine.config)


def _resolve(directory: Path, tag: Any) -> tuple[str, str]:
    """("ok", tag), ("missing", the latest file's path) or ("error", a message): rank 0's view of ``directory``."""
    if tag is None:
        latest = directory / LATEST
        if not latest.is_file():
            return "missing", str(latest)
        tag = latest.read_text().strip()
    path = directory / str(tag)
    if path.is_dir():
        return "ok", str(tag)
    if not directory.is_dir():
        return "error", f"engine.load_checkpoint: {str(directory)!r} does not exist"
    tags = sorted(p.name for p in directory.iterdir() if p.is_dir())
    return "error", f"engine.load_checkpoint: no checkpoint {str(path)!r} (tag {tag!r}); the tags there are {tags}"


def _agree(mgr: Any, work: Callable[[], None], what: str) -> None:
    """Rank 0 does ``work`` (a file operation); every rank learns whether it failed and raises the same error, so
    no rank is left waiting in a barrier the failed one never reaches."""
    error = None
    if mgr.rank == 0:
        try:
            work()
        except OSError as err:
            error = f"{what} {err.filename!r}: {err.strerror or err}"
    if mgr.size > 1:
        error = mgr.broadcast_object(error, 0)
    if error is not None:
        raise CheckpointError(error)


def _check_same_tag(mgr: Any, tag: str) -> None:
    """Every rank must save under the same tag (DeepSpeed checks this too): else each would write half a
    checkpoint into a different directory."""
    if mgr.size == 1:
        return
    tags = mgr.allgather_object(tag)
    if len(set(tags)) != 1:
        raise InvalidArgumentError(f"save_checkpoint: the ranks passed different tags {tags}; pass the same tag "
                                   "on every rank")
