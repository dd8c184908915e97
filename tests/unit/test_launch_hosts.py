"""``unidist launch --hosts/--hostfile`` and inside a Slurm allocation: the commands --dry-run prints for every
backend (programs stubbed, so no engine or launcher needs to be installed), the ssh line a launcher started per
host runs there (torchrun, deepspeed --no_ssh: its hostfile written on the host), the typed errors, and how a job
of several commands ends (the first failure's code, the others stopped)."""

from __future__ import annotations

import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest

from unidist import cli
from unidist.launch import LAUNCHERS

PY = sys.executable
SCRIPT = ["train.py", "--lr", "0.1"]


@pytest.fixture(autouse=True)
def _stubs(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cli, "find_program", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(cli, "free_port", lambda: 29611)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))  # no .deepspeed_env of the user's
    monkeypatch.delenv("DS_ENV_FILE", raising=False)
    for name in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST", "SLURM_NTASKS_PER_NODE", "SLURM_TASKS_PER_NODE"):
        monkeypatch.delenv(name, raising=False)


def _dry(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, list[list[str]], str]:
    code = cli.main(["launch", *argv, "--dry-run", *SCRIPT])
    out, err = capsys.readouterr()
    return code, [shlex.split(line) for line in out.splitlines()], err


@pytest.mark.parametrize(("backend", "expect"), [
    ("mpi", ["/opt/bin/mpiexec", "-launcher", "ssh", "-launcher-exec", "/opt/bin/ssh", "-hosts", "h1:2,h2:2",
             "-n", "4", PY, *SCRIPT]),
    ("horovod", ["/opt/bin/horovodrun", "-np", "4", "--gloo", "-H", "h1:2,h2:2", PY, *SCRIPT]),
])
def test_dry_run_one_launcher_command(capsys: pytest.CaptureFixture[str], backend: str,
                                      expect: list[str]) -> None:
    code, lines, _ = _dry(capsys, "--hosts", "h1:2,h2:2", "--backend", backend)
    assert code == 0 and lines == [expect]


def _launcher(remote: str) -> list[str]:
    """The words of the launcher an ssh line of the plan starts (after ``setsid -w``, before the watcher)."""
    return shlex.split(remote.split(" 3<&- & pid=$!")[0].split("exec 3<&0; setsid -w ")[1])


