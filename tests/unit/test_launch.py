"""Launch detection: the exact variable sets each launcher sets, and every way they can be wrong."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from unidist import LaunchEnvironmentError, LaunchInfo, detect
from unidist.launch import script_args, slurm_first_host, slurm_port
from unidist.train.preempt import slurm_job

CASES = {
    "nothing": ({}, LaunchInfo()),
    "torchrun": (
        {"TORCHELASTIC_RUN_ID": "none", "RANK": "3", "WORLD_SIZE": "4", "LOCAL_RANK": "1",
         "LOCAL_WORLD_SIZE": "2", "GROUP_RANK": "1", "ROLE_RANK": "3", "MASTER_ADDR": "10.0.0.1",
         "MASTER_PORT": "29500"},
        LaunchInfo(3, 4, 1, 2, 1, "10.0.0.1", 29500, "torchrun"),
    ),
    "horovodrun-gloo": (
        {"HOROVOD_RANK": "1", "HOROVOD_SIZE": "2", "HOROVOD_LOCAL_RANK": "1", "HOROVOD_LOCAL_SIZE": "2",
         "HOROVOD_CROSS_RANK": "0", "HOROVOD_CROSS_SIZE": "1", "HOROVOD_GLOO_RENDEZVOUS_ADDR": "127.0.0.1"},
        LaunchInfo(1, 2, 1, 2, 0, None, None, "horovodrun"),
    ),
    "deepspeed": (
        {"RANK": "5", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "LOCAL_SIZE": "4", "CROSS_RANK": "1",
         "CROSS_SIZE": "2", "MASTER_ADDR": "node1", "MASTER_PORT": "29500"},
        LaunchInfo(5, 8, 1, 4, 1, "node1", 29500, "deepspeed"),
    ),
    "openmpi": (
        {"OMPI_COMM_WORLD_RANK": "5", "OMPI_COMM_WORLD_SIZE": "8", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
         "OMPI_COMM_WORLD_LOCAL_SIZE": "4", "OMPI_COMM_WORLD_NODE_RANK": "1", "PMIX_RANK": "5"},
        LaunchInfo(5, 8, 1, 4, 1, None, None, "openmpi"),
    ),
    "mpich-hydra": (
        {"PMI_RANK": "1", "PMI_SIZE": "2", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2", "PMI_FD": "9",
         "PMI_HOSTNAME": "vm"},
        LaunchInfo(1, 2, 1, 2, 0, None, None, "mpich"),
    ),
    "intel-mpi-two-nodes": (
        {"PMI_RANK": "3", "PMI_SIZE": "4", "MPI_LOCALRANKID": "1", "MPI_LOCALNRANKS": "2"},
        LaunchInfo(3, 4, 1, 2, 1, None, None, "mpich"),
    ),
    "mvapich": (
        {"MV2_COMM_WORLD_RANK": "2", "MV2_COMM_WORLD_SIZE": "4", "MV2_COMM_WORLD_LOCAL_RANK": "0",
         "MV2_COMM_WORLD_LOCAL_SIZE": "2"},
        LaunchInfo(2, 4, 0, 2, 1, None, None, "mvapich"),
    ),
    "pmix-under-srun": (
        {"PMIX_RANK": "2", "PMIX_NAMESPACE": "slurm.pmix.1.0", "SLURM_STEP_NUM_TASKS": "4"},
        LaunchInfo(2, 4, 2, 4, 0, None, None, "pmix"),
    ),
    "srun": (
        {"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_STEP_NUM_TASKS": "8", "SLURM_LOCALID": "1",
         "SLURM_NODEID": "1", "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "4(x2)",
         "SLURM_STEP_NODELIST": "gpu[003-004]", "SLURM_JOB_ID": "77"},
        LaunchInfo(5, 8, 1, 4, 1, "gpu003", 15000 + 77 * 16, "slurm"),  # slurm_port: job 77, step 0
    ),
    "srun-uneven-nodes": (
        {"SLURM_PROCID": "4", "SLURM_NTASKS": "5", "SLURM_LOCALID": "0", "SLURM_NODEID": "2",
         "SLURM_STEP_ID": "1", "SLURM_TASKS_PER_NODE": "2(x2),1", "SLURM_JOB_NODELIST": "a1,b2"},
        LaunchInfo(4, 5, 0, 1, 2, "a1", None, "slurm"),
    ),
    "srun-requeued-second-step": (  # a requeued job (sbatch --requeue) counts its restarts; step 3's own port
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "3",
         "SLURM_STEP_NODELIST": "n7", "SLURM_JOB_ID": "1062", "SLURM_RESTART_COUNT": "2"},
        LaunchInfo(0, 2, 0, 2, 0, "n7", 15000 + (1062 * 16 + 3) % 17000, "slurm", 2),
    ),
    "srun-with-master-port": (  # what an sbatch script exports for torch.distributed (launch_scripts/slurm.sbatch)
        {"SLURM_PROCID": "2", "SLURM_NTASKS": "4", "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_ID": "0",
         "SLURM_STEP_TASKS_PER_NODE": "2(x2)", "SLURM_STEP_NODELIST": "h[1-2]", "MASTER_PORT": "29500"},
        LaunchInfo(2, 4, 0, 2, 1, "h1", 29500, "slurm"),
    ),
    "srun-with-master-addr": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "0", "SLURM_STEP_ID": "0",
         "SLURM_STEP_NODELIST": "h[1-2]", "MASTER_ADDR": "10.77.0.1", "MASTER_PORT": "29500"},
        LaunchInfo(0, 2, 0, 2, 0, "10.77.0.1", 29500, "slurm"),
    ),
    "sbatch-script-without-srun": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "4", "SLURM_JOB_ID": "77", "SLURM_NODEID": "0"},
        LaunchInfo(),
    ),
    "plain-rank-world-size": (
        {"RANK": "1", "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1234"},
        LaunchInfo(1, 2, 1, 2, 0, "127.0.0.1", 1234, "env"),
    ),
}


@pytest.mark.parametrize("name", CASES)
def test_detect(name: str) -> None:
    environ, expected = CASES[name]
    assert detect(environ) == expected


def test_torchrun_wins_over_mpi_variables() -> None:
    env = {**CASES["torchrun"][0], **CASES["mpich-hydra"][0]}
    assert detect(env).launcher == "torchrun"


BAD = {
    "rank-without-size": ({"PMI_RANK": "0"}, ["PMI_RANK", "PMI_SIZE"]),
    "size-without-rank": ({"WORLD_SIZE": "2"}, ["WORLD_SIZE"]),
    "rank-not-an-int": ({"OMPI_COMM_WORLD_RANK": "one", "OMPI_COMM_WORLD_SIZE": "2"}, ["OMPI_COMM_WORLD_RANK"]),
    "rank-too-large": ({"HOROVOD_RANK": "2", "HOROVOD_SIZE": "2"}, ["HOROVOD_RANK=2", "HOROVOD_SIZE=2"]),
    "negative-rank": ({"RANK": "-1", "WORLD_SIZE": "2"}, ["RANK=-1"]),
    "zero-size": ({"PMI_RANK": "0", "PMI_SIZE": "0"}, ["PMI_SIZE=0"]),
    "local-rank-too-large": (
        {"PMI_RANK": "0", "PMI_SIZE": "2", "MPI_LOCALRANKID": "2", "MPI_LOCALNRANKS": "2"},
        ["MPI_LOCALRANKID=2", "MPI_LOCALNRANKS=2"],
    ),
    "bad-port": ({"RANK": "0", "WORLD_SIZE": "1", "MASTER_PORT": "70000"}, ["MASTER_PORT=70000"]),
    "pmix-without-size": ({"PMIX_RANK": "0"}, ["PMIX_RANK", "SLURM_NTASKS"]),
    "bad-slurm-tasks": (
        {"SLURM_PROCID": "0", "SLURM_NTASKS": "2", "SLURM_STEP_ID": "0", "SLURM_TASKS_PER_NODE": "two"},
        ["two"],
    ),
}


@pytest.mark.parametrize("name", BAD)
def test_bad_launch_environment(name: str) -> None:
    environ, mentioned = BAD[name]
    with pytest.raises(LaunchEnvironmentError) as info:
        detect(environ)
    for word in mentioned:
        assert word in str(info.value)


def test_detect_reads_os_environ_by_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PMI_RANK", "0")
    monkeypatch.setenv("PMI_SIZE", "3")
    assert detect().size == 3


@pytest.mark.parametrize(("nodelist", "host"), [("n1", "n1"), ("gpu[07-09]", "gpu07"), ("a[1,5],b2", "a1"),
                                                 ("x-1.site", "x-1.site")])
def test_slurm_first_host(nodelist: str, host: str) -> None:
    assert slurm_first_host(nodelist) == host




def test_script_args_drop_the_launchers_local_rank_only() -> None:
    argv = ["train.py", "--local_rank=1", "--lr", "0.1"]
    assert script_args(argv, {"LOCAL_RANK": "1"}) == ["--lr", "0.1"]
    assert argv == ["train.py", "--local_rank=1", "--lr", "0.1"]  # never edited in place
    assert script_args(["train.py", "--local_rank=3"], {"LOCAL_RANK": "1"}) == ["--local_rank=3"]  # the user's
    assert script_args(["t.py", "--local_rank=0"], {}) == ["--local_rank=0"]  # no launcher: nothing dropped
    assert script_args(["t.py", "--local-rank=0", "x"], {"LOCAL_RANK": "0"}) == ["x"]
    assert script_args(["t.py", "--local_rank", "0", "x"], {"LOCAL_RANK": "0"}) == ["x"]
    assert script_args(["t.py", "--local_rank", "2"], {"LOCAL_RANK": "0"}) == ["--local_rank", "2"]


def test_import_leaves_argv_alone() -> None:
    """DeepSpeed's own examples declare --local_rank: importing unidist must not take it from them."""
    code = "import sys; sys.argv = ['t.py', '--local_rank=0']; import unidist; print(sys.argv)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={**os.environ, "LOCAL_RANK": "0"}).stdout
    assert out.strip() == "['t.py', '--local_rank=0']"


