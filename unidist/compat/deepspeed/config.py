"""A DeepSpeed 0.19.8 config, read with DeepSpeed's meaning and defaults: ``load_source``, ``parse``, ``DSConfig``.

Every key is a row of ``keys.KEYS`` (DeepSpeed's default, where it works). ``parse`` fills in DeepSpeed's defaults
(``gradient_clipping`` 1.0 among them), infers the batch triple with DeepSpeed's floor arithmetic and refuses
what DeepSpeed refuses with DeepSpeed's own texts (``runtime/config.py:590-651``). It is stricter than DeepSpeed on
purpose: DeepSpeed ignores an unknown top-level key silently (a misspelt ``"gradient_cliping": 1.0`` trains with
the default clipping of 1.0) and rejects unknown keys inside its sections without a hint; here both are a
DeepSpeedConfigError with the closest known key. Off the deepspeed backend a key only DeepSpeed's engine can honour
(offload, NVMe, ZeRO++, pipeline ...) is a DeepSpeedUnsupportedError naming it; on the deepspeed backend those keys
are listed by ``DSConfig.deepspeed_only()`` and DeepSpeed gets the user's config untouched.
"""

from __future__ import annotations

import base64
import binascii
import copy
import difflib
import json
import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from unidist.compat.deepspeed.exceptions import DeepSpeedConfigError, DeepSpeedUnsupportedError
from unidist.compat.deepspeed.keys import CPU_OFFLOAD, DS_ONLY, KEYS, REFUSED, REMOVED, SECTIONS, SYNONYMS, Key, by_name
from unidist.precisions import masters_of

__all__ = ["KEYS", "DSConfig", "load_source", "parse"]

_PYDANTIC = ("fp16", "bf16", "zero_optimization")  # DeepSpeed drops "auto" values in these (config_utils.py:56-58)


@dataclass(frozen=True)
class DSConfig:
    """A parsed config: the batch triple as DeepSpeed infers it and the keys the engine needs, defaults filled.

    ``values`` has every KEYS row's value (the user's, or DeepSpeed's default; the batch triple as inferred) by
    dotted name; ``get(name)`` reads it."""

    raw: Mapping[str, Any]
    train_batch_size: int
    train_micro_batch_size_per_gpu: int
    gradient_accumulation_steps: int
    gradient_clipping: float
    zero_stage: int
    reduce_bucket_size: int
    optimizer: Mapping[str, Any] | None
    scheduler: Mapping[str, Any] | None
    fp16: Mapping[str, Any]
    bf16_enabled: bool
    zero_allow_untested_optimizer: bool
    dataloader_drop_last: bool
    steps_per_print: int | None
    wall_clock_breakdown: bool
    values: Mapping[str, Any] = field(default_factory=dict)
    ds_only: Mapping[str, Any] = field(default_factory=dict)

    def precision(self) -> str:
        """unidist's precision name for the fp16/bf16 sections: the bf16 section is a bfloat16 model with float32
        master copies (``"bf16-master"``, unidist/precisions.py), the fp16 section ``"fp16-mixed"`` (autocast with
        DeepSpeed's loss scaling: no mode keeps a float16 model's master copies yet), neither ``"32"``."""
        if self.fp16.get("enabled"):
            mode = masters_of("float16")
            return mode.name if mode is not None else "fp16-mixed"
        mode = masters_of("bfloat16")
        return mode.name if self.bf16_enabled and mode is not None else "32"

    def offload(self) -> str | None:
        """``"cpu"`` when the config offloads to the CPU (``offload_optimizer``/``offload_param`` with device
        cpu, the deprecated ``cpu_offload``/``cpu_offload_param``): ``prepare(offload="cpu")``; else None."""
        return "cpu" if any(CPU_OFFLOAD[name](self.values[name]) for name in CPU_OFFLOAD) else None

    def deepspeed_only(self) -> dict[str, Any]:
        """The user's keys only real DeepSpeed honours, as a DeepSpeed config to merge into the one the deepspeed
        backend hands ``deepspeed.initialize`` (``{"zero_optimization": {"offload_optimizer": {...}}, "aio":
        {...}}``); {} when none. Only non-empty under ``parse(on_deepspeed=True)``: elsewhere such a key is an
        error. ``ds_only`` has the same keys by dotted name."""
        out: dict[str, Any] = {}
        for name, value in self.ds_only.items():
            section, _, leaf = name.rpartition(".")
            (out.setdefault(section, {}) if section else out)[leaf] = copy.deepcopy(value)
        return out

    def get(self, name: str) -> Any:
        """The value of dotted ``name`` (a KEYS row): the user's, or DeepSpeed's default."""
        return self.values[by_name(name).name]


