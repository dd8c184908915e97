"""`unidist info` and `unidist launch`, run as a user would, under real mpiexec."""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from helpers import BIN, ROOT, deepspeed, horovodrun, mpiexec, require, run, torchrun

UNIDIST = str(BIN / "unidist")
UNIDIST_INFO = str(ROOT / "tests" / "workers" / "info.py")


def _json_reports(stdout: str) -> list[dict[str, object]]:
    """Split concatenated pretty-printed JSON objects (one per rank)."""
    decoder, reports, pos = json.JSONDecoder(), [], 0
    text = stdout.strip()
    while pos < len(text):
        obj, end = decoder.raw_decode(text, pos)
        reports.append(obj)
        pos = end
        while pos < len(text) and text[pos].isspace():
            pos += 1
    return reports


def test_info_plain_python_picks_local() -> None:
    proc = run([UNIDIST, "info"], timeout=60)
    assert proc.returncode == 0, proc.describe()
    assert "init() would pick: local (LocalManager)" in proc.stdout
    assert "launcher seen: none" in proc.stdout
    for pkg in ("torch", "mpi4py", "horovod", "deepspeed"):
        assert pkg in proc.stdout


def test_info_check_says_each_fact_once() -> None:
    """`info --check` replaces plain info's package, launcher and backend lists with its own (it said the python,
    every launcher and every backend twice), and keeps the launch, the pick and the settings."""
    proc = run([UNIDIST, "info", "--check"], timeout=120)
    assert proc.returncode in (0, 1, 3), proc.describe()
    lines = [line for line in proc.stdout.splitlines() if line.strip()]
    repeated = sorted({line for line in lines if lines.count(line) > 1})
    assert not repeated, repeated
    assert proc.stdout.count("python ") == 1 and "launchers on PATH" not in proc.stdout, proc.stdout
    for fact in ("engines (imported):", "launchers:", "backends:", "verdict: ", "init() would pick: ", "settings: "):
        assert sum(line.startswith(fact) for line in lines) == 1, fact


@pytest.mark.mpi
def test_info_under_mpiexec_names_launcher_and_picks_mpi() -> None:
    proc = run([str(BIN / "mpiexec"), "-n", "2", UNIDIST, "info", "--json"], timeout=60)
    assert proc.returncode == 0, proc.describe()
    reports = _json_reports(proc.stdout)
    assert len(reports) == 2
    assert sorted(r["launch"]["rank"] for r in reports) == [0, 1]  # type: ignore[index]
    for report in reports:
        assert report["backend"] == "mpi" and report["manager"] == "MPIManager"
        assert report["launch"]["launcher"] == "mpich" and report["launch"]["size"] == 2  # type: ignore[index]
        assert "PMI_RANK" in report["launch_variables"]  # type: ignore[operator]


def test_info_reports_bad_configuration() -> None:
    proc = run([UNIDIST, "info"], env={"UNIDIST_BACKEND": "nope"}, timeout=60)
    assert proc.returncode == 0
    assert "init() would fail: ConfigError: UNIDIST_BACKEND='nope'" in proc.stdout


def _metadata_version(pkg: str) -> str | None:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return None


