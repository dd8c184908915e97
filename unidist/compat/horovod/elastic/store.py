"""Where ``hvd.elastic`` commits go on disk, and writing and reading them with unidist checkpoints.

A commit is a unidist checkpoint (``Manager.save_checkpoint``: atomic, checksummed, loadable at any world
size) named ``commit-<seq>`` in the job's directory, the newest two kept, and ``latest.json`` beside them naming
the newest (sentinel.py reads it). Its ``extra`` holds the state's plain objects (epoch, batch, samplers'
positions, further optimizers) pickled into one byte tensor, so any picklable value works as in Horovod's
``ObjectState`` (the directory is the user's own: 0700 by default).

The job's directory is ``<root>/<job>``. The root: ``UNIDIST_ELASTIC_DIR``, else ``<tempdir>/unidist-elastic-<uid>``
(a job spanning hosts must set it to a directory every host shares: the default is refused there). The job:
``UNIDIST_ELASTIC_JOB``, else the script's name and a hash of the working directory, the script's path and its
arguments: neither the world size nor the launcher, so the same command re-run at another ``-n`` or under
another launcher resumes (the docs promise a resume at any world size). Rank 0 decides and broadcasts it, so
every rank agrees even where argv differs (the deepspeed launcher's ``--local_rank=N``). While a job runs, rank 0
holds a lock in its directory, so a second job of the same name (the same command started twice) is refused
rather than resuming the other's commits.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import pickle
import shutil
import socket
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import unidist
from unidist.checkpoint import latest_checkpoint
from unidist.compat.horovod.elastic.sentinel import LATEST
from unidist.config import Config
from unidist.errors import CheckpointError, LaunchEnvironmentError

__all__ = ["CommitStore", "commit_directory", "job_name"]

_KEY = "hvd_elastic"
_FORMAT = 1
_LOCK = ".lock"
# UNIDIST_ELASTIC_COMMIT_SECONDS=auto: a commit is written when the time since the last write is at least this many
# times what that write took, so writing costs at most a tenth of the job's time (the default, 0, writes every
# commit: a restart resumes from the last one, as Horovod's does, whatever a write costs)
_AUTO_FACTOR = 9.0
# with a fixed interval, write costs worth a word: above this share of the time between writes, once at least this
# many writes took at least this many seconds in all (a short job's few writes are not worth one)
_COSTLY_SHARE, _COSTLY_AFTER, _COSTLY_SECONDS = 0.25, 3, 2.0


def job_name(config: Config, cwd: str | None = None, argv: list[str] | None = None) -> str:
    """``UNIDIST_ELASTIC_JOB``, else ``<script>-<hash of the working directory, the script and its arguments>``."""
    if config.elastic_job is not None:
        return config.elastic_job
    args = unidist.script_args() if argv is None else argv
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "<interactive>"
    text = "\0".join([os.getcwd() if cwd is None else cwd, script, *args])
    return f"{Path(script).stem[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}"


def _root(config: Config) -> Path:
    if config.elastic_dir is not None:
        return Path(config.elastic_dir).absolute()
    uid = os.getuid() if hasattr(os, "getuid") else 0
    return Path(tempfile.gettempdir()) / f"unidist-elastic-{uid}"


def commit_directory(mgr: Any, config: Config | None = None) -> Path:
    """This job's commit directory as rank 0 sees it (call on every rank: it is broadcast)."""
    cfg = config if config is not None else Config.from_env()
    where = str(_root(cfg) / job_name(cfg)) if mgr.rank == 0 else None
    shared: str = mgr.broadcast_object(where)
    if cfg.elastic_dir is None and mgr.local_size != mgr.size:
        raise LaunchEnvironmentError(
            f"hvd.elastic: this job spans hosts ({mgr.size} ranks, {mgr.local_size} on this one) and its commits "
            f"would go to each host's temp dir ({shared}); set UNIDIST_ELASTIC_DIR to a directory every host "
            "shares (commits are written by all ranks and read by all)")
    return Path(shared)


