"""``unidist launch --hosts/--hostfile`` and inside a Slurm allocation: the commands --dry-run prints for every
backend (programs stubbed, so no engine or launcher needs to be installed), the typed errors, and how a job of
several commands ends (the first failure's code, the others stopped)."""

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
def _stubs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cli, "find_program", lambda name: f"/opt/bin/{name}")
    monkeypatch.setattr(cli, "free_port", lambda: 29611)
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


def test_dry_run_deepspeed_writes_its_hostfile(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    hostfile = tmp_path / "hosts"
    hostfile.write_text("h1:2  # mpich format in, DeepSpeed's out\nh2 slots=2\n")
    code, [argv], err = _dry(capsys, "--hostfile", str(hostfile), "--backend", "deepspeed")
    assert code == 0
    written = Path(argv[2])
    assert argv[:2] == ["/opt/bin/deepspeed", "--hostfile"] and written.name.startswith("unidist-hostfile-")
    assert argv[3:] == ["--master_addr", "h1", "--master_port", "29611", "--no_local_rank", *SCRIPT]
    assert written.read_text() == "h1 slots=2\nh2 slots=2\n"  # kept, so the printed command runs as printed
    assert str(written) in err and "# h1 slots=2" in err
    written.unlink()


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
        words = shlex.split(text.split(" & pid=$!")[0].split("exec 3<&0; ")[1])
        assert text.startswith(f"cd {shlex.quote(str(Path.cwd()))} || exit 1; ")
        assert "kill -TERM $pid" in text and text.endswith("wait $pid")
        assert words[0] == "env" and "UNIDIST_TIMEOUT=30" in words and "GLOO_SOCKET_IFNAME=eth0" in words
        assert not any(w.startswith("SECRET_TOKEN") for w in words)
        torchrun = words[words.index("/opt/bin/torchrun"):]
        assert torchrun[1:-4] == ["--nnodes", "2", "--nproc_per_node", slots, "--rdzv_backend", "c10d",
                                  "--rdzv_endpoint", "h1:29611", "--rdzv_id", torchrun[10]]
        assert torchrun[-4:] == [*SCRIPT, "3<&-"]
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
              "nnodes": "2", "ssh": "ssh", "slots": "2", "run_id": "r", "mpi": "--mpi=none"}
    forms = [fam for fam in LAUNCHERS if fam.command and fam.command.hosts_args]
    assert {fam.name for fam in forms} == {"torchrun", "horovodrun", "deepspeed", "mpich", "slurm"}
    for fam in forms:
        assert fam.command is not None
        argv = fam.command.hosts_argv("prog", values, ["s.py"])
        assert argv[0] == "prog" and argv[-1] == "s.py" and not any("{" in a for a in argv), argv


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