@pytest.mark.mpi
def test_info_check_matches_this_environment() -> None:
    """`unidist info --check --json` on this environment, against independent sources: package metadata for
    what imported and its version, the mpich wheel's version for MPI and mpiexec, /sys/class/net and `ip` for
    the interfaces and the one a several-host job would use. (One run, ~5 s on 2 cores.)"""
    from unidist import registry

    require("mpi4py")
    proc = run([UNIDIST, "info", "--check", "--json"], timeout=120)
    check = json.loads(proc.stdout)["check"]
    assert proc.returncode == check["exit_code"] == 0, proc.describe()  # mpiexec beside python: mpi runs here
    assert check["would_run"] == "mpi" and check["backends"]["mpi"]["usable"], check["backends"]
    for rec in registry.records():
        for pkg in rec.requires:
            version, answer = _metadata_version(pkg), check["packages"][pkg]
            if version is None:
                assert answer["absent"] and f"needs {pkg}: {rec.install}" in check["backends"][rec.name]["problems"]
            else:
                assert answer["ok"] and answer["version"] == version, (pkg, answer)
    mpich = _metadata_version("mpich")
    mpi = check["packages"]["mpi4py"]
    assert mpi["library_version"].startswith(f"MPICH Version:      {mpich}\n") and mpi["library"].endswith(".so.12")
    assert check["programs"]["mpiexec"]["path"] == str(BIN / "mpiexec")
    assert f"Version:                                 {mpich}" in check["programs"]["mpiexec"]["output"]
    assert check["machine"]["cpus"] == os.cpu_count() and check["machine"]["gpus"] == 0  # the CPU build of torch
    ifaces = {i["name"]: i for i in check["network"]["interfaces"]}
    assert set(ifaces) == set(os.listdir("/sys/class/net"))
    ip = shutil.which("ip")
    if ip:
        shown = json.loads(subprocess.run([ip, "-j", "-4", "addr"], capture_output=True, text=True, check=True).stdout)
        assert {a["ifname"]: a["addr_info"][0]["local"] for a in shown if a["addr_info"]} == \
            {n: i["address"] for n, i in ifaces.items() if i["address"]}
        routed = [n for n, i in ifaces.items() if i["route"]]
        route = json.loads(subprocess.run([ip, "-j", "route", "get", "192.0.2.1"], capture_output=True, text=True
                                          ).stdout or "[]")
        assert routed == [r["dev"] for r in route if r["dev"] != "lo"], (routed, route)


@pytest.mark.mpi
def test_launch_runs_under_mpiexec_and_passes_exit_code(tmp_path: Path) -> None:
    script = tmp_path / "exit_code.py"
    script.write_text("import sys, unidist\nwith unidist.init() as m:\n"
                      "    sys.stdout.write(f'R {m.rank} {m.size} {m.backend}\\n')\n"
                      "sys.exit(int(sys.argv[1]))\n")
    ok = run([UNIDIST, "launch", "-n", "2", str(script), "0"], timeout=120)
    assert ok.returncode == 0, ok.describe()
    assert sorted(line for line in ok.stdout.splitlines() if line.startswith("R")) == ["R 0 2 mpi", "R 1 2 mpi"]
    failing = run([UNIDIST, "launch", "-n", "2", str(script), "3"], timeout=120)
    assert failing.returncode == 3, failing.describe()


def test_launch_dry_run_and_bad_backend() -> None:
    dry = run([UNIDIST, "launch", "-n", "2", "--backend", "mpi", "--dry-run", "s.py", "--lr", "1"], timeout=60)
    assert dry.returncode == 0
    argv = dry.stdout.split()
    assert argv[:3] == [str(BIN / "mpiexec"), "-n", "2"] and argv[4:] == ["s.py", "--lr", "1"]
    assert Path(argv[3]).resolve() == Path(sys.executable).resolve()
    bad = run([UNIDIST, "launch", "-n", "2", "--backend", "local", "s.py"], timeout=60)
    assert bad.returncode == 2 and "local backend runs one process" in bad.stderr


