"""The DeepSpeed config ``prepare`` hands ``deepspeed.initialize``: built, merged with the user's, checked.

DeepSpeed's config has defaults that change the math of data-parallel training (gradient clipping at norm
1.0 above all); ``NEUTRAL_CONFIG`` pins each to what one process with a plain torch optimizer does, so the same
``prepare`` arguments train the same model as on the other backends. A user's ``deepspeed_config`` that sets
one of them again is asking for it and wins.

DeepSpeed rejects unknown keys inside its sections but ignores an unknown top-level key: a misspelt
``"gradient_cliping": 1.0`` trains without clipping and says nothing. ``validate`` lets DeepSpeed parse the
config and names every top-level key of the user's that its parser never read.
"""

from __future__ import annotations

import copy
import difflib
import json
from collections.abc import KeysView, Mapping
from pathlib import Path
from typing import Any

from unidist.errors import ConfigError
from unidist.train.options import TrainOptions

__all__ = ["NEUTRAL_CONFIG", "build", "load", "validate"]

# DeepSpeed 0.19 config defaults that would make training differ from one process on the whole batch, pinned.
NEUTRAL_CONFIG: Mapping[str, Any] = {
    "gradient_clipping": 0.0,  # default 1.0: clips by global norm 1 on every step (0 switches it off)
    "prescale_gradients": False,  # (default False) dividing before the allreduce rounds differently
    "gradient_predivide_factor": 1.0,  # (default 1.0) part of the averaging done before the sum
    "fp16": {"enabled": False},  # no mixed precision, so no loss scaling, unless asked for
    "bf16": {"enabled": False},
    "torch_autocast": {"enabled": False},  # would run forward in a lower dtype
}

Source = Mapping[str, Any] | str | Path


def build(opts: TrainOptions, world_size: int, user: Mapping[str, Any] | None) -> dict[str, Any]:
    """``NEUTRAL_CONFIG``, then ``prepare``'s arguments mapped to DeepSpeed's keys, then ``user`` on top.

    Args:
        opts: the ``prepare`` arguments.
        world_size: ranks averaging gradients (DeepSpeed's batch arithmetic counts them).
        user: the user's config as loaded by ``load``, or None.
    """
    bucket = int(opts.bucket_mb * 2**20 / 4)  # elements
    k = opts.backward_passes_per_step
    cfg: dict[str, Any] = copy.deepcopy(dict(NEUTRAL_CONFIG))
    _merge(cfg, {
        "train_micro_batch_size_per_gpu": 1,  # bookkeeping only: unidist never hands DeepSpeed the data
        "gradient_accumulation_steps": k,
        "train_batch_size": k * world_size,
        "zero_optimization": {"stage": opts.zero_stage, "reduce_bucket_size": bucket,
                              "allgather_bucket_size": bucket,
                              # default 1e5: parameters below 100k elements stay whole on every rank,
                              # which keeps small models entirely unsharded at stage 3
                              "stage3_param_persistence_threshold": 0},
        "zero_allow_untested_optimizer": True,  # any torch optimizer, as on every other backend
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    })
    if opts.clip_grad_norm is not None:
        cfg["gradient_clipping"] = opts.clip_grad_norm
    if opts.compression != "none":
        cfg["communication_data_type"] = opts.compression
    if user is not None:
        _merge(cfg, user)
        if "train_batch_size" in user:  # the user's batch arithmetic wins; DeepSpeed derives the rest
            if "train_micro_batch_size_per_gpu" not in user:
                cfg.pop("train_micro_batch_size_per_gpu")
        else:
            cfg["train_batch_size"] = cfg["train_micro_batch_size_per_gpu"] * cfg["gradient_accumulation_steps"] \
                * world_size
    return cfg


