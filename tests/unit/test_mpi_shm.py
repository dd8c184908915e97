"""MPICH's segments a killed job left are removed before MPI starts; a live job's or a starting job's are not."""

from __future__ import annotations

import mmap
import os
import time
from pathlib import Path

from unidist.engines.mpi import shm as mpi_shm


def test_removes_only_old_unmapped_mpich_files(tmp_path: Path) -> None:
    old = time.time() - 3600
    for name in ("mpich_shm_dead_0", "mpich_vci_dead_1", "mpich_shm_live_0", "other_file"):
        (tmp_path / name).write_bytes(b"\0" * 4096)
        os.utime(tmp_path / name, (old, old))
    (tmp_path / "mpich_shm_new_0").write_bytes(b"\0" * 4096)  # created after this process started: a job starting
    with open(tmp_path / "mpich_shm_live_0", "r+b") as f, mmap.mmap(f.fileno(), 4096):  # a running job maps it
        removed = mpi_shm.remove_stale(tmp_path)
    assert sorted(removed) == ["mpich_shm_dead_0", "mpich_vci_dead_1"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["mpich_shm_live_0", "mpich_shm_new_0", "other_file"]


def test_nothing_to_do_is_cheap(tmp_path: Path) -> None:
    assert mpi_shm.remove_stale(tmp_path) == [] and mpi_shm.remove_stale(tmp_path / "missing") == []