def _lock(directory: Path) -> tuple[int | None, str | None]:
    """Rank 0's lock on the job directory: (its file descriptor, None), or (None, why another job holds it). A file
    system without locks (some network ones) gets no lock and no refusal."""
    fd = os.open(directory / _LOCK, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        owner = ""
        with contextlib.suppress(OSError):
            owner = os.pread(fd, 512, 0).decode(errors="replace").strip()
        os.close(fd)
        return None, owner or "another process"
    except OSError:
        os.close(fd)
        return None, None
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"rank 0 is pid {os.getpid()} on host {socket.gethostname()}, since "
                  f"{time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)
    return fd, None


class CommitStore:
    """One job's commits: write, find, read, and remove them when the job's training function returns."""

    def __init__(self, mgr: Any, directory: Path, min_seconds: float | None, named: bool = False,
                 lock: int | None = None) -> None:
        self.mgr = mgr
        self.directory = directory
        self.job = directory.name
        self.named = named  # UNIDIST_ELASTIC_JOB gave the name (a rerun must set it again)
        self.min_seconds = min_seconds
        self.seq = 0
        self.last_write = -float("inf")  # rank 0's clock: the first commit is always written
        self.last_cost = 0.0  # seconds the last write took (rank 0's)
        self._skipping_said = False
        self.last_path: Path | None = None
        self.last_objects: dict[str, Any] = {}
        self._lock = lock  # rank 0's: released when the process ends, however it ends
        self._costs: list[tuple[float, float]] | None = []  # rank 0's (start, seconds) of each write; None: warned

    @classmethod
    def open(cls, mgr: Any) -> CommitStore:
        """The store of the running job; every rank calls it (one broadcast)."""
        cfg = Config.from_env()
        directory = commit_directory(mgr, cfg)
        problem: tuple[bool, str] | None = None  # (another job holds it, the message)
        lock: int | None = None
        if mgr.rank == 0:
            try:
                if cfg.elastic_dir is None:
                    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
                lock, owner = _lock(directory)
                if owner is not None:
                    problem = (True, f"hvd.elastic: another job named {directory.name!r} is running ({owner}) and "
                                     f"holds {directory}: give each job running at once its own "
                                     "UNIDIST_ELASTIC_JOB=NAME (the default name comes from the working directory, "
                                     "the script and its arguments)")
            except OSError as err:
                problem = (False, f"hvd.elastic: cannot create the commit directory {directory}: {err} (set "
                                  "UNIDIST_ELASTIC_DIR to a writable directory)")
        problem = mgr.broadcast_object(problem)
        if problem is not None:
            raise (LaunchEnvironmentError if problem[0] else CheckpointError)(problem[1])
        return cls(mgr, directory, cfg.elastic_commit_seconds, named=cfg.elastic_job is not None, lock=lock)

    def latest(self) -> Path | None:
        """The newest complete commit, as rank 0 finds it (every rank calls)."""
        found = latest_checkpoint(self.directory) if self.mgr.rank == 0 else None
        path: str | None = self.mgr.broadcast_object(None if found is None else str(found))
        return None if path is None else Path(path)

    def due(self) -> bool:
        """Rank 0's view: should this commit be written? With ``UNIDIST_ELASTIC_COMMIT_SECONDS=N``: N seconds
        passed since the last write; with ``auto``: nine times what the last write took (said once, when it first
        leaves a commit unwritten)."""
        since = time.monotonic() - self.last_write
        if self.min_seconds is not None:
            return since >= self.min_seconds
        if since >= _AUTO_FACTOR * self.last_cost:
            return True
        if not self._skipping_said:
            self._skipping_said = True
            print(f"hvd.elastic: a commit takes {self.last_cost:.2f} s to write here, so one is written at most every "
                  f"{_AUTO_FACTOR * self.last_cost:.2f} s (writes kept under a tenth of the time; a restart redoes "
                  "the batches since the last written one); UNIDIST_ELASTIC_COMMIT_SECONDS=0 writes every "
                  "state.commit()", file=sys.stderr, flush=True)
        return False

    def write(self, model: torch.nn.Module, optimizer: Any, objects: dict[str, Any]) -> Path:
        """Save one commit on every rank (collective); the newest two stay."""
        self.seq += 1
        try:
            blob = pickle.dumps(objects, protocol=pickle.HIGHEST_PROTOCOL)
        except (pickle.PicklingError, TypeError, AttributeError) as err:
            raise CheckpointError(f"hvd.elastic: state.commit() cannot pickle the state's objects "
                                  f"({', '.join(objects)}): {err}") from err
        extra = {_KEY: {"format": _FORMAT, "seq": self.seq,
                        "objects": torch.frombuffer(bytearray(blob), dtype=torch.uint8)}}
        began = time.monotonic()
        path = Path(self.mgr.save_checkpoint(self.directory / f"commit-{self.seq:09d}", model, optimizer, keep=2,
                                             **extra))
        self.last_write = time.monotonic()
        self.last_cost = self.last_write - began
        self.last_path, self.last_objects = path, objects
        if self.mgr.rank == 0:
            self._record(path, objects)
            self._weigh(began, self.last_write - began)
        return path

    def _record(self, path: Path, objects: dict[str, Any]) -> None:
        """Rank 0 names the newest commit in ``latest.json`` (atomically): what a rerun will resume from."""
        latest = {"commit": path.name, "seq": self.seq, "size": self.mgr.size, "launcher": self.mgr.launch.launcher,
                  "time": time.time(), "shown": shown(objects)}
        tmp = self.directory / f".{LATEST}.tmp"
        tmp.write_text(json.dumps(latest))
        os.replace(tmp, self.directory / LATEST)

    def _weigh(self, began: float, seconds: float) -> None:
        """Say once when writing commits takes a large share of the job's time, and what to do about it (``auto``
        keeps the share small itself)."""
        if self._costs is None or self.min_seconds is None:
            return
        self._costs.append((began, seconds))
        if len(self._costs) <= _COSTLY_AFTER:
            return
        span = began + seconds - self._costs[0][0]
        spent = sum(s for _, s in self._costs)
        if span > 0 and spent / span > _COSTLY_SHARE and spent >= _COSTLY_SECONDS:
            every = (self._costs[-1][0] - self._costs[0][0]) / (len(self._costs) - 1)
            each = spent / len(self._costs)
            print(f"hvd.elastic: writing commits takes {100 * spent / span:.0f}% of this job's time ({each:.2f} s a "
                  f"write, one every {every:.2f} s): call state.commit() less often, or set "
                  "UNIDIST_ELASTIC_COMMIT_SECONDS=N to write at most one every N seconds (a restart then redoes up "
                  "to N seconds of training; auto: writes kept under a tenth of the time)", file=sys.stderr,
                  flush=True)
            self._costs = None

    def read(self, path: Path, model: torch.nn.Module, optimizer: Any) -> dict[str, Any]:
        """Load commit ``path`` into ``model``/``optimizer`` on every rank; return its objects."""
        extra = self.mgr.load_checkpoint(path, model, optimizer)
        saved = extra.get(_KEY)
        if not isinstance(saved, dict) or saved.get("format") != _FORMAT:
            raise CheckpointError(f"{path} is a checkpoint but not an hvd.elastic commit (no {_KEY!r} entry of "
                                  f"format {_FORMAT}); point UNIDIST_ELASTIC_DIR at a directory of its own")
        self.seq = int(saved["seq"])
        try:
            objects: dict[str, Any] = pickle.loads(saved["objects"].numpy().tobytes())  # our own 0700 directory's file
        except Exception as err:  # a class renamed since the commit was written, say
            raise CheckpointError(f"hvd.elastic: the objects in {path} cannot be unpickled here: {err!r}") from err
        self.last_path, self.last_objects = path, objects
        return objects

    def remove(self) -> None:
        """The training function returned on every rank: its commits are no longer needed (rank 0 deletes them
        and the job's directory, after everyone is past the last read), and the next run starts afresh."""
        self.mgr.barrier()
        if self.mgr.rank != 0:
            return
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            if child.name.lstrip(".").startswith("commit-"):  # ours only: UNIDIST_ELASTIC_DIR may hold more
                shutil.rmtree(child, ignore_errors=True)
        for name in (LATEST, _LOCK):
            with contextlib.suppress(OSError):
                (self.directory / name).unlink()
        self.close()
        with contextlib.suppress(OSError):
            self.directory.rmdir()  # empty unless the user put more there

    def close(self) -> None:
        """Release rank 0's lock (the process's end does too, however it ends)."""
        if self._lock is not None:
            os.close(self._lock)
            self._lock = None


def shown(objects: dict[str, Any]) -> dict[str, Any]:
    """The state's plain numbers and strings (epoch, batch), as messages show a commit."""
    plain = objects.get("objects", {})
    return {k: v for k, v in plain.items() if isinstance(v, (int, float, str)) and not isinstance(v, bool)} \
        if isinstance(plain, dict) else {}
