"""Every ``UNIDIST_*`` variable, parsed strictly in this one place.

A bad value is a ConfigError naming the variable, the value and what is allowed. Unknown ``UNIDIST_*``
names only warn: Modin's unrelated ``unidist`` package reads variables with the same prefix.
"""

from __future__ import annotations

import difflib
import logging
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from unidist.errors import ConfigError
from unidist.precisions import PRECISIONS

__all__ = ["COMPRESSIONS", "ENV_VARS", "PRECISIONS", "RANDOM_MODES", "Config"]

COMPRESSIONS = ("none", "fp16", "bf16")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
_TRUE = ("1", "true", "yes", "on")
_FALSE = ("0", "false", "no", "off", "")
_log = logging.getLogger("unidist")


# Engines turn the timeout into C integers of milliseconds (torch's timedelta, MPI polling): 30 days is far
# beyond any real collective and far below where they overflow.
MAX_TIMEOUT = 30 * 24 * 3600.0
_TIMEOUT_ALLOWED = f"a positive number of seconds up to {MAX_TIMEOUT:.0f} (30 days)"


_STALL_ALLOWED = f"a number of seconds up to {MAX_TIMEOUT:.0f}; 0 turns the stall inspector off"
_JOB_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")  # a directory name on any file system
_JOB_ALLOWED = "a name of up to 64 letters, digits, '.', '_' or '-', starting with a letter or digit"
_COMMIT_SECONDS_ALLOWED = f"auto, or a number of seconds from 0 (every commit) up to {MAX_TIMEOUT:.0f}"


_EVENTS_ALLOWED = "a positive whole number of events per rank"
_SEED_ALLOWED = "a whole number: a seed, 0 for none"
_STEP_ALLOWED = "a whole number of optimizer steps, 0 for none"
# UNIDIST_FINGERPRINT_RANDOM: random ops as written and uncounted, counted, or dropout off (train/random_ops.py)
RANDOM_MODES = ("keep", "count", "off")


def _env_name(field_name: str) -> str:
    return "UNIDIST_" + field_name.upper()