@pytest.mark.mpi
@pytest.mark.parametrize("n", [1, 2, 3])
def test_hello_example(n: int) -> None:
    argv = [sys.executable, "examples/hello_collectives.py"] if n == 1 else mpiexec(n, "examples/hello_collectives.py")
    proc = run(argv, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.describe()
    assert f"7/7 collectives correct on {n} process(es)" in proc.stdout
    assert proc.stdout.count("backend=" + ("local" if n == 1 else "mpi")) == n


@pytest.mark.mpi
def test_mpirun_recipe() -> None:
    proc = run(["bash", "launch_scripts/mpirun.sh", "2", "examples/hello_collectives.py"], cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.describe()
    assert "7/7 collectives correct on 2 process(es)" in proc.stdout


@pytest.mark.parametrize(("backend", "engine"), [
    pytest.param("torch", "torch", marks=pytest.mark.torch),
    pytest.param("deepspeed", "deepspeed", marks=pytest.mark.deepspeed),
    pytest.param("horovod", "horovod", marks=pytest.mark.horovod),
])
def test_launch_backend_runs_hello(backend: str, engine: str) -> None:
    """`unidist launch --backend B` starts the real launcher and init() picks B without UNIDIST_BACKEND help."""
    require(engine)
    proc = run([UNIDIST, "launch", "-n", "2", "--backend", backend, "examples/hello_collectives.py"], cwd=ROOT,
               timeout=300)
    assert proc.returncode == 0, proc.describe()
    assert "7/7 collectives correct on 2 process(es)" in proc.stdout
    assert proc.stdout.count(f"backend={backend}") == 2


@pytest.mark.parametrize(("argv", "launcher", "backend"), [
    pytest.param(lambda: torchrun(2, UNIDIST_INFO), "torchrun", "torch", marks=pytest.mark.torch),
    pytest.param(lambda: deepspeed(2, UNIDIST_INFO, "--json"), "deepspeed", "deepspeed",
                 marks=pytest.mark.deepspeed),
    pytest.param(lambda: horovodrun(2, UNIDIST_INFO, "--json"), "horovodrun", "horovod", marks=pytest.mark.horovod),
])
def test_info_under_real_launchers(argv: Callable[[], list[str]], launcher: str, backend: str) -> None:
    require(backend)
    args = argv()
    if launcher == "torchrun":
        args += ["--json"]
    proc = run(args, timeout=300)
    assert proc.returncode == 0, proc.describe()
    # horovodrun prefixes each line with "[rank]<stdout>:" and may interleave ranks: regroup by rank;
    # deepspeed's own log lines start with "["
    groups: dict[str, list[str]] = {}
    for line in proc.stdout.splitlines():
        m = re.match(r"^\[(\d+)\]<stdout>:(.*)$", line)
        if m:
            groups.setdefault(m.group(1), []).append(m.group(2))
        elif not line.startswith("["):
            groups.setdefault("", []).append(line)
    reports = [r for lines in groups.values() for r in _json_reports("\n".join(lines))]
    assert sorted(r["launch"]["rank"] for r in reports) == [0, 1]  # type: ignore[index]
    for report in reports:
        assert report["launch"]["launcher"] == launcher  # type: ignore[index]
        assert report["backend"] == backend


@pytest.mark.parametrize(("script", "engine"), [
    pytest.param("torchrun.sh", "torch", marks=pytest.mark.torch),
    pytest.param("deepspeed.sh", "deepspeed", marks=pytest.mark.deepspeed),
    pytest.param("horovodrun.sh", "horovod", marks=pytest.mark.horovod),
])
def test_launch_recipes(script: str, engine: str) -> None:
    require(engine)
    proc = run(["bash", f"launch_scripts/{script}", "2", "examples/hello_collectives.py"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.describe()
    assert "7/7 collectives correct on 2 process(es)" in proc.stdout


@pytest.mark.deepspeed
def test_deepspeed_recipe_with_its_config_file() -> None:
    """launch_scripts/ds_config.json through UNIDIST_DEEPSPEED_CONFIG: ZeRO-2 from the file, real launcher."""
    require("deepspeed")
    proc = run(["bash", "launch_scripts/deepspeed.sh", "2", "examples/train_digits.py", "--epochs", "2"], cwd=ROOT,
               env={"UNIDIST_DEEPSPEED_CONFIG": "launch_scripts/ds_config.json"}, timeout=300)
    assert proc.returncode == 0, proc.describe()
    assert "backend=deepspeed ranks=2" in proc.stdout
    assert "max parameter difference across ranks 0" in proc.stdout


def test_bench_dry_run_launches_the_bench_module() -> None:
    """`unidist bench <benchmark>` starts unidist/bench/__main__.py by path under the launcher (the deepspeed
    launcher takes only scripts); the benchmark's options go after --. The real runs: tests/multiproc/test_bench.py."""
    dry = run([UNIDIST, "bench", "collectives", "-n", "2", "--backend", "mpi", "--dry-run", "--", "--compare",
               "--sizes", "8"], timeout=60)
    assert dry.returncode == 0, dry.describe()
    argv = dry.stdout.split()
    assert Path(argv[0]).name in ("mpiexec", "mpirun") and argv[1:3] == ["-n", "2"], dry.stdout
    at = argv.index("collectives")
    assert argv[at - 1].endswith("unidist/bench/__main__.py"), dry.stdout
    assert argv[at:] == ["collectives", "--compare", "--sizes", "8"], dry.stdout
    torch = run([UNIDIST, "bench", "train", "-n", "2", "--backend", "torch", "--dry-run"], timeout=60)
    assert torch.returncode == 0 and "--nproc_per_node 2" in torch.stdout, torch.describe()
    bad = run([UNIDIST, "bench", "train", "--compare"], timeout=60)
    assert bad.returncode == 2 and "unrecognized arguments: --compare" in bad.stderr, bad.describe()
