"""Host lists: ``--hosts``, hostfiles in the launchers' formats, Slurm allocations, and every malformed input
raising HostsError with the fix in its message."""

from __future__ import annotations

from pathlib import Path

import pytest

from unidist.errors import HostsError, UnidistError
from unidist.hosts import (
    Host,
    expand_nodelist,
    format_hosts,
    hostfile_text,
    parse_hostfile,
    parse_hosts,
    read_hostfile,
    slurm_hosts,
    tasks_per_node,
)

H = Host


def test_parse_hosts() -> None:
    assert parse_hosts("h1:2,h2:2") == [H("h1", 2), H("h2", 2)]
    assert parse_hosts("node-1.cluster,10.0.0.2:4") == [H("node-1.cluster", 1), H("10.0.0.2", 4)]
    assert parse_hosts(" h1:1 , h2 ") == [H("h1", 1), H("h2", 1)]


@pytest.mark.parametrize(("spec", "says"), [
    ("h1:0", "h1 has 0 slots; give every host at least 1"),
    ("h1:x", "write host:slots,host:slots"),
    ("h1:2,,h2:2", "cannot read ''"),
    ("", "cannot read ''"),
    ("h1:2,h1:1", "lists h1 twice"),
    ("h!1:2", "'h!1' is not a host name"),
])
def test_parse_hosts_errors(spec: str, says: str) -> None:
    with pytest.raises(HostsError) as err:
        parse_hosts(spec)
    assert says in str(err.value) and isinstance(err.value, UnidistError)


def test_parse_hostfile_every_format_and_comments() -> None:
    text = """# mixed formats, as users copy them
h1:2            # mpich
h2 slots=4      # Open MPI / DeepSpeed
h3 slots=2 max_slots=8

h4
   # indented comment
"""
    assert parse_hostfile(text) == [H("h1", 2), H("h2", 4), H("h3", 2), H("h4", 1)]


@pytest.mark.parametrize(("text", "says"), [
    ("h1 slots=0\n", "line 1: h1 has 0 slots"),
    ("h1\nh2 cpus=2\n", "line 2: cannot read 'cpus=2'"),
    ("h1:2 slots=2\n", "line 1: cannot read 'h1:2 slots=2'"),
    ("h1:2:eth0\n", "line 1: cannot read"),
    ("# only comments\n\n", "names no host"),
    ("h1\nh1 slots=2\n", "lists h1 twice"),
])
def test_parse_hostfile_errors(text: str, says: str) -> None:
    with pytest.raises(HostsError) as err:
        parse_hostfile(text)
    assert says in str(err.value), err.value


def test_read_hostfile(tmp_path: Path) -> None:
    path = tmp_path / "hosts"
    path.write_text("a slots=2\nb slots=2\n")
    assert read_hostfile(path) == [H("a", 2), H("b", 2)]
    with pytest.raises(HostsError, match=r"cannot read hostfile .*missing.*No such file"):
        read_hostfile(tmp_path / "missing")
    path.write_text("a slots=two\n")
    with pytest.raises(HostsError, match=rf"hostfile '{path}' line 1"):
        read_hostfile(path)


def test_expand_nodelist() -> None:
    assert expand_nodelist("gpu[003-005,9],cpu1") == ["gpu003", "gpu004", "gpu005", "gpu9", "cpu1"]
    assert expand_nodelist("n1") == ["n1"]
    assert expand_nodelist("r[1-2]-n[08-10]") == ["r1-n08", "r1-n09", "r1-n10", "r2-n08", "r2-n09", "r2-n10"]
    for bad in ("", "gpu[1-x]", "gpu[1"):
        with pytest.raises(HostsError):
            expand_nodelist(bad)


def test_tasks_per_node() -> None:
    assert tasks_per_node("2(x3),1") == [2, 2, 2, 1]
    assert tasks_per_node("4") == [4]
    with pytest.raises(HostsError, match="2\\(x3\\),1"):
        tasks_per_node("2x3")


def test_slurm_hosts() -> None:
    job = {"SLURM_JOB_ID": "7", "SLURM_JOB_NODELIST": "n[01-03]"}
    assert slurm_hosts({**job, "SLURM_NTASKS_PER_NODE": "2"}) == [H("n01", 2), H("n02", 2), H("n03", 2)]
    assert slurm_hosts({**job, "SLURM_TASKS_PER_NODE": "4(x2),1"}) == [H("n01", 4), H("n02", 4), H("n03", 1)]
    assert slurm_hosts({"SLURM_JOB_NODELIST": "n1", "SLURM_NTASKS_PER_NODE": "2"}) is None  # no job
    assert slurm_hosts({}) is None
    with pytest.raises(HostsError, match="names 3 nodes but the tasks per node cover 2"):
        slurm_hosts({**job, "SLURM_TASKS_PER_NODE": "4(x2)"})


def test_formats_round_trip() -> None:
    hosts = [H("h1", 2), H("h2", 3)]
    assert format_hosts(hosts) == "h1:2,h2:3"
    assert parse_hosts(format_hosts(hosts)) == hosts
    assert hostfile_text(hosts, "slots") == "h1 slots=2\nh2 slots=3\n"
    assert hostfile_text(hosts, "mpich") == "h1:2\nh2:3\n"
    for style in ("slots", "mpich"):
        assert parse_hostfile(hostfile_text(hosts, style)) == hosts
