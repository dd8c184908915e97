"""The typed error family: every error unidist raises on purpose is a ``UnidistError``.

Messages say what was wrong and how to fix it, so a user on a cluster can act on the first line.
"""

from __future__ import annotations

__all__ = [
    "BackendUnavailableError",
    "CheckpointCorruptError",
    "CheckpointError",
    "CheckpointMismatchError",
    "CheckpointMissingError",
    "CollectiveMismatchError",
    "CollectiveTimeoutError",
    "ConfigError",
    "EngineMismatchError",
    "HostsError",
    "InvalidArgumentError",
    "LaunchEnvironmentError",
    "MessageMismatchError",
    "NotInitializedError",
    "PeerLostError",
    "UnidistError",
]


class UnidistError(Exception):
    """Base class, so callers can catch everything unidist raises deliberately."""


class BackendUnavailableError(UnidistError, ImportError):
    """The selected backend's engine package is not installed; the message gives the pip command."""


class NotInitializedError(UnidistError, RuntimeError):
    """A call needs a started Manager and there is none (or this one is not started)."""


class LaunchEnvironmentError(UnidistError, RuntimeError):
    """The launcher's variables are inconsistent; the message names the variables seen."""


class ConfigError(UnidistError, ValueError):
    """A ``UNIDIST_*`` variable or a Config field has a bad value; names variable, value, allowed values."""


class HostsError(UnidistError, ValueError):
    """A host list (``--hosts``, a hostfile, a Slurm allocation) cannot start a job, or the backend's launcher
    has no multi-host form; the message says what was read and how to write it."""


class InvalidArgumentError(UnidistError, ValueError, TypeError):
    """A collective got an input it cannot handle (wrong kind, dtype, op, root or splits)."""


class CollectiveMismatchError(UnidistError, RuntimeError):
    """Ranks entered different collectives; the message says what each rank called."""


class MessageMismatchError(CollectiveMismatchError):
    """A ``send`` and its ``recv`` disagree on dtype or size (or an engine refused a message that did not fit):
    raised by default on the receiver after the call (and, on MPI, on the sender at its next barrier or when it
    leaves its ``with`` block); names the call, both sides' sizes, and points to ``UNIDIST_CHECK_COLLECTIVES=1``."""


class EngineMismatchError(CollectiveMismatchError):
    """An engine's own error that means the ranks disagree (MPI's message truncation, Horovod's "Mismatched
    ..."), wrapped: names the call and suggests ``UNIDIST_CHECK_COLLECTIVES=1``; the engine's words follow."""


class PeerLostError(UnidistError, ConnectionError, RuntimeError):
    """A gloo peer closed its connection during a call ("Connection reset by peer"): it died, or it raised on a
    mismatched call and left. Names the call and suggests ``UNIDIST_CHECK_COLLECTIVES=1``. A RuntimeError too, as
    the engine's own error was."""


class CollectiveTimeoutError(UnidistError, TimeoutError):
    """A collective did not complete within ``UNIDIST_TIMEOUT`` seconds."""


class CheckpointError(UnidistError, RuntimeError):
    """A checkpoint cannot be saved or loaded; the message names the path."""


class CheckpointMismatchError(CheckpointError, ValueError):
    """The checkpoint does not fit the model or optimizer: names the first mismatching parameter. Nothing
    was modified, except when the values loaded disagree with the digests the writer recorded (the message
    says so: load another checkpoint before training)."""


class CheckpointCorruptError(CheckpointError):
    """A checkpoint file is missing, truncated or altered (size or checksum differ): names the file. Nothing
    was modified."""


class CheckpointMissingError(CheckpointCorruptError):
    """Files the manifest lists are on no host of this job (a checkpoint saved on hosts without a shared
    filesystem, resumed where some hosts' directories are absent): names the files, the ranks and hosts that
    wrote them and where, and how to bring them together. Nothing was modified."""