@dataclass(frozen=True)
class Config:
    """Run-time settings; build it directly, or from the environment with :meth:`from_env`."""

    backend: str | None = None
    timeout: float = 1800.0
    zero_stage: int = 0
    bucket_mb: float = 25.0
    compression: str = "none"
    # True: every collective compared across ranks (and send/recv handshake); None (default): one collective in K,
    # K adaptive (comm/check.py); False: none. Point-to-point sizes are guarded in every mode (comm/mismatch.py).
    check_collectives: bool | None = None
    log_level: str = "WARNING"
    device: str = "auto"
    deepspeed_config: str | None = None
    precision: str = "32"
    # hvd.elastic (unidist/compat/horovod/elastic): where commits go (None: a per-job directory under the
    # system temp dir), the job's name there (None: one made from the working directory, the script and its
    # arguments) and the least seconds between two commits written to disk (0: every commit, as Horovod resumes
    # from the last; None, "auto": one while writing costs under a tenth of the time, store.py)
    elastic_dir: str | None = None
    elastic_job: str | None = None
    elastic_commit_seconds: float | None = 0.0
    # the timeline (comm/timeline.py): where rank 0 writes the merged Chrome trace (None: off, nothing recorded)
    # and the most events a rank keeps (a bound on memory: ~300 bytes an event; later ones are counted, dropped)
    timeline: str | None = None
    timeline_events: int = 200_000
    # the stall inspector (comm/stall.py): a wait on peers longer than this is explained (0: off)
    stall_warning: float = 60.0
    # the training fingerprint (train/fingerprint.py): where rank 0 writes one line per optimizer step (None: off);
    # ``unidist verify`` sets it for each launch it runs
    fingerprint: str | None = None
    # what a fingerprinting run does with random ops in the prepared model's training (train/random_ops.py): "keep"
    # them as written, uncounted; "count" them (site and op, in the fingerprint); "off": count them and run dropout
    # as the identity, so one process and N ranks compute the same thing (unidist verify's default)
    fingerprint_random: str = "keep"
    # a seed (0: off): every module output and parameter gradient moved by a rounding error of its own dtype, drawn
    # from this seed (train/rounding.py): unidist verify's runs that measure how far rounding alone moves a script
    fingerprint_perturb: int = 0
    # the last step (0: off) whose lines carry per-module probes (train/probes.py): every module's output and input
    # gradient, every parameter's gradient before the reduction; unidist verify --locate
    fingerprint_locate: int = 0
    unknown: tuple[str, ...] = field(default=(), compare=False, repr=False)
    # the fields the environment set (not defaults): an explicit prepare() argument that disagrees is an error
    from_environment: frozenset[str] = field(default=frozenset(), compare=False, repr=False)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ConfigError:
            return ConfigError(f"{_env_name(name)}={value!r} is not valid; allowed: {allowed}")

        if self.backend is not None and not re.fullmatch(r"[a-z][a-z0-9_]*", self.backend):
            raise bad("backend", self.backend, "a registered backend's name: lowercase letters, digits and _ (`unidist "
                      "info` lists them)")
        if not 0 < self.timeout <= MAX_TIMEOUT:  # also refuses nan and inf
            raise bad("timeout", self.timeout, _TIMEOUT_ALLOWED)
        if self.zero_stage not in (0, 1, 2, 3):
            raise bad("zero_stage", self.zero_stage, "0, 1, 2 or 3")
        if not self.bucket_mb > 0:
            raise bad("bucket_mb", self.bucket_mb, "a positive number of MiB")
        if self.compression not in COMPRESSIONS:
            raise bad("compression", self.compression, ", ".join(COMPRESSIONS))
        if self.log_level not in LOG_LEVELS:
            raise bad("log_level", self.log_level, ", ".join(LOG_LEVELS))
        if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", self.device):
            raise bad("device", self.device, "auto, cpu, cuda or cuda:N")
        if self.precision not in PRECISIONS:
            raise bad("precision", self.precision, ", ".join(PRECISIONS))
        if self.elastic_job is not None and not _JOB_NAME.fullmatch(self.elastic_job):
            raise bad("elastic_job", self.elastic_job, _JOB_ALLOWED)
        if self.elastic_commit_seconds is not None and not 0 <= self.elastic_commit_seconds <= MAX_TIMEOUT:
            raise bad("elastic_commit_seconds", self.elastic_commit_seconds, _COMMIT_SECONDS_ALLOWED)
        if not self.timeline_events > 0:
            raise bad("timeline_events", self.timeline_events, _EVENTS_ALLOWED)
        if not 0 <= self.stall_warning <= MAX_TIMEOUT:
            raise bad("stall_warning", self.stall_warning, _STALL_ALLOWED)
        if self.fingerprint_random not in RANDOM_MODES:
            raise bad("fingerprint_random", self.fingerprint_random, ", ".join(RANDOM_MODES))
        if self.fingerprint_perturb < 0:
            raise bad("fingerprint_perturb", self.fingerprint_perturb, _SEED_ALLOWED)
        if self.fingerprint_locate < 0:
            raise bad("fingerprint_locate", self.fingerprint_locate, _STEP_ALLOWED)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None) -> Config:
        """Parse ``UNIDIST_*`` from ``environ`` (default ``os.environ``); unset variables keep defaults."""
        env = os.environ if environ is None else environ
        known = {_env_name(f.name): f.name for f in fields(cls) if f.name in _PARSERS}
        values: dict[str, object] = {}
        for var, name in known.items():
            raw = env.get(var)
            if raw is None:
                continue
            values[name] = _PARSERS[name](var, raw.strip())
        unknown = tuple(sorted(k for k in env if k.startswith("UNIDIST_") and k not in known))
        for var in unknown:
            hint = difflib.get_close_matches(var, known, n=1)
            _log.warning("ignoring unknown variable %s%s", var, f" (did you mean {hint[0]}?)" if hint else "")
        return cls(unknown=unknown, from_environment=frozenset(values), **values)  # type: ignore[arg-type]


