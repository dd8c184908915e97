"""Horovod's placement under srun without PMI, from the step's layout (engines/horovod/gloo.py), and the
layout itself from Slurm's variables (launch.slurm_step_hosts)."""

from __future__ import annotations

import pytest

from unidist.engines.horovod.gloo import layout
from unidist.errors import LaunchEnvironmentError
from unidist.launch import slurm_step_hosts


def test_block_placement_over_uneven_nodes() -> None:
    hosts = [("a", 2), ("b", 1), ("c", 2)]
    got = [layout(r, hosts) for r in range(5)]
    # (host, local rank, local size, cross rank, cross size): local rank 1 exists on a and c only
    assert got == [("a", 0, 2, 0, 3), ("a", 1, 2, 0, 2), ("b", 0, 1, 1, 3), ("c", 0, 2, 2, 3), ("c", 1, 2, 1, 2)]
    with pytest.raises(LaunchEnvironmentError, match="beyond"):
        layout(5, hosts)


def test_step_hosts_from_slurm_variables() -> None:
    env = {"SLURM_STEP_NODELIST": "n[01-02],x7", "SLURM_STEP_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "z"}
    assert slurm_step_hosts(env) == [("n01", 2), ("n02", 2), ("x7", 1)]
    with pytest.raises(LaunchEnvironmentError, match="start the job with srun"):
        slurm_step_hosts({})
    with pytest.raises(LaunchEnvironmentError, match="cover"):
        slurm_step_hosts({"SLURM_STEP_NODELIST": "n[1-3]", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"})
