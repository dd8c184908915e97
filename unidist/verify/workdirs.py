"""Each launch in a working directory of its own, so that launches cannot see each other's files.

A script that resumes from its own checkpoint directory (``--checkpoint-dir ckpt``, or a path written in the
script) would otherwise resume, in the second launch, what the first one wrote: verify would compare a resumed
run with a fresh one and blame the data. So each launch (the one-process run and its rounding re-runs included)
starts in ``.unidist-verify/<id>/<label>/`` under the current directory, on the file system the current directory
is on (the one several hosts share, where a cluster launch starts its ranks in the same directory), and:

- every entry of the current directory is there as a symbolic link, so the script reads what it read before
  (``data/``, ``config.json``), and what it creates anew is its own;
- the script's path, and each argument that climbs out of the current directory (``--data ../data``,
  ``--config=../cfg.json``), are made absolute.

What the script writes into a directory that existed before verify started is still shared: a checkpoint loaded
through ``mgr.load_checkpoint`` is reported (the fingerprint records it), with the launch that wrote it. The
directories are removed when verify ends, unless it is asked to keep them.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterable, Sequence
from pathlib import Path

__all__ = ["WORK_DIR", "Workdirs", "absolute_args"]

WORK_DIR = ".unidist-verify"
_MAX_LINKS = 10_000  # a current directory with more entries is linked no further (each link is one syscall)


def absolute_args(args: Sequence[str], cwd: Path) -> list[str]:
    """``args`` with every word that climbs out of ``cwd`` (``../data``, or ``--data=../data``) made absolute:
    from a working directory two levels down it would name another place. Other relative paths need nothing: the
    working directory links every entry of ``cwd`` (and a word that only happens to name a file stays as it is)."""
    out = []
    for word in args:
        head, sep, tail = word.partition("=") if word.startswith("-") and "=" in word else ("", "", word)
        if tail == ".." or tail.startswith("../"):
            tail = os.path.normpath(cwd / tail)
        out.append(f"{head}{sep}{tail}")
    return out


class Workdirs:
    """The launches' working directories under ``cwd`` (or ``fallback`` where ``cwd`` is not writable).

    Args:
        cwd: the directory verify was started in.
        fallback: where to make them if ``cwd`` cannot hold them (verify's output directory).
        keep: leave them in place at ``close()``.
    """

    def __init__(self, cwd: Path, fallback: Path, keep: bool = False) -> None:
        self.cwd, self.keep = cwd, keep
        try:
            (cwd / WORK_DIR).mkdir(exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="", dir=cwd / WORK_DIR))
        except OSError:
            fallback.mkdir(parents=True, exist_ok=True)
            self.root = Path(tempfile.mkdtemp(prefix="work-", dir=fallback))
        self._skip = {WORK_DIR, *self._inside(fallback)}

    def _inside(self, path: Path) -> Iterable[str]:
        """The entry of ``cwd`` that holds ``path``, if any (verify's output directory must not be linked into
        the working directories it contains)."""
        with contextlib.suppress(ValueError):
            rel = path.resolve().relative_to(self.cwd.resolve())
            if rel.parts:
                yield rel.parts[0]

    def make(self, label: str) -> Path:
        """A fresh working directory for the launch ``label``, the current directory's entries linked into it."""
        where = self.root / label
        if where.exists():
            shutil.rmtree(where)
        where.mkdir(parents=True)
        with os.scandir(self.cwd) as entries:
            for n, entry in enumerate(entries):
                if n >= _MAX_LINKS:
                    break
                if entry.name not in self._skip:
                    with contextlib.suppress(OSError):
                        (where / entry.name).symlink_to(Path(entry.path).absolute())
        return where

    def close(self) -> None:
        """Remove the working directories (symbolic links are removed, never followed), unless kept."""
        if self.keep:
            return
        shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(OSError):
            (self.cwd / WORK_DIR).rmdir()  # only when no other verify is using it