def test_torch_under_srun_without_pmi_or_port_says_what_to_set() -> None:
    """An srun that gives MPI no process manager leaves each task an MPI world of one: the address cannot go
    over MPI, and the error must say so (it was ``int('')`` on ranks > 0, from an empty broadcast)."""
    pytest.importorskip("mpi4py")
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
    from helpers import clean_env

    env = clean_env({"SLURM_PROCID": "1", "SLURM_NTASKS": "2", "SLURM_LOCALID": "0", "SLURM_NODEID": "1",
                     "SLURM_STEP_ID": "0", "SLURM_STEP_TASKS_PER_NODE": "1(x2)", "SLURM_STEP_NODELIST": "h[1-2]",
                     "UNIDIST_BACKEND": "torch", "UNIDIST_TIMEOUT": "5"})
    proc = subprocess.run([sys.executable, "-c", "import unidist; unidist.init().start()"], capture_output=True,
                          text=True, env=env, timeout=120)
    assert proc.returncode != 0
    assert "LaunchEnvironmentError" in proc.stderr and "MASTER_PORT" in proc.stderr, proc.stderr[-2000:]
    assert "invalid literal" not in proc.stderr


def test_slurm_port_is_the_steps_own_and_below_the_ephemeral_range() -> None:
    ports = {slurm_port({"SLURM_JOB_ID": str(job), "SLURM_STEP_ID": str(step)})
             for job in range(1000, 1060) for step in range(16)}
    assert len(ports) == 60 * 16  # concurrent steps of a job and neighbouring jobs never share one
    assert all(p is not None and 15000 <= p < 32768 for p in ports)
    assert slurm_port({"SLURM_JOB_ID": "5"}) is None  # the batch script itself: no step
    assert slurm_port({"SLURM_JOB_ID": "5", "SLURM_STEP_ID": "batch"}) is None


def test_slurm_job_is_what_scontrol_knows() -> None:
    assert slurm_job({"SLURM_JOB_ID": "12"}) == "12"
    assert slurm_job({"SLURM_JOB_ID": "13", "SLURM_ARRAY_JOB_ID": "12", "SLURM_ARRAY_TASK_ID": "1"}) == "12_1"
    assert slurm_job({}) is None


def test_srun_pmi2_takes_the_steps_placement() -> None:
    """srun --mpi=pmi2 sets PMI_RANK/PMI_SIZE but no node-local numbering: the step's variables place the task
    (read as one node before, the several-host job pinned its engines to loopback)."""
    from unidist.launch import detect

    env = {"PMI_RANK": "2", "PMI_SIZE": "4", "PMI_FD": "11", "SLURM_STEP_ID": "0", "SLURM_PROCID": "2",
           "SLURM_LOCALID": "0", "SLURM_NODEID": "1", "SLURM_STEP_NUM_TASKS": "4", "SLURM_STEP_TASKS_PER_NODE": "2(x2)"}
    info = detect(env)
    assert (info.launcher, info.local_rank, info.local_size, info.node_rank) == ("mpich", 0, 2, 1)