def load(source: Source) -> dict[str, Any]:
    """The user's config: a mapping (copied) or the path of a JSON file.

    Args:
        source: ``prepare(deepspeed_config=...)`` or ``UNIDIST_DEEPSPEED_CONFIG``.
    """
    if isinstance(source, Mapping):
        return copy.deepcopy(dict(source))
    path = Path(source)
    where = f"DeepSpeed config {str(path)!r} (UNIDIST_DEEPSPEED_CONFIG or deepspeed_config=)"
    try:
        loaded = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{where} does not exist") from None
    except IsADirectoryError:
        raise ConfigError(f"{where} is a directory; give the path of its JSON file") from None
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"{where} cannot be read: {err}") from None
    except json.JSONDecodeError as err:
        raise ConfigError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise ConfigError(f"{where} must hold a JSON object")
    return loaded


class _Reads(dict):  # type: ignore[type-arg]
    """A config dict that notes which keys its reader asked for (``copy.copy`` keeps the shared note)."""

    def __init__(self, data: Mapping[str, Any], read: set[str]) -> None:
        super().__init__(data)
        self.read = read

    def get(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().get(key, default)

    def __getitem__(self, key: Any) -> Any:
        self.read.add(key)
        return super().__getitem__(key)

    def __contains__(self, key: object) -> bool:
        self.read.add(str(key))
        return super().__contains__(key)

    def pop(self, key: Any, *default: Any) -> Any:
        self.read.add(key)
        return super().pop(key, *default)

    def setdefault(self, key: Any, default: Any = None) -> Any:
        self.read.add(key)
        return super().setdefault(key, default)

    def _all_read(self) -> None:  # a reader that walks every key may use any of them: none is reported
        self.read.update(super().keys())

    def keys(self) -> Any:  # DeepSpeed asks ``KEY in param_dict.keys()``: a membership test, not a walk
        return _Keys(self)

    def __copy__(self) -> _Reads:  # DeepSpeedConfig parses a copy: the copy shares the note, reads nothing
        return _Reads(dict(dict.items(self)), self.read)

    def items(self) -> Any:
        self._all_read()
        return super().items()

    def __iter__(self) -> Any:
        self._all_read()
        return super().__iter__()


class _Keys(KeysView):  # type: ignore[type-arg]
    def __init__(self, owner: _Reads) -> None:
        super().__init__(owner)
        self.owner = owner

    def __contains__(self, key: object) -> bool:
        return key in self.owner  # noted there

    def __iter__(self) -> Any:
        return iter(self.owner)  # a walk: every key counts as read


def validate(cfg: Mapping[str, Any], user: Mapping[str, Any], source: Source) -> None:
    """Parse ``cfg`` with DeepSpeed's own config class: its errors (a misspelt key inside a section, batch sizes
    that do not multiply out) and every top-level key of ``user`` DeepSpeed never reads become a ConfigError.

    Args:
        cfg: the merged config ``build`` returned.
        user: the user's part of it.
        source: where the user's part came from, for the message.
    """
    from deepspeed.runtime.config import DeepSpeedConfig

    where = "deepspeed_config (a mapping)" if isinstance(source, Mapping) else f"DeepSpeed config {str(source)!r}"
    read: set[str] = set()
    try:
        DeepSpeedConfig(_Reads(cfg, read))
    except Exception as err:  # DeepSpeedConfigError, pydantic's ValidationError, its asserts on batch sizes
        raise ConfigError(f"{where}: DeepSpeed refuses it: {err}") from None
    unknown = sorted(k for k in user if k not in read)
    if unknown:
        hints = []
        for key in unknown:
            close = difflib.get_close_matches(key, sorted(read - set(unknown)), n=1)  # the keys it knows
            hints.append(f"{key!r}" + (f" (did you mean {close[0]!r}?)" if close else ""))
        raise ConfigError(f"{where}: DeepSpeed does not know the top-level key(s) {', '.join(hints)}; it would "
                          "ignore them silently. Fix the spelling or remove them.")


def _merge(base: dict[str, Any], over: Mapping[str, Any]) -> None:
    for key, value in over.items():
        if isinstance(value, Mapping) and isinstance(base.get(key), dict):
            _merge(base[key], value)
        else:
            base[key] = copy.deepcopy(value)
