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
from unidist.precisions import MODES, masters_of
from unidist.request import PrepareRequest

__all__ = ["NEUTRAL_CONFIG", "build", "check_agreement", "config_precision", "load", "precision_section", "validate"]

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

# prepare(precision=) in DeepSpeed's terms, read off the mode's row (unidist/precisions.py). An autocast mode
# ("bf16-mixed", "fp16-mixed": float32 parameters are the master weights) is DeepSpeed's torch_autocast section;
# lower_precision_safe_modules=[]: DeepSpeed would otherwise mark every Linear/Conv parameter to have its gradient
# reduced in the autocast dtype, and those modes reduce float32 gradients on every backend. A mode with master
# copies of a lower-precision model ("bf16-master") is DeepSpeed's own bf16/fp16 section, which means exactly that
# (a half-precision model, fp32 copies in the optimizer, gradients averaged in the model's dtype).
_SECTIONS: Mapping[str, str] = {"bfloat16": "bf16", "float16": "fp16"}  # a model dtype -> DeepSpeed's section


def precision_section(precision: str) -> dict[str, Any]:
    """DeepSpeed's config for ``prepare(precision=...)`` (the keys ``NEUTRAL_CONFIG`` pins, set)."""
    mode = MODES[precision]
    if mode.autocast:
        return {"torch_autocast": {"enabled": True, "dtype": mode.compute, "lower_precision_safe_modules": []}}
    if mode.keeps_masters and mode.params in _SECTIONS:
        return {_SECTIONS[mode.params]: {"enabled": True}}
    return {}


def config_precision(user: Mapping[str, Any]) -> tuple[str | None, str | None]:
    """What precision ``user``'s fp16/bf16/torch_autocast sections ask for: (unidist's name or None when it has
    none, a description of the setting for messages or None when the config says nothing about precision).
    ``torch_autocast`` switched off says "32"; DeepSpeed's fp16/bf16 sections switched off say nothing."""
    import torch

    def enabled(name: str) -> bool | None:
        sec = user.get(name)
        return bool(sec.get("enabled", False)) if isinstance(sec, Mapping) else None

    fp16, bf16, auto = enabled("fp16"), enabled("bf16"), enabled("torch_autocast")
    if fp16:
        return None, "fp16.enabled=true (DeepSpeed's float16 model with fp32 master weights, not autocast)"
    if bf16:
        mode = masters_of("bfloat16")
        return (mode.name if mode else None), "bf16.enabled=true (DeepSpeed's bfloat16 model with fp32 master weights)"
    if auto:
        raw = user["torch_autocast"].get("dtype")
        # DeepSpeed's DtypeEnum spellings (no dtype: the device's autocast default, no unidist name)
        names = {**dict.fromkeys(["torch.float16", "fp16", "float16", "half", torch.float16], "fp16-mixed"),
                 **dict.fromkeys(["torch.bfloat16", "bf16", "bfloat16", torch.bfloat16], "bf16-mixed")}
        name = names.get(raw) if raw is not None else None
        return name, f"torch_autocast={{enabled: true, dtype: {raw!r}}}"
    if auto is None:  # fp16/bf16 sections switched off say nothing: unidist never uses them
        return None, None
    return "32", "torch_autocast.enabled=false"


def _name(source: Source, env: bool) -> str:
    if isinstance(source, Mapping):
        return "prepare(deepspeed_config={...})"
    return f"UNIDIST_DEEPSPEED_CONFIG {str(source)!r}" if env else f"prepare(deepspeed_config={str(source)!r})"


def check_agreement(opts: PrepareRequest, user: Mapping[str, Any], source: Source, *, env: bool = False
                    ) -> PrepareRequest:
    """A setting both ``user`` (the DeepSpeed config) and ``prepare`` set explicitly (an argument or a
    ``UNIDIST_*`` variable: ``opts.sources``) must agree: a ConfigError names both sources and values. A setting
    prepare left at its default takes the config's value; the returned PrepareRequest carries it (so the unidist
    side, loss scaling and output casts, follows what the engine runs).

    Args:
        opts: what prepare was given.
        user: the user's DeepSpeed config as ``load`` returned it.
        source: where it came from; ``env``: from ``UNIDIST_DEEPSPEED_CONFIG`` (else prepare's argument).
    """
    import dataclasses

    where = _name(source, env)
    follow: dict[str, Any] = {}

    def clash(setting: str, theirs: Any, option: str, ours: Any) -> None:
        raise ConfigError(f"{where} sets {setting} and {opts.sources[option]} asks for {ours}; set one of them "
                          f"(drop it from the DeepSpeed config, or the argument/variable)")

    zero = user.get("zero_optimization")
    if isinstance(zero, Mapping) and "stage" in zero:
        stage = zero["stage"]
        if "zero_stage" in opts.sources:
            if stage != opts.zero_stage:
                clash(f"zero_optimization.stage={stage}", stage, "zero_stage", opts.zero_stage)
        elif stage in (0, 1, 2, 3) and not isinstance(stage, bool):
            follow["zero_stage"] = stage
    clip = user.get("gradient_clipping")
    if clip is not None and "clip_grad_norm" in opts.sources and opts.clip_grad_norm is not None:
        if float(clip) != opts.clip_grad_norm:
            clash(f"gradient_clipping={clip}", clip, "clip_grad_norm", opts.clip_grad_norm)
    gas = user.get("gradient_accumulation_steps")
    if gas is not None:
        if "backward_passes_per_step" in opts.sources:
            if gas != opts.backward_passes_per_step:
                clash(f"gradient_accumulation_steps={gas}", gas, "backward_passes_per_step",
                      opts.backward_passes_per_step)
        elif isinstance(gas, int) and not isinstance(gas, bool) and gas >= 1:
            follow["backward_passes_per_step"] = gas
    name, said = config_precision(user)
    if said is not None:
        if "precision" in opts.sources:
            if name != opts.precision:
                clash(said, name, "precision", repr(opts.precision))
        elif name is not None:
            follow["precision"] = name
    return dataclasses.replace(opts, **follow) if follow else opts


def build(opts: PrepareRequest, world_size: int, user: Mapping[str, Any] | None) -> dict[str, Any]:
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
    _merge(cfg, precision_section(opts.precision))
    if opts.clip_grad_norm is not None:
        cfg["gradient_clipping"] = opts.clip_grad_norm
    if opts.compression != "none":
        cfg["communication_data_type"] = opts.compression
    if opts.offload is not None:  # ZeRO-Offload: the user's torch optimizer steps on the host (not DeepSpeedCPUAdam)
        moved = {"device": opts.offload, "pin_memory": True}
        cfg["zero_optimization"]["offload_optimizer"] = dict(moved)
        if opts.zero_stage == 3:
            cfg["zero_optimization"]["offload_param"] = dict(moved)
        cfg["zero_force_ds_cpu_optimizer"] = False
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
