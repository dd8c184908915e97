"""The code blocks of the README and the documentation pages (docs/**/*.md), and how each is marked.

Every fenced block is one of (tests/unit/test_doc_blocks.py checks it):

- runnable: preceded by ``<!-- run: KIND ARGS -->``. KIND says which test runs it, as written:
  ``ci`` (the README's two commands: .ci/run runs them, tests/unit/test_docs.py checks the lines match),
  ``launch`` (each line a command: tests/multiproc/test_readme.py), ``bench`` (tests/multiproc/test_bench.py),
  ``cluster`` and ``cluster allocation`` (tests/cluster/test_readme_cluster.py, on the simulated cluster),
  ``timeline`` (tests/multiproc/test_readme.py), ``elastic`` (the Horovod page's elastic example, its commands
  in order: tests/multiproc/test_hvd_elastic.py), and for a ``python`` block the launcher it runs under:
  ``python``, ``mpiexec -n N``, ``torchrun -n N``, ``deepspeed -n N``, ``horovodrun -n N``
  (tests/multiproc/test_doc_examples.py);
- the output of the runnable block just before it: ``title="output"`` in the fence's info string. Its lines
  must appear in that order in what the block printed; ``...`` inside a line matches anything, a line that is
  only ``...`` any number of lines;
- a fragment, visibly: a ``title="Fragment..."`` (code that needs names from around it) or ``title="Excerpt..."``
  (an abridged message or file) in the info string, shown as the block's title on the site.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
SOURCES = [ROOT / "README.md",
           *sorted(p for p in DOCS.rglob("*.md") if not p.relative_to(DOCS).parts[0].startswith("_"))]

_FENCE = re.compile(r"^(?P<indent>[ \t]*)(?P<fence>```+)(?P<info>[^\n`]*)\n(?P<body>.*?)^(?P=indent)(?P=fence)[ \t]*$",
                    re.S | re.M)
_RUN = re.compile(r"<!-- run: (?P<spec>[^>]*?) -->\s*$")
_TITLE = re.compile(r'title="(?P<title>[^"]*)"')


@dataclass(frozen=True)
class Block:
    path: Path
    line: int          # 1-based line of the opening fence
    lang: str
    title: str
    run: str | None    # the spec of its <!-- run: ... --> marker
    body: str
    output: str | None = None  # the body of the output block after it, if any

    @property
    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}"

    @property
    def kind(self) -> str:
        return (self.run or "").split(" ")[0]


def _dedent(body: str, indent: str) -> str:
    return "".join(line[len(indent):] if line.startswith(indent) else line for line in body.splitlines(True))


def blocks(path: Path) -> list[Block]:
    text = path.read_text()
    out: list[Block] = []
    for m in _FENCE.finditer(text):
        before = text[: m.start()].rstrip("\n ").rsplit("\n", 1)[-1]
        run = _RUN.search(before)
        info = m.group("info").strip()
        title = _TITLE.search(info)
        block = Block(path, text.count("\n", 0, m.start()) + 1, info.split(" ")[0] if info else "",
                      title.group("title") if title else "", run.group("spec").strip() if run else None,
                      _dedent(m.group("body"), m.group("indent")))
        if block.title == "output" and out and out[-1].run is not None:
            prev = out.pop()
            out.append(Block(prev.path, prev.line, prev.lang, prev.title, prev.run, prev.body, block.body))
        out.append(block)
    return out


def all_blocks() -> list[Block]:
    return [b for p in SOURCES for b in blocks(p)]


def runnable(*kinds: str) -> list[Block]:
    """The runnable blocks of these kinds (``run: KIND ...``), README first, then the pages in path order."""
    return [b for b in all_blocks() if b.run is not None and b.kind in kinds]


def commands(block: Block) -> list[str]:
    """A bash block's command lines, without comments and without the venv's activation (the tests put the
    venv's bin first on PATH)."""
    out = []
    for line in block.body.splitlines():
        cmd = line.split("  #")[0].strip()
        if cmd and not cmd.startswith("#") and not re.fullmatch(r"(source|\.) \.venv/bin/activate", cmd):
            out.append(cmd)
    return out


def output_matches(shown: str, printed: str) -> str | None:
    """None when every line ``shown`` appears in ``printed`` in order (``...`` wildcards); else what is missing."""
    lines = [ln.rstrip() for ln in printed.splitlines()]
    i = 0
    for want in (w.rstrip() for w in shown.strip("\n").splitlines()):
        if want.strip() == "...":  # other lines may come between any two anyway (ranks interleave)
            continue
        pattern = re.compile(".*".join(re.escape(part) for part in want.split("...")) + r"\Z")
        while i < len(lines) and not pattern.match(lines[i]):
            i += 1
        if i == len(lines):
            return f"not printed (in order): {want!r}"
        i += 1
    return None