def _duplicates_refused(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:  # DeepSpeed: dict_raise_error_on_duplicate_keys (config_utils.py:205-212)
            raise DeepSpeedConfigError(f"Duplicate keys in DeepSpeed config: [{key!r}]")
        out[key] = value
    return out


def _load_text(text: str, where: str) -> dict[str, Any]:
    try:
        loaded = json.loads(text, object_pairs_hook=_duplicates_refused)
    except json.JSONDecodeError as err:
        raise DeepSpeedConfigError(f"{where} is not valid JSON: {err}") from None
    if not isinstance(loaded, dict):
        raise DeepSpeedConfigError(f"{where} must hold a JSON object, not {type(loaded).__name__}")
    return loaded


def _load(source: Any) -> dict[str, Any]:
    """A mapping (copied as a dict), a JSON file's path, or base64 of a JSON text (DeepSpeed takes all three,
    runtime/config.py:440-452)."""
    if isinstance(source, Mapping):
        return dict(source)
    if not isinstance(source, (str, os.PathLike)):
        raise DeepSpeedConfigError(f"a DeepSpeed config is a dict or a JSON file's path, not {type(source).__name__}")
    path = os.fspath(source)
    if os.path.exists(path):
        try:
            with open(path, encoding="utf-8") as fh:
                text = fh.read()
        except (OSError, UnicodeDecodeError) as err:
            raise DeepSpeedConfigError(f"DeepSpeed config {path!r} cannot be read: {err}") from None
        return _load_text(text, f"DeepSpeed config {path!r}")
    try:
        decoded = base64.urlsafe_b64decode(path).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise DeepSpeedConfigError("Expected a string path to an existing deepspeed config, or a dictionary or a "
                                   f"valid base64. Received: {path}") from None
    return _load_text(decoded, "the base64 DeepSpeed config")


def load_source(args: Any, config: Mapping[str, Any] | str | None,
                config_params: Mapping[str, Any] | str | None) -> dict[str, Any]:
    """The config ``deepspeed.initialize`` would use (``deepspeed/__init__.py:513-533``): ``config``, else
    ``config_params``; ``args.deepscale_config`` (deprecated) is moved to ``args.deepspeed_config`` as DeepSpeed
    does; ``args.deepspeed_config`` together with a config argument, or no config at all, is an error with
    DeepSpeed's text. A str is a JSON file's path (duplicate keys refused)."""
    if config is None and config_params is not None:
        config = config_params
    if getattr(args, "deepscale_config", None) is not None:
        if getattr(args, "deepspeed_config", None) is not None:
            raise DeepSpeedConfigError("Not sure how to proceed, we were given both a deepscale_config and "
                                       "deepspeed_config")
        args.deepspeed_config = args.deepscale_config
        args.deepscale_config = None
    if getattr(args, "deepspeed_config", None) is not None:
        if config is not None:
            raise DeepSpeedConfigError("Not sure how to proceed, we were given deepspeed configs in the deepspeed "
                                       "arguments and deepspeed.initialize() function call")
        config = args.deepspeed_config
    if config is None:
        raise DeepSpeedConfigError("DeepSpeed requires --deepspeed_config to specify configuration file")
    return _load(config)


def _check(row: Key, name: str, value: Any) -> Any:
    """``value`` checked against the row's kind (an integral float such as 5e7 becomes an int, as pydantic
    does); a DeepSpeedConfigError says what was expected."""
    kind = row.kind

    def bad(expected: str) -> DeepSpeedConfigError:
        hint = " (\"auto\" is filled in by Hugging Face's Trainer/Accelerate, not by DeepSpeed: give the value)" \
            if value == "auto" else ""
        return DeepSpeedConfigError(f"DeepSpeed config key {name!r} must be {expected}, got {value!r}{hint}")

    if kind == "any":
        return value
    if kind == "bool":
        if not isinstance(value, bool):
            raise bad("true or false")
        return value
    if kind == "str":
        if not isinstance(value, str):
            raise bad("a string")
        return value
    if kind == "dict":
        if not isinstance(value, Mapping):
            raise bad("a JSON object")
        return value
    number = isinstance(value, (int, float)) and not isinstance(value, bool)
    if kind in ("int", "int>0", "int>=0", "stage"):
        if not number or not math.isfinite(value) or value != int(value):
            raise bad("an integer")
        value = int(value)
        if kind == "int>0" and value <= 0:
            raise bad("an integer > 0")
        if kind == "int>=0" and value < 0:
            raise bad("an integer >= 0")
        if kind == "stage" and value not in (0, 1, 2, 3):
            raise bad("a ZeRO stage: 0, 1, 2 or 3")
        return value
    if not number or not math.isfinite(value):
        raise bad("a finite number")
    if kind == "num>0" and value <= 0:
        raise bad("a number > 0")
    if kind == "num>=0" and value < 0:
        raise bad("a number >= 0")
    return value


def _unknown(name: str, known: list[str]) -> str:
    leaf = name.rsplit(".", 1)[-1]
    close = difflib.get_close_matches(leaf, known, n=1)
    return f"{name!r}" + (f" (did you mean {close[0]!r}?)" if close else "")


def _flatten(raw: Mapping[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The user's keys by dotted row name (synonyms resolved; sections' inner keys under ``section.``) and the
    unknown ones, each with its closest known key."""
    tops = sorted({k.name for k in KEYS if "." not in k.name} | {s for s in SYNONYMS if "." not in s})
    given: dict[str, Any] = {}
    unknown: list[str] = []
    raw = dict(raw)
    if "bfloat16" in raw and "bf16" in raw:
        raise DeepSpeedConfigError("give the bf16 section once: 'bf16' (DeepSpeed ignores the old 'bfloat16' "
                                   "when both are present)")
    zero = raw.get("zero_optimization")
    if isinstance(zero, bool):  # the deprecated form: true = stage 1 (zero/config.py:59-68)
        raw["zero_optimization"] = {"stage": 1 if zero else 0}
    for key, value in raw.items():
        if key not in tops:
            unknown.append(_unknown(key, tops))
            continue
        name = SYNONYMS.get(key, key)
        given[name] = value
        if name in SECTIONS and isinstance(value, Mapping):
            inner = sorted({k.name.split(".", 1)[1] for k in KEYS if k.name.startswith(name + ".")}
                           | {s.split(".", 1)[1] for s in SYNONYMS if s.startswith(name + ".")})
            for sub, subvalue in value.items():
                if name in _PYDANTIC and subvalue == "auto":
                    continue  # DeepSpeed's non-strict models treat "auto" as unset
                if sub not in inner:
                    unknown.append(_unknown(f"{name}.{sub}", inner))
                    continue
                given[by_name(f"{name}.{sub}").name] = subvalue
    return given, unknown


def _batch(given: Mapping[str, Any], world: int) -> tuple[int, int, int]:
    """DeepSpeed's batch triple: the missing ones inferred by floor division, then checked with DeepSpeed's texts
    (runtime/config.py:590-651; there AssertionErrors)."""
    tb, mb, gas = (given.get(k) for k in ("train_batch_size", "train_micro_batch_size_per_gpu",
                                          "gradient_accumulation_steps"))
    if tb is not None and mb is not None and gas is not None:
        pass
    elif tb is not None and mb is not None:
        gas = tb // mb // world
    elif tb is not None and gas is not None:
        mb = tb // world // gas
    elif mb is not None and gas is not None:
        tb = mb * gas * world
    elif tb is not None:
        gas, mb = 1, tb // world
    elif mb is not None:
        tb, gas = mb * world, 1
    else:
        raise DeepSpeedConfigError("Either train_batch_size or train_micro_batch_size_per_gpu needs to be provided")
    if tb <= 0:
        raise DeepSpeedConfigError(f"Train batch size: {tb} has to be greater than 0")
    if mb <= 0:
        raise DeepSpeedConfigError(f"Micro batch size per gpu: {mb} has to be greater than 0")
    if gas <= 0:
        raise DeepSpeedConfigError(f"Gradient accumulation steps: {gas} has to be greater than 0")
    if tb != mb * gas * world:
        raise DeepSpeedConfigError("Check batch related parameters. train_batch_size is not equal to "
                                   f"micro_batch_per_gpu * gradient_acc_step * world_size {tb} != {mb} * {gas} * "
                                   f"{world}")
    return tb, mb, gas


def parse(raw: Mapping[str, Any], world_size: int, *, on_deepspeed: bool) -> DSConfig:
    """``raw`` read as DeepSpeed 0.19.8 reads it for ``world_size`` data-parallel ranks.

    Raises DeepSpeedConfigError (unknown key with a suggestion, bad value, removed key, batch triple, fp16 and
    bf16 together) and, when not ``on_deepspeed``, DeepSpeedUnsupportedError naming the DeepSpeed-only keys."""
    if not isinstance(raw, Mapping):
        raise DeepSpeedConfigError(f"a DeepSpeed config is a dict, not {type(raw).__name__}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise DeepSpeedConfigError(f"world_size must be an integer >= 1, got {world_size!r}")
    given, unknown = _flatten(raw)
    if unknown:
        raise DeepSpeedConfigError(f"unknown DeepSpeed config key(s) {', '.join(unknown)}. DeepSpeed would ignore "
                                   "an unknown top-level key silently; unidist refuses it. Fix the spelling or "
                                   "remove it.")
    removed = [name for name in given if by_name(name).where == REMOVED]
    if removed:
        raise DeepSpeedConfigError(f"DeepSpeed 0.19.8 removed the config key(s) {removed} (its own parser refuses "
                                   "them, see https://github.com/deepspeedai/DeepSpeed/issues/8489); remove them")
    values = {k.name: k.default for k in KEYS if k.where != REMOVED}
    ds_only: dict[str, Any] = {}
    for name, value in given.items():
        row = by_name(name)
        value = _check(row, name, value)
        values[name] = value
        if row.where == DS_ONLY and not (row.fine is not None and row.fine(value)):
            ds_only[name] = value
        elif on_deepspeed and name in CPU_OFFLOAD and CPU_OFFLOAD[name](value):
            ds_only[name] = value  # DeepSpeed's engine offloads as the user configured it (pin_memory, ratio...)
    if ds_only and not on_deepspeed:
        named = ", ".join(f"{n} {by_name(n).here.removeprefix(REFUSED).strip()}".strip() for n in sorted(ds_only))
        raise DeepSpeedUnsupportedError(f"DeepSpeed config key(s) {named}: only DeepSpeed's engine does that; run "
                                        "under the deepspeed launcher, or remove them to train with unidist's engine "
                                        "on this backend")
    fp16 = {k.name.split(".", 1)[1]: values[k.name] for k in KEYS if k.name.startswith("fp16.")}
    if fp16["enabled"] and values["bf16.enabled"]:
        raise DeepSpeedConfigError("bfloat16 and fp16 modes cannot be simultaneously enabled")
    if fp16["enabled"] and fp16["loss_scale"] == 0:  # only dynamic scaling needs them (precision_config.py:180-193)
        if fp16["loss_scale_window"] <= 0:
            raise DeepSpeedConfigError("fp16.loss_scale_window must be > 0 when dynamic loss scaling is enabled "
                                       "(loss_scale=0)")
        if fp16["min_loss_scale"] <= 0:
            raise DeepSpeedConfigError("fp16.min_loss_scale must be > 0 when dynamic loss scaling is enabled "
                                       "(loss_scale=0)")
    if values["optimizer"] is not None and "type" not in values["optimizer"]:
        raise DeepSpeedConfigError("the optimizer section needs a \"type\" (e.g. \"Adam\", \"AdamW\", \"SGD\")")
    if values["scheduler"] is not None and "type" not in values["scheduler"]:
        raise DeepSpeedConfigError("the scheduler section needs a \"type\" (e.g. \"WarmupLR\")")
    tb, mb, gas = _batch(values, world_size)
    values.update(train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas)
    return DSConfig(
        raw=raw, train_batch_size=tb, train_micro_batch_size_per_gpu=mb, gradient_accumulation_steps=gas,
        gradient_clipping=float(values["gradient_clipping"]), zero_stage=values["zero_optimization.stage"],
        reduce_bucket_size=values["zero_optimization.reduce_bucket_size"], optimizer=values["optimizer"],
        scheduler=values["scheduler"], fp16=fp16, bf16_enabled=values["bf16.enabled"],
        zero_allow_untested_optimizer=values["zero_allow_untested_optimizer"],
        dataloader_drop_last=values["dataloader_drop_last"], steps_per_print=values["steps_per_print"],
        wall_clock_breakdown=values["wall_clock_breakdown"], values=values, ds_only=ds_only)
