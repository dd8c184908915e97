"""Every python block of the README and the docs marked ``<!-- run: LAUNCHER [-n N] -->`` runs as written under
that launcher (tests/docsource.py says how blocks are marked): written to a file, started in a fresh directory,
it must exit 0 and print the lines of the ``title="output"`` block after it, if it has one."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
from docsource import Block, output_matches, runnable
from helpers import deepspeed, horovodrun, mpiexec, python, require, run, torchrun

LAUNCHERS = {"python": (python, None, None), "mpiexec": (mpiexec, pytest.mark.mpi, "mpi4py"),
             "torchrun": (torchrun, pytest.mark.torch, "torch"),
             "deepspeed": (deepspeed, pytest.mark.deepspeed, "deepspeed"),
             "horovodrun": (horovodrun, pytest.mark.horovod, "horovod")}
BLOCKS = [b for b in runnable(*LAUNCHERS) if b.lang == "python"]


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
