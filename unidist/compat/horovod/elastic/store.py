"""Where ``hvd.elastic`` commits go on disk, and writing and reading them with unidist checkpoints.

A commit is a unidist checkpoint (``Manager.save_checkpoint``: atomic, checksummed, loadable at any world
size) named ``commit-<seq>`` in the job's commit directory, the newest two kept. Its ``extra`` holds the
state's plain objects (epoch, batch, samplers' positions, further optimizers) pickled into one byte tensor,
so any picklable value works as in Horovod's ``ObjectState`` (the directory is the user's own: 0700 by default).

The directory: ``UNIDIST_ELASTIC_DIR`` if set, else ``<tempdir>/unidist-elastic-<uid>/<job key>``, where
the key is torchrun's rendezvous id (``TORCHELASTIC_RUN_ID``; the same across ``--max-restarts``) or else a
hash of the script's path, its arguments and the world size, so that re-running the same command finds it.
Rank 0 decides and broadcasts it, so every rank agrees even where argv differs (the deepspeed launcher's
``--local_rank=N``). A job spanning hosts needs a directory every host shares: the default is refused there.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

import unidist
from unidist.checkpoint import latest_checkpoint
from unidist.config import Config
from unidist.errors import CheckpointError, LaunchEnvironmentError

__all__ = ["CommitStore", "commit_directory"]

_KEY = "hvd_elastic"
_FORMAT = 1


def _job_key(mgr: Any) -> str:
    run_id = os.environ.get("TORCHELASTIC_RUN_ID", "")
    if run_id and run_id != "none":
        return "torchrun-" + "".join(c if c.isalnum() or c in "-_" else "_" for c in run_id)[:64]
    script = os.path.abspath(sys.argv[0]) if sys.argv and sys.argv[0] else "<interactive>"
    text = "\0".join([script, *unidist.script_args(), f"size={mgr.size}"])
    return f"{Path(script).stem[:40]}-{hashlib.sha256(text.encode()).hexdigest()[:16]}"


def commit_directory(mgr: Any, config: Config | None = None) -> Path:
    """This job's commit directory as rank 0 sees it (call on every rank: it is broadcast)."""
    cfg = config if config is not None else Config.from_env()
    where: str | None = None
    if mgr.rank == 0:
        if cfg.elastic_dir is not None:
            where = str(Path(cfg.elastic_dir).absolute())
        else:
            uid = os.getuid() if hasattr(os, "getuid") else 0
            where = str(Path(tempfile.gettempdir()) / f"unidist-elastic-{uid}" / _job_key(mgr))
    shared: str = mgr.broadcast_object(where)
    if cfg.elastic_dir is None and mgr.local_size != mgr.size:
        raise LaunchEnvironmentError(
            f"hvd.elastic: this job spans hosts ({mgr.size} ranks, {mgr.local_size} on this one) and its commits "
            f"would go to each host's temp dir ({shared}); set UNIDIST_ELASTIC_DIR to a directory every host "
            "shares (commits are written by all ranks and read by all)")
    return Path(shared)


class CommitStore:
    """One job's commits: write, find, read, and remove them when the job's training function returns."""

    def __init__(self, mgr: Any, directory: Path, min_seconds: float, own_directory: bool = False) -> None:
        self.mgr = mgr
        self.own_directory = own_directory  # the default per-job directory: removed with its last commit
        self.directory = directory
        self.min_seconds = min_seconds
        self.seq = 0
        self.last_write = -float("inf")  # rank 0's clock: the first commit is always written
        self.last_path: Path | None = None
        self.last_objects: dict[str, Any] = {}

    @classmethod
    def open(cls, mgr: Any) -> CommitStore:
        """The store of the running job; every rank calls it (one broadcast)."""
        cfg = Config.from_env()
        directory = commit_directory(mgr, cfg)
        problem: str | None = None
        if mgr.rank == 0:
            try:
                if cfg.elastic_dir is None:
                    directory.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
                directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            except OSError as err:
                problem = f"hvd.elastic: cannot create the commit directory {directory}: {err}"
        problem = mgr.broadcast_object(problem)
        if problem is not None:
            raise CheckpointError(problem + " (set UNIDIST_ELASTIC_DIR to a writable directory)")
        return cls(mgr, directory, cfg.elastic_commit_seconds, own_directory=cfg.elastic_dir is None)

    def latest(self) -> Path | None:
        """The newest complete commit, as rank 0 finds it (every rank calls)."""
        found = latest_checkpoint(self.directory) if self.mgr.rank == 0 else None
        path: str | None = self.mgr.broadcast_object(None if found is None else str(found))
        return None if path is None else Path(path)

    def due(self) -> bool:
        """Rank 0's view: has ``UNIDIST_ELASTIC_COMMIT_SECONDS`` passed since the last write?"""
        return time.monotonic() - self.last_write >= self.min_seconds

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
        path = self.mgr.save_checkpoint(self.directory / f"commit-{self.seq:09d}", model, optimizer, keep=2,
                                        **extra)
        self.last_write = time.monotonic()
        self.last_path, self.last_objects = path, objects
        return Path(path)

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
        """The training function returned on every rank: its commits are no longer needed (rank 0 deletes
        the directory, after everyone is past the last read)."""
        self.mgr.barrier()
        if self.mgr.rank != 0:
            return
        for child in self.directory.iterdir() if self.directory.is_dir() else ():
            if child.name.lstrip(".").startswith("commit-"):  # ours only: UNIDIST_ELASTIC_DIR may hold more
                shutil.rmtree(child, ignore_errors=True)
        if self.own_directory:
            shutil.rmtree(self.directory, ignore_errors=True)
