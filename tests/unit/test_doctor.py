"""``unidist info --check`` (unidist.doctor): the probe child against stand-in packages that are absent, broken,
crash or hang (a clear verdict within the time limit, one limit per hang); launcher programs against stand-in
programs on PATH (silent, failing, another Python's, another MPI's); the verdicts and exit codes. The real run
on this environment's engines is tests/multiproc/test_cli.py's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import unidist
from unidist import registry
from unidist.doctor import ask, render, verdict
from unidist.net import Interface, interfaces

SRC = str(Path(unidist.__file__).resolve().parents[1])
LIMIT = 3.0  # seconds a probe step or a program has (20 in use; a loaded 2-core machine starts Python in ~0.3)


def _stand_ins(tmp_path: Path, packages: dict[str, str]) -> dict[str, str]:
    """An environment whose Python finds these packages (name -> its __init__.py) before the real ones."""
    for name, code in packages.items():
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(code)
    return {**os.environ, "PYTHONPATH": f"{tmp_path}{os.pathsep}{SRC}"}


def _program(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, text: str) -> None:
    path = tmp_path / "bin" / name
    path.parent.mkdir(exist_ok=True)
    path.write_text(text)
    path.chmod(0o755)
    monkeypatch.setenv("PATH", f"{path.parent}{os.pathsep}{os.environ['PATH']}")


def test_absent_and_broken_packages_are_told_apart(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, {
        "deepspeed": "raise ModuleNotFoundError(\"No module named 'deepspeed'\", name='deepspeed')",
        "horovod": "import libhvd_missing_dependency",
        "torch": "raise OSError('libtorch_cpu.so: cannot open shared object file')",
    })
    answers = ask.ask_packages(["deepspeed", "horovod", "torch", "json"], env, LIMIT)
    assert answers["deepspeed"] == {"ok": False, "absent": True, "error": "not installed"}
    assert not answers["horovod"]["absent"] and "libhvd_missing_dependency" in answers["horovod"]["error"]
    assert answers["torch"]["error"] == "OSError: libtorch_cpu.so: cannot open shared object file"
    assert answers["json"]["ok"]  # a package without a step of its own: imported, its version read
    ds = verdict.backend_verdict(registry.get("deepspeed"), answers, {}, ask.this_python)
    assert not ds["usable"]
    assert "fails to import: OSError: libtorch_cpu.so" in ds["problems"][0]  # torch, the first it requires
    assert ds["problems"][1] == f"needs deepspeed: {registry.get('deepspeed').install}"
    # the launcher it lacks comes with that install: its fix is said once, not twice
    assert ds["problems"][2] == "no deepspeed beside this Python or on PATH; the install above brings it"
    assert sum(registry.get("deepspeed").install in p for p in ds["problems"]) == 1


def test_a_crashing_import_is_reported_and_blocked_after(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, {
        "torch": "import os, signal, sys\nprint('torch stand-in: about to crash', file=sys.stderr)\n"
                 "os.kill(os.getpid(), signal.SIGSEGV)",
        "horovod": "import torch",  # would crash again: blocked instead
        "mpi4py": "__version__ = '9.9'",  # the mpi step's own calls then fail: its error, not the others'
    })
    answers = ask.ask_packages(["torch", "horovod", "mpi4py"], env, LIMIT)
    assert answers["torch"]["error"].startswith("importing it crashed the process (signal 11)")
    assert "about to crash" in answers["torch"]["error"]
    assert "torch not imported: importing it hung or crashed in an earlier step" in answers["horovod"]["error"]
    assert not answers["mpi4py"]["ok"] and "rc" in answers["mpi4py"]["error"]


def test_a_hanging_import_costs_one_limit(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, {
        "torch": "import time\ntime.sleep(60)",
        "horovod": "import torch",
        "deepspeed": "import torch",
        "mpi4py": "__version__ = '9.9'",
    })
    start = time.monotonic()
    answers = ask.ask_packages(["mpi4py", "torch", "horovod", "deepspeed", "json"], env, LIMIT)
    took = time.monotonic() - start
    assert answers["torch"]["error"] == f"importing it hung: no answer in {LIMIT:g} s (stopped; not imported again)"
    for pkg in ("horovod", "deepspeed"):
        assert "torch not imported" in answers[pkg]["error"], answers[pkg]
    assert answers["json"]["ok"] and "error" in answers["mpi4py"]
    assert took < 2 * LIMIT, took  # one limit for the hang, then a fresh child answers at once


def test_engines_printing_on_import_do_not_spoil_the_answers(tmp_path: Path) -> None:
    env = _stand_ins(tmp_path, {"chatty": "print('[INFO] Setting ds_accelerator to cpu')\n__version__ = '1.0'"})
    assert ask.ask_packages(["chatty"], env, LIMIT) == {"chatty": {"ok": True, "version": "1.0"}}


def test_programs_answer_fail_or_hang(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _program(tmp_path, monkeypatch, "srun", "#!/bin/sh\necho 'slurm 23.02.7'\n")
    said = ask.ask_program("srun", LIMIT)
    assert said["answered"] and said["output"] == "slurm 23.02.7" and said["python"] is None
    _program(tmp_path, monkeypatch, "srun", "#!/bin/sh\necho 'srun: fatal: bad option' >&2\nexit 1\n")
    said = ask.ask_program("srun", LIMIT)
    assert not said["answered"] and said["error"] == "`srun --help` exited 1: srun: fatal: bad option"
    _program(tmp_path, monkeypatch, "srun", "#!/bin/sh\nsleep 60\n")
    start = time.monotonic()
    said = ask.ask_program("srun", 1.0)
    assert said["error"] == "`srun --version` gave no answer in 1 s" and time.monotonic() - start < 5
    monkeypatch.setenv("PATH", "/nonexistent")
    assert ask.ask_program("srun", LIMIT) == {"found": False}


def _mpi_backend(programs: dict[str, object], packages: dict[str, object] | None = None) -> dict[str, object]:
    ok = {"ok": True, "version": "x"}
    pkgs = packages or {"torch": {**ok, "distributed": True, "backends": ["gloo"]},
                        "mpi4py": {**ok, "library_version": "MPICH Version:      5.0.2\nMPICH Device: ch4",
                                   "library": "/v/lib/libmpi.so.12"}}
    return verdict.backend_verdict(registry.get("mpi"), pkgs, programs, ask.this_python)


def test_an_mpiexec_of_another_mpi_is_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    _program(tmp_path, monkeypatch, "srun", "#!/bin/sh\necho 'mpiexec (Open MPI) 4.1.5'\n")
    openmpi = ask.ask_program("srun", LIMIT)
    result = _mpi_backend({"mpiexec": openmpi})
    assert not result["usable"]
    assert "is Open MPI's, but mpi4py loaded MPICH (/v/lib/libmpi.so.12)" in result["problems"][0]  # type: ignore
    hydra = {"found": True, "path": "/v/bin/mpiexec", "python": None, "answered": True,
             "output": "HYDRA build details:\n    Version:                                 4.2.0"}
    result = _mpi_backend({"mpiexec": hydra})
    assert result["usable"] and result["notes"] == ["/v/bin/mpiexec is version 4.2.0, mpi4py's library 5.0.2"]
    assert _mpi_backend({})["problems"] == [  # no mpiexec at all: the record's install hint
        f"no mpiexec or mpirun beside this Python or on PATH; {registry.get('mpi').install}"]


def test_a_launcher_of_another_python_is_flagged(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    other = tmp_path / "other-venv" / "bin" / "python3"
    other.parent.mkdir(parents=True)
    other.symlink_to(Path(sys.executable).resolve())  # a venv of the same base Python: still another one
    _program(tmp_path, monkeypatch, "srun", f"#!{other}\nprint('torchrun 2.0')\n")
    theirs = ask.ask_program("srun", LIMIT)
    assert theirs["answered"] and theirs["python"] == str(other)
    torch_ok = {"torch": {"ok": True, "distributed": True, "backends": ["gloo"]}}
    result = verdict.backend_verdict(registry.get("torch"), torch_ok, {"torchrun": theirs}, ask.this_python)
    assert not result["usable"] and f"runs {other}, not this Python" in result["problems"][0]
    _program(tmp_path, monkeypatch, "srun", f"#!{sys.executable}\nprint('torchrun 2.0')\n")
    mine = ask.ask_program("srun", LIMIT)
    assert verdict.backend_verdict(registry.get("torch"), torch_ok, {"torchrun": mine}, ask.this_python)["usable"]
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    env_line = tmp_path / "envscript"
    env_line.write_text(f"#!/usr/bin/env {Path(sys.executable).name}\n")
    assert ask.shebang(str(env_line)) == str(Path(sys.executable).parent / Path(sys.executable).name)


def test_engine_builds_are_checked() -> None:
    hvd = {"torch": {"ok": True, "distributed": True, "backends": ["gloo"]},
           "horovod": {"ok": True, "frameworks": ["tensorflow"], "controllers": [], "ops": []}}
    problems = verdict.backend_verdict(registry.get("horovod"), hvd, {}, ask.this_python)["problems"]
    assert "Horovod was built without its PyTorch extension" in problems
    assert "Horovod was built with neither its gloo nor its MPI controller" in problems
    no_dist = {"torch": {"ok": True, "distributed": False, "backends": []}}
    assert "without torch.distributed" in verdict.backend_verdict(registry.get("local"), no_dist, {},
                                                                  ask.this_python)["problems"][0]


def test_exit_codes_and_which_backend_runs() -> None:
    usable, broken = {"usable": True}, {"usable": False}
    assert verdict.exit_code({"local": usable, "mpi": usable, "torch": broken}, "mpi") == verdict.EXIT_USABLE
    assert verdict.exit_code({"local": usable, "mpi": broken, "torch": usable}, "mpi") == verdict.EXIT_ANOTHER
    assert verdict.exit_code({"local": usable, "mpi": broken, "torch": broken}, "mpi") == verdict.EXIT_LOCAL_ONLY
    assert verdict.exit_code({"local": usable, "torch": broken}, None) == verdict.EXIT_LOCAL_ONLY
    assert verdict.would_run({"UNIDIST_BACKEND": "torch"}) == "torch"
    assert verdict.would_run({"PMI_RANK": "0", "PMI_SIZE": "2"}) == "mpi"  # under mpiexec
    assert verdict.would_run({"UNIDIST_BACKEND": "nope"}) is None
    first = registry.first_launchable()
    assert verdict.would_run({}) == (first.name if first else None)


def test_first_launchable_follows_the_records_order() -> None:
    assert registry.first_launchable(lambda name: None) is None
    found = registry.first_launchable(lambda name: f"/x/{name}" if name in ("torchrun", "horovodrun") else None)
    assert found is not None and found.name == "torch"  # before horovod in the records' order
    assert registry.first_launchable(lambda name: "/x/mpirun" if name == "mpirun" else None).name == "mpi"  # type: ignore


def test_interface_variables() -> None:
    ifaces = [Interface("lo", "127.0.0.1", True, True, False), Interface("eth0", "10.0.0.2", True, False, True),
              Interface("ib0", "10.1.0.2", True, False, False)]
    said = verdict.iface_variables({"GLOO_SOCKET_IFNAME": "lo", "FI_TCP_IFACE": "wlan9", "UCX_NET_DEVICES":
                                    "mlx5_0:1", "NCCL_SOCKET_IFNAME": "eth"}, ifaces)
    assert said["GLOO_SOCKET_IFNAME"]["note"] == ("loopback only: fine on one host; a several-host job cannot "
                                                  "connect (unset it, or set GLOO_SOCKET_IFNAME=eth0)")
    assert said["FI_TCP_IFACE"]["note"] == "names wlan9: no such interface here"
    assert said["UCX_NET_DEVICES"]["note"] is None  # an InfiniBand device:port, not a network interface
    assert said["NCCL_SOCKET_IFNAME"]["note"] is None  # NCCL matches the prefix: eth0
    assert verdict.iface_variables({"NCCL_SOCKET_IFNAME": "=eth"}, ifaces)["NCCL_SOCKET_IFNAME"]["note"]
    assert all(v["value"] is None for v in verdict.iface_variables({}, ifaces).values())


def test_interfaces_are_the_kernels() -> None:
    found = interfaces()
    sys_net = Path("/sys/class/net")
    if sys_net.is_dir():
        assert {i.name for i in found} == {p.name for p in sys_net.iterdir()}
    assert [i.name for i in found if i.loopback] in (["lo"], ["lo0"])
    assert sum(i.route for i in found) <= 1


def test_render_says_what_is_wrong_and_how_to_fix_it() -> None:
    packages = {"torch": {"ok": True, "version": "2", "distributed": True, "backends": ["gloo"], "gpus": 0},
                "deepspeed": {"ok": False, "absent": True, "error": "not installed"}}
    verdicts = {rec.name: verdict.backend_verdict(rec, packages, {}, ask.this_python) for rec in registry.records()}
    report = {"seconds": 1.0, "python": "3.11", "packages": packages, "programs": {"srun": {"found": False}},
              "machine": {"cpus": 2, "usable": 2, "gpus": 0},
              "network": {"interfaces": [], "variables": verdict.iface_variables({}, [])}, "backends": verdicts,
              "would_run": "mpi", "usable_launched": [], "exit_code": verdict.exit_code(verdicts, "mpi")}
    text = "\n".join(render.lines(report))
    assert f"needs deepspeed: {registry.get('deepspeed').install}" in text
    assert "verdict: no multi-process backend works here" in text and report["exit_code"] == 3
    assert "pip install unidist" not in text  # PyPI's unidist is another project
    json.dumps(report)


def test_plain_info_imports_no_engine_and_no_probe() -> None:
    code = ("import contextlib, io, sys\nfrom unidist import cli\nwith contextlib.redirect_stdout(io.StringIO()):\n"
            "    cli.main(['info'])\nprint(' '.join(sys.modules))")
    mods = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert not [m for m in mods if m.partition(".")[0] in ("torch", "mpi4py", "horovod", "deepspeed")]
    assert "unidist.doctor" not in mods
