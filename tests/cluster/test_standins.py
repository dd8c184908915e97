"""The stand-ins' own parsing, against what the real tools write and read (no cluster needed): Slurm host
lists and tasks-per-node, srun's block layout, pdsh's and ssh's command lines as DeepSpeed and horovodrun
spell them."""

from __future__ import annotations

import pytest
from agent import parse_ssh
from hostlist import compress, expand, tasks_per_node
from pdsh_standin import parse as parse_pdsh
from srun_standin import layout
from srun_standin import parse as parse_srun

from unidist.launch import slurm_first_host


@pytest.mark.parametrize(("spec", "hosts"), [("h[1-2]", ["h1", "h2"]), ("h[1-3,5],login", ["h1", "h2", "h3", "h5",
                                                                                                "login"]),
                                              ("n[08-10]", ["n08", "n09", "n10"]), ("h1", ["h1"])])
def test_host_lists_round_trip_and_agree_with_unidist(spec: str, hosts: list[str]) -> None:
    assert expand(spec) == hosts
    assert expand(compress(hosts)) == hosts
    assert slurm_first_host(compress(hosts)) == hosts[0]  # what a Slurm-launched rank takes as rank 0's host


def test_tasks_per_node_spelled_as_slurm_does() -> None:
    assert [tasks_per_node(c) for c in ([2, 2], [2, 2, 1], [3])] == ["2(x2)", "2(x2),1", "3"]


def test_srun_block_layout() -> None:
    assert layout(["h1", "h2"], 4, None) == [2, 2]
    assert layout(["h1", "h2"], 3, None) == [2, 1]  # the first nodes fuller, as Slurm's block distribution
    assert layout(["h1", "h2"], None, 2) == [2, 2]
    assert layout(["h1", "h2", "h3"], 2, None) == [1, 1]  # a node without a task is not in the step
    with pytest.raises(SystemExit):
        layout(["h1"], 3, 2)


def test_srun_options_as_hydra_and_users_write_them() -> None:
    assert parse_srun(["-N", "2", "-n", "2", "--input", "none", "proxy", "--proxy-id", "-1"]) == (
        {"nodes": "2", "ntasks": "2", "input": "none"}, ["proxy", "--proxy-id", "-1"])
    assert parse_srun(["--kill-on-bad-exit=1", "-N2", "python", "-u", "t.py"]) == (
        {"kill": "1", "nodes": "2"}, ["python", "-u", "t.py"])


def test_pdsh_command_line_of_deepspeeds_runner() -> None:
    opts, command = parse_pdsh(["-S", "-f", "1024", "-w", "h1,h2", "export", "A=1;", "cd", "/x;", "python", "-m",
                                "deepspeed.launcher.launch", "--node_rank=%n", "t.py"])
    assert opts == {"S": "", "f": "1024", "w": "h1,h2"}
    assert command == "export A=1; cd /x; python -m deepspeed.launcher.launch --node_rank=%n t.py"


def test_ssh_options_after_the_host_as_horovodrun_writes_them() -> None:
    argv = "-o PasswordAuthentication=no -o StrictHostKeyChecking=no h2 -o ConnectTimeout=10 true".split()
    assert parse_ssh(argv) == ("h2", "true")
    assert parse_ssh(["-x", "user@h1", "echo", "-n", "a"]) == ("h1", "echo -n a")