def test_dry_run_deepspeed_one_no_ssh_runner_per_host(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """No pdsh: `deepspeed --no_ssh --node_rank i` on every host over ssh, each writing the same hostfile (every
    host, in order: the world its runner numbers ranks from) into that host's own temporary directory."""
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2  # mpich format in, DeepSpeed's out\nh2 slots=1\n")
    code, lines, err = _dry(capsys, "--hostfile", str(hostfile), "--backend", "deepspeed")
    assert code == 0 and not err and [line[:2] for line in lines] == [["/opt/bin/ssh", "h1"], ["/opt/bin/ssh", "h2"]]
    for node_rank, line in enumerate(lines):
        remote = line[2]
        assert "hostfile=$(mktemp)" in remote and "printf '%s\\n' 'h1 slots=2' 'h2 slots=1' > \"$hostfile\"" in remote
        assert "pdsh" not in remote
        words = _launcher(remote)
        assert words[0] == "env" or words[0] == "/opt/bin/deepspeed"  # env: the variables carried (PYTHON*, ...)
        assert words[words.index("/opt/bin/deepspeed"):] == [
            "/opt/bin/deepspeed", "--hostfile", "$hostfile", "--no_ssh", "--node_rank", str(node_rank),
            "--master_addr", "h1", "--master_port", "29611", "--no_local_rank", *SCRIPT]


def test_remote_deepspeed_line_writes_the_hostfile_on_its_host(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                capsys: pytest.CaptureFixture[str]) -> None:
    """The ssh line as the far host's shell runs it (sh stands in for ssh): a stub deepspeed sees the hostfile's
    lines and its node rank; the file is gone after, and the stub's exit code is the session's."""
    seen = tmp_path / "seen"
    stub = tmp_path / "deepspeed"
    stub.write_text(f'#!/bin/sh\nprintf "%s\\n" "$@" > {seen}; cat "$2" >> {seen}; echo "$2" >> {seen}; exit 4\n')
    stub.chmod(0o755)
    monkeypatch.setattr(cli, "find_program", lambda name: str(stub) if name == "deepspeed" else f"/opt/bin/{name}")
    monkeypatch.chdir(tmp_path)
    code, lines, _ = _dry(capsys, "--hosts", "h1:2,h2:2", "--backend", "deepspeed")
    done = subprocess.Popen(["sh", "-c", lines[1][2]], stdin=subprocess.PIPE)  # ssh's input: open until the end
    assert code == 0 and done.wait(timeout=30) == 4
    assert done.stdin is not None
    done.stdin.close()
    *argv, first, second, path = seen.read_text().splitlines()
    assert argv[:6] == ["--hostfile", path, "--no_ssh", "--node_rank", "1", "--master_addr"]
    assert (first, second) == ("h1 slots=2", "h2 slots=2") and not Path(path).exists()


def test_deepspeed_per_host_carries_what_its_pdsh_runner_would(capsys: pytest.CaptureFixture[str], tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """DeepSpeed's runner exports PYTHON*, UCX*, MV2*, MLFLOW* and the lines of .deepspeed_env (home, then the
    working directory) to the nodes; started per host, unidist carries them over ssh (only for deepspeed)."""
    home, work = tmp_path / "home", tmp_path / "work"
    home.mkdir()
    work.mkdir()
    (home / ".deepspeed_env").write_text("A_FROM_HOME=1\nB_BOTH=home\n")
    (work / ".deepspeed_env").write_text("# a comment\n\nB_BOTH=work\nC_SPACES = a b \n")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.chdir(work)
    monkeypatch.setenv("UCX_TLS", "tcp")
    code, lines, _ = _dry(capsys, "--hosts", "h1:1,h2:1", "--backend", "deepspeed")
    words = _launcher(lines[0][2])
    assert code == 0 and words[0] == "env"
    assert {"A_FROM_HOME=1", "B_BOTH=work", "C_SPACES=a b", "UCX_TLS=tcp"} <= set(words), words
    _, lines, _ = _dry(capsys, "--hosts", "h1:1,h2:1", "--backend", "torch")  # torchrun's own list only
    assert not any(w.startswith(("UCX_TLS", "A_FROM_HOME")) for w in _launcher(lines[0][2]))
    monkeypatch.setenv("DS_ENV_FILE", "other_env")  # DeepSpeed's name for another file
    (work / "other_env").write_text("D_OTHER=4\n")
    _, lines, _ = _dry(capsys, "--hosts", "h1:1,h2:1", "--backend", "deepspeed")
    words = _launcher(lines[0][2])
    assert "D_OTHER=4" in words and not any(w.startswith("B_BOTH") for w in words)


@pytest.mark.parametrize(("text", "says"), [
    ("NCCL_DEBUG\n", "not a NAME=value line"),
    ("PATH=/opt/bin:$PATH\n", "write the value out in full"),
])
def test_deepspeed_env_it_cannot_carry_is_refused_before_anything_starts(
        capsys: pytest.CaptureFixture[str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str,
        says: str) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".deepspeed_env").write_text(text)
    code, lines, err = _dry(capsys, "--hosts", "h1:1,h2:1", "--backend", "deepspeed")
    assert code == 2 and not lines and says in err and ".deepspeed_env line 1" in err, err


def test_dry_run_torch_one_torchrun_per_host_over_ssh(capsys: pytest.CaptureFixture[str],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIDIST_TIMEOUT", "30")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "eth0")
    monkeypatch.setenv("SECRET_TOKEN", "not forwarded")
    code, lines, _ = _dry(capsys, "--hosts", "h1:2,h2:1", "--backend", "torch")
    assert code == 0 and [line[:2] for line in lines] == [["/opt/bin/ssh", "h1"], ["/opt/bin/ssh", "h2"]]
    remote = [line[2] for line in lines]
    assert all(len(line) == 3 for line in lines)
    run_ids = set()
    for text, slots in zip(remote, ("2", "1"), strict=True):
        words = _launcher(text)
        assert text.startswith(f"cd {shlex.quote(str(Path.cwd()))} || exit 1; ")
        assert "kill -TERM -$pid" in text and text.endswith("wait $pid")
        assert words[0] == "env" and "UNIDIST_TIMEOUT=30" in words and "GLOO_SOCKET_IFNAME=eth0" in words
        assert not any(w.startswith("SECRET_TOKEN") for w in words)
        torchrun = words[words.index("/opt/bin/torchrun"):]
        assert torchrun[1:-3] == ["--nnodes", "2", "--nproc_per_node", slots, "--rdzv_backend", "c10d",
                                  "--rdzv_endpoint", "h1:29611", "--rdzv_id", torchrun[10]]
        assert torchrun[-3:] == SCRIPT
        run_ids.add(torchrun[10])
    assert len(run_ids) == 1  # one rendezvous


def test_dry_run_inside_slurm_allocation_uses_srun(capsys: pytest.CaptureFixture[str],
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURM_JOB_ID", "42")
    monkeypatch.setenv("SLURM_JOB_NODELIST", "gpu[01-02]")
    monkeypatch.setenv("SLURM_TASKS_PER_NODE", "2(x2)")
    code, lines, _ = _dry(capsys, "--backend", "torch")
    assert code == 0
    assert lines == [["UNIDIST_BACKEND=torch", "/opt/bin/srun", "--nodes", "2", "--ntasks", "4",
                      "--kill-on-bad-exit=1", "--mpi=none", PY, *SCRIPT]]  # torch meets without PMI
    code, lines, _ = _dry(capsys, "--backend", "mpi")  # srun implies mpi: nothing to add but its PMI
    assert lines[0][:2] == ["/opt/bin/srun", "--nodes"] and "--mpi=pmi2" in lines[0]
    monkeypatch.setenv("SLURM_MPI_TYPE", "pmix")  # an MPI built for PMIx: the user's choice stands
    code, lines, _ = _dry(capsys, "--backend", "mpi")
    assert "--mpi=pmix" in lines[0]
    monkeypatch.delenv("SLURM_MPI_TYPE")
    code, lines, _ = _dry(capsys, "--hosts", "gpu01:1", "--backend", "mpi")  # explicit hosts win
    assert lines[0][0] == "/opt/bin/mpiexec" and "gpu01:1" in lines[0]


@pytest.mark.parametrize(("argv", "says"), [
    (["--hosts", "h1:2", "--hostfile", "f"], "--hosts and --hostfile both given"),
    (["--hosts", "h1:0"], "h1 has 0 slots; give every host at least 1"),
    (["--hosts", "h1;h2"], "write host:slots,host:slots"),
    (["--hosts", "h1:2,h2:2", "--backend", "local"], "use --backend mpi or torch or deepspeed or horovod"),
    (["--hosts", "h1:2,h2:2", "-n", "3", "--backend", "mpi"], "-n 3 but the hosts have 4 slots"),
    (["--hostfile", "/nonexistent/hosts"], "cannot read hostfile '/nonexistent/hosts'"),
])
def test_bad_input_is_a_typed_error_with_the_fix(capsys: pytest.CaptureFixture[str], argv: list[str],
                                                 says: str) -> None:
    code, lines, err = _dry(capsys, *argv)
    assert code == 2 and not lines and says in err, err


def test_every_multi_host_form_fills_its_placeholders() -> None:
    values = {"n": "4", "python": "py", "port": "1", "hosts": "a:2,b:2", "hostfile": "f", "first": "a",
              "nnodes": "2", "ssh": "ssh", "slots": "2", "node_rank": "0", "run_id": "r", "mpi": "--mpi=none"}
    forms = [fam for fam in LAUNCHERS if fam.command and fam.command.hosts_args]
    assert {fam.name for fam in forms} == {"torchrun", "horovodrun", "deepspeed", "mpich", "slurm"}
    for fam in forms:
        assert fam.command is not None
        argv = fam.command.hosts_argv("prog", values, ["s.py"])
        assert argv[0] == "prog" and argv[-1] == "s.py" and not any("{" in a for a in argv), argv
        # a hostfile is written on the host its launcher starts on: only a launcher started per host has one
        assert fam.command.per_host or not (fam.command.hostfile or "{hostfile}" in fam.command.hosts_args), fam


def test_first_failure_ends_the_others_and_its_code_passes_through() -> None:
    t0 = time.monotonic()
    code = cli._run_all([["sleep", "30"], [PY, "-c", "import time, sys; time.sleep(0.3); sys.exit(3)"]], {})
    assert code == 3 and time.monotonic() - t0 < 10
    assert cli._run_all([["true"], ["true"]], {}) == 0


def test_remote_session_ends_when_its_input_closes(tmp_path: Path) -> None:
    """What runs over ssh: the launcher gets SIGTERM once ssh's input closes (here sh stands in for ssh)."""
    marker = tmp_path / "stopped"
    trap = f"trap 'echo term > {marker}; exit 143' TERM; sleep 30 & wait"
    sessions = [["sh", "-c", cli._remote(str(tmp_path), ["sh", "-c", trap])], ["sh", "-c", "sleep 0.3; exit 5"]]
    t0 = time.monotonic()
    assert cli._run_all(sessions, {"PATH": "/usr/bin:/bin"}, stdin=True) == 5
    assert time.monotonic() - t0 < 10 and marker.read_text() == "term\n"
    done = subprocess.Popen(["sh", "-c", cli._remote(str(tmp_path), ["sh", "-c", "exit 7"])], stdin=subprocess.PIPE)
    assert done.wait(timeout=10) == 7  # the launcher's own code passes through the wrapper (input still open)
    assert done.stdin is not None
    done.stdin.close()


def test_remote_session_stops_what_a_launcher_leaves_behind(tmp_path: Path) -> None:
    """A launcher that dies of SIGTERM without passing it on (DeepSpeed's runner: its per-node launcher and ranks
    would run on) has its whole process group stopped with it when ssh's input closes."""
    child = tmp_path / "child"
    launcher = ["sh", "-c", f"sleep 60 & echo $! > {child}; wait"]
    session = subprocess.Popen(["sh", "-c", cli._remote(str(tmp_path), launcher)], stdin=subprocess.PIPE)
    deadline = time.monotonic() + 10
    while not (child.exists() and child.read_text().strip()) and time.monotonic() < deadline:
        time.sleep(0.05)
    pid = int(child.read_text())
    assert session.stdin is not None
    session.stdin.close()
    assert session.wait(timeout=10) == 143
    deadline = time.monotonic() + 10
    while Path(f"/proc/{pid}").exists() and "Z" not in _state(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not Path(f"/proc/{pid}").exists() or "Z" in _state(pid), f"the launcher's child {pid} still runs"


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return "gone"
