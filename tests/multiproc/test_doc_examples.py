"""Every python block of the README and the docs marked ``<!-- run: LAUNCHER [-n N] -->`` runs as written under
that launcher (tests/docsource.py says how blocks are marked): written to a file, started in a fresh directory,
it must exit 0 and print the lines of the ``title="output"`` block after it, if it has one. A bash block marked
``<!-- run: shell -->`` runs as one ``bash -e`` script in a fresh directory where ``examples/``,
``launch_scripts/`` and ``benchmarks/`` are the clone's, with the same checks. The figure the Getting started
page states for the main job is checked here too."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from docsource import DOCS, ROOT, Block, output_matches, runnable
from helpers import BIN, deepspeed, horovodrun, mpiexec, python, require, run, torchrun

LAUNCHERS = {"python": (python, None, None), "mpiexec": (mpiexec, pytest.mark.mpi, "mpi4py"),
             "torchrun": (torchrun, pytest.mark.torch, "torch"),
             "deepspeed": (deepspeed, pytest.mark.deepspeed, "deepspeed"),
             "horovodrun": (horovodrun, pytest.mark.horovod, "horovod")}


def _distinct(blocks: list[Block]) -> list[Block]:
    """Each (launcher, script) once, where it first appears: the README's example is also the home page's."""
    seen: dict[tuple[str | None, str], Block] = {}
    for b in blocks:
        seen.setdefault((b.run, b.body), b)
    return list(seen.values())


BLOCKS = _distinct([b for b in runnable(*LAUNCHERS) if b.lang == "python"])
SHELL = runnable("shell")
# the engine a shell block's launcher needs: (word in the block, pytest mark, what require() looks for)
SHELL_ENGINES = (("deepspeed", pytest.mark.deepspeed, "deepspeed"), ("horovod", pytest.mark.horovod, "horovod"),
                 ("torchrun", pytest.mark.torch, "torch"), ("mpiexec", pytest.mark.mpi, "mpi4py"))


def _spec(block: Block) -> tuple[str, int, dict[str, str]]:
    """``mpiexec -n 2 UNIDIST_X=1``: the launcher, its process count, variables for the ranks."""
    words = shlex.split(block.run or "")
    n = int(words[words.index("-n") + 1]) if "-n" in words else 1
    env = dict(w.split("=", 1) for w in words if "=" in w)
    return words[0], n, env


def _param(block: Block) -> object:
    mark = LAUNCHERS[_spec(block)[0]][1]
    return pytest.param(block, id=f"{block.where}-{block.run}".replace(" ", ""), marks=[mark] if mark else [])


def test_examples_found() -> None:
    assert len(BLOCKS) >= 8, [b.where for b in BLOCKS]


@pytest.mark.parametrize("block", [_param(b) for b in BLOCKS])
def test_doc_example(block: Block, tmp_path: Path) -> None:
    launcher, n, env = _spec(block)
    argv_of, _, engine = LAUNCHERS[launcher]
    if engine:
        require(engine)
    script = tmp_path / "example.py"
    script.write_text(block.body)
    proc = run(argv_of(n, str(script)), env=env, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{block.where}\n{proc.describe()}"
    if block.output is not None:
        missing = output_matches(block.output, proc.stdout)
        assert missing is None, f"{block.where}: {missing}\n{proc.describe()}"


def _shell_engine(block: Block) -> tuple[pytest.MarkDecorator, str] | None:
    return next(((mark, engine) for word, mark, engine in SHELL_ENGINES if word in block.body), None)


@pytest.mark.parametrize("block", [pytest.param(b, id=b.where, marks=[e[0]] if (e := _shell_engine(b)) else [])
                                   for b in SHELL])
def test_doc_shell_block(block: Block, tmp_path: Path) -> None:
    engine = _shell_engine(block)
    if engine:
        require(engine[1])
    for name in ("examples", "launch_scripts", "benchmarks"):
        (tmp_path / name).symlink_to(ROOT / name)
    proc = run(["bash", "-ec", block.body], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, f"{block.where}\n{proc.describe()}"
    if block.output is not None:
        missing = output_matches(block.output, proc.stdout)
        assert missing is None, f"{block.where}: {missing}\n{proc.describe()}"


@pytest.mark.mpi
def test_main_job_reaches_the_accuracy_the_pages_state() -> None:
    """The README's main job, whole (20 epochs, about 15 s): the accuracy the README and Getting started quote
    is what it prints, on 2 ranks."""
    require("mpi4py")
    stated = {m.group(1) for p in (ROOT / "README.md", DOCS / "getting-started.md")
              for m in re.finditer(r"reaches ([\d.]+)%\s+test\s+accuracy", p.read_text())}
    assert stated, "neither the README nor docs/getting-started.md states the main job's accuracy any more"
    proc = run([str(BIN / "unidist"), "launch", "-n", "2", "examples/train_digits.py"], cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.describe()
    m = re.search(r"final test accuracy ([\d.]+)", proc.stdout)
    assert m, proc.describe()
    assert stated == {f"{100 * float(m.group(1)):.1f}"}, (m.group(0), stated)
