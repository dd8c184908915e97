"""The house keeps its own rules: every module is on the map (docs/architecture.md) with its job, the Engine
contract there names every method and setting of ``Engine``, no file of the package is over 500 lines, and no
comment or docstring of the package or the tests cites a file (a module, a page) that does not exist. Fast: reads
files, imports only ``unidist.comm.engine``."""

from __future__ import annotations

import ast
import io
import re
import tokenize
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository (tox tests an installed unidist: read the sources here)
PKG = ROOT / "unidist"
TESTS = ROOT / "tests"
MAP = ROOT / "docs" / "architecture.md"
MAX_LINES = 500


def _modules() -> list[str]:
    return sorted(str(p.relative_to(ROOT)) for p in PKG.rglob("*.py"))


def test_every_module_is_on_the_map_with_its_job() -> None:
    text = MAP.read_text()
    rows = dict(re.findall(r"^\| `(unidist/[\w/]+\.py)` \| (.+?) \|$", text, re.M))
    missing = [m for m in _modules() if m not in rows]
    assert not missing, f"docs/architecture.md lacks these modules (add a row: | `path` | its job |): {missing}"
    gone = [m for m in rows if not (ROOT / m).exists()]
    assert not gone, f"docs/architecture.md lists modules that do not exist: {gone}"
    assert all(len(job.strip()) > 8 for job in rows.values()), "every row says the module's job"


def test_the_engine_contract_names_every_method_and_setting() -> None:
    from unidist.comm.engine import Engine

    section = MAP.read_text().split("## The Engine contract", 1)[1].split("\n## ", 1)[0]
    names = [n for n in vars(Engine) if not n.startswith("__") and (not n.startswith("_") or n == "_split")]
    assert len(names) > 30, names
    unnamed = [n for n in names if f"`{n}" not in section]
    assert not unnamed, f"docs/architecture.md's Engine contract does not name: {unnamed}"


def test_no_file_over_500_lines() -> None:
    big = {m: n for m in _modules() if (n := len((ROOT / m).read_text().splitlines())) > MAX_LINES}
    assert not big, f"files over {MAX_LINES} lines (split them by job): {big}"


_CITED = re.compile(r"(?<![\w./-])((?:[\w-]+/)*[\w-]+\.(?:py|md|sh|toml|ini|cfg|txt|yml|sbatch))\b")


def _texts(path: Path) -> list[tuple[int, str]]:
    """The comments and docstrings of ``path``, with their line numbers."""
    out = []
    for tok in tokenize.generate_tokens(io.StringIO(path.read_text()).readline):
        if tok.type == tokenize.COMMENT:
            out.append((tok.start[0], tok.string))
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            doc = ast.get_docstring(node, clean=False)
            if doc:
                out.append((node.body[0].lineno, doc))
    return out


# the first folders of a path that is ours: the repository's, or the package's folders
_OURS = {"unidist", "tests", "docs", "examples", "benchmarks", "launch_scripts", ".ci", "comm", "train", "managers",
         "engines", "checkpoint", "bench", "doctor", "parallel", "compat"}
# engines' own files cited by their bare name outside compat/ (compat/ cites its engine's sources throughout and
# is checked only for paths that start with one of ours)
_UPSTREAM = {"c10d_rendezvous_backend.py": "torch.distributed.elastic", "loss_scaler.py": "DeepSpeed's fp16 scaler",
             "script.py": "the user's script, as in python script.py"}


def _exists(cited: str, where: Path) -> bool:
    """A cited path of ours resolves from the repository root, the package, or the citing file's folder or any
    folder above it inside the package (``trainer.py`` beside the citing module, ``comm/check.py`` anywhere)."""
    bases = [ROOT, PKG, *[p for p in where.parents if p.is_relative_to(ROOT) and p != ROOT]]
    if any((b / cited).exists() for b in bases):
        return True
    # a module or page named by its file name alone
    tops = (PKG, TESTS, ROOT / "docs", ROOT / "examples", ROOT / "benchmarks")
    return "/" not in cited and any(any(top.rglob(cited)) for top in tops)


def _ours(cited: str, where: Path) -> bool:
    if where.is_relative_to(TESTS / "data"):  # engines' own files, kept as they are (they cite their repository)
        return False
    first = cited.split("/", 1)[0]
    if "/" in cited:
        return first in _OURS and not (where.is_relative_to(PKG / "compat") and first not in ("unidist", "tests",
                                                                                              "docs", "examples"))
    return cited.endswith((".py", ".md")) and cited not in _UPSTREAM and not where.is_relative_to(PKG / "compat")


def test_no_comment_cites_a_file_that_does_not_exist() -> None:
    wrong = []
    for path in sorted([*PKG.rglob("*.py"), *TESTS.rglob("*.py")]):
        for line, text in _texts(path):
            for cited in _CITED.findall(text):
                if _ours(cited, path) and not _exists(cited, path):
                    wrong.append(f"{path.relative_to(ROOT)}:{line} cites {cited}")
    assert not wrong, "comments or docstrings citing files that do not exist:\n" + "\n".join(wrong)