def _number(kind: type[int] | type[float], allowed: str,
            ok: Callable[[float], bool]) -> Callable[[str, str], int | float]:
    def parse(var: str, raw: str) -> int | float:
        try:
            value = kind(raw)
        except ValueError:
            value = None
        if value is None or not ok(value):
            raise ConfigError(f"{var}={raw!r} is not valid; allowed: {allowed}")
        return value
    return parse


def _auto(parse: Callable[[str, str], int | float]) -> Callable[[str, str], int | float | None]:
    """``auto`` is None, the setting's own rule; anything else as ``parse`` reads it."""
    def parse_auto(var: str, raw: str) -> int | float | None:
        return None if raw.strip().lower() == "auto" else parse(var, raw)
    return parse_auto


def _choice(choices: tuple[str, ...], *, lower: bool = True) -> Callable[[str, str], str]:
    def parse(var: str, raw: str) -> str:
        value = raw.lower() if lower else raw.upper()
        if value not in choices:
            raise ConfigError(f"{var}={raw!r} is not valid; allowed: {', '.join(choices)}")
        return value
    return parse


def _flag(var: str, raw: str) -> bool:
    if raw.lower() in _TRUE:
        return True
    if raw.lower() in _FALSE:
        return False
    raise ConfigError(f"{var}={raw!r} is not valid; allowed: 1/0, true/false, yes/no, on/off")


def _check_mode(var: str, raw: str) -> bool | None:
    if raw.lower() in ("", "auto"):
        return None
    try:
        return _flag(var, raw)
    except ConfigError:
        raise ConfigError(f"{var}={raw!r} is not valid; allowed: 1 (every call), auto (one call in K, the "
                          "default), 0 (none)") from None


def _backend(var: str, raw: str) -> str | None:
    return raw.lower() or None


def _device(var: str, raw: str) -> str:
    value = raw.lower() or "auto"
    if not re.fullmatch(r"auto|cpu|cuda(:\d+)?", value):
        raise ConfigError(f"{var}={raw!r} is not valid; allowed: auto, cpu, cuda or cuda:N")
    return value


def _path(var: str, raw: str) -> str | None:
    return raw or None


def _job(var: str, raw: str) -> str | None:
    if raw and not _JOB_NAME.fullmatch(raw):
        raise ConfigError(f"{var}={raw!r} is not valid; allowed: {_JOB_ALLOWED}")
    return raw or None


_PARSERS: dict[str, Callable[[str, str], Any]] = {
    "backend": _backend,
    "timeout": _number(float, _TIMEOUT_ALLOWED, lambda v: 0 < v <= MAX_TIMEOUT),
    "zero_stage": _number(int, "0, 1, 2 or 3", lambda v: v in (0, 1, 2, 3)),
    "bucket_mb": _number(float, "a positive number of MiB", lambda v: v > 0),
    "compression": _choice(COMPRESSIONS),
    "check_collectives": _check_mode,
    "log_level": _choice(LOG_LEVELS, lower=False),
    "device": _device,
    "deepspeed_config": _path,
    "precision": _choice(PRECISIONS),
    "elastic_dir": _path,
    "elastic_job": _job,
    "elastic_commit_seconds": _auto(_number(float, _COMMIT_SECONDS_ALLOWED, lambda v: 0 <= v <= MAX_TIMEOUT)),
    "timeline": _path,
    "timeline_events": _number(int, _EVENTS_ALLOWED, lambda v: v > 0),
    "stall_warning": _number(float, _STALL_ALLOWED, lambda v: 0 <= v <= MAX_TIMEOUT),
    "fingerprint": _path,
    "fingerprint_random": _choice(RANDOM_MODES),
    "fingerprint_perturb": _number(int, _SEED_ALLOWED, lambda v: v >= 0),
    "fingerprint_locate": _number(int, _STEP_ALLOWED, lambda v: v >= 0),
}

ENV_VARS: tuple[str, ...] = tuple(_env_name(n) for n in _PARSERS)
