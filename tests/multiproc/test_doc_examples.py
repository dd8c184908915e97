"""Every python block of the README and the docs marked ``<!-- run: LAUNCHER [-n N] -->`` runs as written under
that launcher (tests/docsource.py says how blocks are marked): written to a file, started in its page's
directory, it must exit 0 and print the lines of the ``title="output"`` block after it, if it has one. A bash
block marked ``<!-- run: shell -->`` runs as one ``bash -e`` script there, where ``examples/``,
``launch_scripts/`` and ``benchmarks/`` are the clone's, with the same checks. A page's blocks run one after the
other in one directory, as a reader trying them in page order would (a block that left ``ckpt/`` behind once made
the next one's resume fail). The figure the Getting started page states for the main job is checked here too."""

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


_PAGE_DIRS: dict[Path, Path] = {}


def _page_dir(block: Block, factory: pytest.TempPathFactory) -> Path:
    """The directory every runnable block of ``block``'s page runs in, in page order (the parametrized tests run
    in the order the blocks appear), with the clone's examples, launch scripts and benchmarks beside them."""
    if block.path not in _PAGE_DIRS:
        where = factory.mktemp(block.path.stem)
        for name in ("examples", "launch_scripts", "benchmarks"):
            (where / name).symlink_to(ROOT / name)
        _PAGE_DIRS[block.path] = where
    return _PAGE_DIRS[block.path]


def test_examples_found() -> None:
    assert len(BLOCKS) >= 8, [b.where for b in BLOCKS]


def _shell_engine(block: Block) -> tuple[pytest.MarkDecorator, str] | None:
    return next(((mark, engine) for word, mark, engine in SHELL_ENGINES if word in block.body), None)


def _shell_param(block: Block) -> object:
    engine = _shell_engine(block)
    return pytest.param(block, id=block.where, marks=[engine[0]] if engine else [])


# every runnable block, python and shell, in page order (the order pytest runs the parameters in)
IN_PAGE_ORDER = sorted([*BLOCKS, *SHELL], key=lambda b: (str(b.path), b.line))


def _torch_teardown_abort(block: Block, stdout: str, stderr: str) -> bool:
    """A plain torch.distributed block (a page's "before", no unidist in it) that printed all it should and then
    aborted in gloo's teardown ("terminate called without an active exception": gloo's worker threads at
    interpreter exit, pytorch/pytorch#190489; once in CI, on docs/coming-from/ddp.md's DDP script, which calls
    destroy_process_group). Not unidist's code: such a block is run once more. A unidist block never is."""
    return ("unidist" not in block.body and "terminate called without an active exception" in stderr
            and (block.output is None or output_matches(block.output, stdout) is None))


@pytest.mark.parametrize("block", [_param(b) if b.lang == "python" else _shell_param(b) for b in IN_PAGE_ORDER])
def test_doc_block(block: Block, tmp_path_factory: pytest.TempPathFactory) -> None:
    where = _page_dir(block, tmp_path_factory)
    if block.lang == "python":
        launcher, n, env = _spec(block)
        argv_of, _, engine = LAUNCHERS[launcher]
        if engine:
            require(engine)
        script = where / f"example-{block.line}.py"
        script.write_text(block.body)
        proc = run(argv_of(n, str(script)), env=env, cwd=where, timeout=300)
        if proc.returncode != 0 and _torch_teardown_abort(block, proc.stdout, proc.stderr):
            proc = run(argv_of(n, str(script)), env=env, cwd=where, timeout=300)  # once more; see the helper
    else:
        shell = _shell_engine(block)
        if shell:
            require(shell[1])
        proc = run(["bash", "-ec", block.body], cwd=where, timeout=300)
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
