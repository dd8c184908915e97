"""The errors ``unidist.compat.deepspeed`` raises beyond unidist's own family: both are unidist errors, so
``except unidist.UnidistError`` catches them, and each is also the builtin a DeepSpeed script would expect."""

from __future__ import annotations

from unidist.errors import ConfigError, UnidistError

__all__ = ["DeepSpeedConfigError", "DeepSpeedUnsupportedError"]


class DeepSpeedConfigError(ConfigError):
    """A DeepSpeed config this layer refuses: an unknown key (with the closest known one), batch sizes that do not
    multiply out (DeepSpeed's own message), a value out of range. A ``ValueError`` (unidist's ConfigError)."""


class DeepSpeedUnsupportedError(UnidistError, NotImplementedError):
    """A DeepSpeed feature only DeepSpeed's engine has (offload, NVMe, MoE, pipeline, ZeRO++ ...), used on another
    backend. The message names the key or call and says to run under the ``deepspeed`` launcher or drop it.
    Raised when the feature is used, never when a module is imported."""
