"""A sixth engine from its registration record alone (issue 39): registered in this process, or installed as a
``unidist.backends`` entry point and found by a fresh process, it is selected by ``UNIDIST_BACKEND``, listed and
judged by ``unidist info [--check]``, refused by name by the cost model until its record documents algorithms
(then modelled from them), and started by the multi-process suites from its record's launches. No file under
``unidist/`` names it: every tool reads the record (bench/, doctor/ and cli.py keep no per-engine table). Its record
holds what registration needs and nothing more (the benchmarks' part, ``raw``, is optional and left out); what a new
engine touches is unidist/engines/README.md.

The engine is the local one under another name (a subclass of LocalManager), its one package a stand-in written
to a temporary directory, so everything here runs in seconds.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import unidist
from unidist import registry
from unidist.bench import costmodel
from unidist.config import Config
from unidist.errors import InvalidArgumentError
from unidist.launch import LaunchInfo
from unidist.selector import backend_for, select

NAME = "sixth"
PACKAGE = "unidist_sixth_pkg"  # the one package it requires: a stand-in written beside the plugin
SRC = str(Path(unidist.__file__).resolve().parents[1])
PLUGIN = f'''"""A backend written outside unidist: its record, registered on import (what an author writes)."""
from unidist.engines.local.manager import LocalManager
from unidist.engines.training import unidist_training
from unidist.registry import Backend, Launch, register


class SixthManager(LocalManager):
    name = "{NAME}"


BACKEND = register(Backend(
    name="{NAME}",
    manager_name="SixthManager",
    manager=lambda: SixthManager,
    strategy=unidist_training,
    requires=("{PACKAGE}",),
    install="pip install unidist-sixth-pkg",
    env_prefixes=("SIXTH_",),
    launches=(Launch("none", "{NAME}-{{n}}", (1,)),),
), replace=True)
'''


def _write_plugin(where: Path) -> None:
    """The plugin module, its stand-in package, and the dist-info declaring the entry point, in ``where``."""
    (where / "unidist_sixth_backend.py").write_text(PLUGIN)
    (where / PACKAGE).mkdir()
    (where / PACKAGE / "__init__.py").write_text('__version__ = "6.0"\n')
    info = where / "unidist_sixth-0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: unidist-sixth\nVersion: 0\n")
    (info / "entry_points.txt").write_text(f"[{registry.ENTRY_POINTS}]\n{NAME} = unidist_sixth_backend\n")


@pytest.fixture
def sixth(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[registry.Backend]:
    """The sixth engine registered in this process (by importing its plugin module, whose one ``register`` call
    passes ``replace=True``), its package importable here and in the children; unregistered afterwards."""
    _write_plugin(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")]))
    # a fresh module each time (an import by name would be cached, and register once for the whole session)
    spec = importlib.util.spec_from_file_location("sixth_in_process", tmp_path / "unidist_sixth_backend.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    try:
        spec.loader.exec_module(module)
        yield registry.get(NAME)
    finally:
        registry.unregister(NAME)
    assert NAME not in registry.names()


def test_unidist_backend_selects_it(sixth: registry.Backend) -> None:
    import torch

    cls = select(environ={"UNIDIST_BACKEND": NAME})
    assert cls.__name__ == "SixthManager" and cls is sixth.manager()
    assert backend_for(Config(backend=NAME), LaunchInfo(launcher="none")) == NAME
    assert unidist.SixthManager is cls  # type: ignore[attr-defined]  # the record's manager_name
    with unidist.init(environ={"UNIDIST_BACKEND": NAME, "UNIDIST_DEVICE": "cpu"}) as mgr:
        assert type(mgr) is cls and mgr.backend == NAME and mgr.size == 1
        assert mgr.allreduce(torch.tensor([1.0, 2.0])).tolist() == [1.0, 2.0]


def test_info_lists_it_and_init_would_pick_it(sixth: registry.Backend, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    from unidist import cli

    monkeypatch.setenv("UNIDIST_BACKEND", NAME)
    assert cli.main(["info", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["backends"][NAME] == "usable"
    assert report["backend"] == NAME and report["manager"] == "SixthManager"
    assert PACKAGE in report["packages"]  # the versions reported include the packages its record requires
    assert cli.main(["info"]) == 0
    text = capsys.readouterr().out
    assert f"{NAME} (usable)" in text and f"init() would pick: {NAME} (SixthManager)" in text
    assert "SIXTH_" in cli._forwarded()  # its variables reach the processes `unidist launch --hosts` starts


def test_info_check_judges_it(sixth: registry.Backend, monkeypatch: pytest.MonkeyPatch,
                              capsys: pytest.CaptureFixture[str]) -> None:
    """``unidist info --check``: the sixth engine's package imported for real in the probe child, the engine usable
    and running here; a second one whose package is absent named with its install command. The packages of the
    engines unidist ships are answered as absent and no launcher is asked (their real probe, seconds each, is
    test_doctor's and tests/multiproc/test_cli.py's)."""
    from unidist import cli
    from unidist.doctor import ask, render

    asked: list[str] = []
    probe = ask.ask_packages

    def ours_only(packages: list[str], environ: Any, limit: float = 20.0) -> dict[str, Any]:
        asked.extend(packages)
        mine = [pkg for pkg in packages if pkg.startswith("unidist_sixth")]
        return {**{pkg: {"ok": False, "absent": True, "error": "not installed"} for pkg in packages},
                **probe(mine, environ, limit)}
    monkeypatch.setattr(ask, "ask_packages", ours_only)
    monkeypatch.setattr(ask, "ask_programs", lambda limit=20.0: {})
    absent = dataclasses.replace(sixth, name=f"{NAME}_absent", requires=("unidist_sixth_absent_pkg",),
                                 install="pip install unidist-sixth-absent", launches=())
    registry.register(absent)
    try:
        monkeypatch.setenv("UNIDIST_BACKEND", NAME)
        code = cli.main(["info", "--check", "--json"])
        check = json.loads(capsys.readouterr().out)["check"]
    finally:
        registry.unregister(absent.name)
    assert PACKAGE in asked and "unidist_sixth_absent_pkg" in asked  # the check asks what the records require
    assert check["packages"][PACKAGE] == {"ok": True, "version": "6.0"}  # imported for real in the probe child
    assert check["packages"]["unidist_sixth_absent_pkg"]["absent"]
    assert check["backends"][NAME] == {"usable": True, "problems": [], "notes": []}
    assert check["would_run"] == NAME and code == check["exit_code"] == 0
    assert check["backends"][absent.name]["problems"] == [
        "needs unidist_sixth_absent_pkg: pip install unidist-sixth-absent"]
    text = "\n".join(render.lines(check))
    assert f"  {NAME:<10} usable (runs here)" in text and f"verdict: {NAME} works here (exit 0)" in text
    assert f"{absent.name} NOT usable" in text


def _collectives(tmp_path: Path, backend: str, launcher: str) -> list[str]:
    """collectives JSON files of ``backend`` at 2 and 3 ranks (MPICH's algorithms on made-up costs), and gamma."""
    files = []
    for ranks in (2, 3):
        rows = []
        for op in ("allreduce", "allgather"):
            for n in (8, 1 << 10, 64 << 10, 1 << 20):
                alg = costmodel.choose("mpich", op, ranks, n)
                a, b, c = costmodel.coefficients(op, alg, ranks, n)
                seconds = a * 5e-6 + b * 2e-10 + c * 1e-10
                rows.append({"bench": "collectives", "backend": backend, "launcher": launcher, "ranks": ranks,
                             "op": op, "bytes": n, "time_us": seconds * 1.1e6, "raw_time_us": seconds * 1e6})
        path = tmp_path / f"{backend}-{ranks}.json"
        path.write_text(json.dumps({"meta": {"backend": backend, "launcher": launcher, "ranks": ranks}, "rows": rows}))
        files.append(str(path))
    gamma = [{"bench": "gamma", "bytes": n, "seconds": n * 1e-10} for n in (1 << 20, 4 << 20, 16 << 20)]
    (tmp_path / "gamma.json").write_text(json.dumps({"meta": {"bench": "gamma"}, "rows": gamma}))
    return [*files, str(tmp_path / "gamma.json")]


def test_cost_model_refuses_it_until_its_record_documents_algorithms(
        sixth: registry.Backend, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from unidist.bench.__main__ import main

    files = _collectives(tmp_path, NAME, "mpich")
    assert costmodel.engine_kind(NAME, "mpich") is None  # not "gloo", not "mpich": nobody said
    with pytest.raises(InvalidArgumentError, match=rf"{NAME} \(mpich\): no documented collective algorithms"):
        main(["model", *files])
    assert main(["model", *files, "--policy", "min"]) == 0  # asked for: the fastest formula, said so
    assert f"| {NAME} (mpich) | unknown | allreduce |" in capsys.readouterr().out
    registry.register(dataclasses.replace(sixth, raw=registry.RawEngine(algorithms={"mpich": "mpich"})), replace=True)
    assert costmodel.engine_kind(NAME, "mpich") == "mpich" and costmodel.engine_kind(NAME, "torchrun") is None
    assert main(["model", *files, "--fit-ranks", "2"]) == 0
    text = capsys.readouterr().out
    assert f"| {NAME} (mpich) | mpich | allreduce |" in text
    assert f"| {NAME} (mpich) | 3 | 8 of 8 | 0% |" in text  # fitted on 2 ranks, 3 predicted from its algorithms
    registry.register(dataclasses.replace(sixth, raw=registry.RawEngine(algorithms={"*": "nccl"})), replace=True)
    with pytest.raises(InvalidArgumentError, match="does not know"):
        costmodel.engine_kind(NAME, "mpich")


def test_the_test_suites_launch_it_from_its_record(sixth: registry.Backend) -> None:
    import helpers

    launch = helpers._all_launches()[f"{NAME}-1"]  # what helpers.LAUNCHES is made from
    assert (launch.backend, launch.launcher, launch.size, launch.engines) == (NAME, "none", 1, (PACKAGE,))
    assert launch.own_training  # prepare runs unidist's DistributedOptimizer: the record's strategy says so
    assert f"{NAME}-1" in helpers.solo_launches()
    assert launch.command("script.py") == [sys.executable, "script.py"]


def test_a_fresh_process_finds_it_through_its_entry_point(tmp_path: Path) -> None:
    """Installed, not imported: ``UNIDIST_BACKEND=sixth unidist info`` loads its entry point, picks and lists it."""
    _write_plugin(tmp_path)
    env = {**os.environ, "UNIDIST_BACKEND": NAME,
           "PYTHONPATH": os.pathsep.join([str(tmp_path), SRC, os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run([sys.executable, "-m", "unidist.cli", "info", "--json"], env=env, capture_output=True,
                         text=True, timeout=120, check=True).stdout
    report = json.loads(out)
    assert report["backend"] == NAME and report["manager"] == "SixthManager"
    assert report["backends"][NAME] == "usable"


def test_a_record_holds_what_registration_needs() -> None:
    """The registration's fields are what selecting, starting, installing and training an engine need; what only the
    benchmarks read is one optional object (``raw``), which the sixth engine leaves out."""
    fields = [f.name for f in dataclasses.fields(registry.Backend)]
    assert fields == ["name", "manager_name", "manager", "strategy", "requires", "install", "launcher", "implied_by",
                      "needs_pmi", "distributions", "env_prefixes", "launches", "raw"]
    built_in = {"mpi", "torch", "deepspeed", "horovod"}
    assert all(rec.raw.api != "none" for rec in registry.records() if rec.name in built_in)
    assert "raw" not in PLUGIN
