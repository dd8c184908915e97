"""No figure on a page can drift from what the code does or what a command printed.

A figure in prose (a time, a ratio, a share, a bandwidth, outside code blocks) is one of:
- included from a generated file (a link to ``benchmarks/records/*.md`` or RESULTS.md that the site replaces by
  the table, docs/_hooks/site.py): not written in the page;
- a setting or constant of the code: listed in FIGURES with where it lives, and compared with it here;
- a bound a test asserts, a target, a shape or a fact of the world: listed in FIGURES with the reason.
A new measured figure typed into a page fails here: measure it into a record instead (benchmarks/records.sh).
Records must say what made them (the command, the machine, the load) and be included by some page.
"""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest
from docsource import ROOT, SOURCES

from unidist.bench.record import HEADER


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


FIGURE = re.compile(r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:-\d+(?:\.\d+)?)?\s?"
                    r"(?:us|ms|s|x|%|GB/s|MB/s|min|minutes|seconds)(?!\w)")
FENCE = re.compile(r"^\s*```")
RECORDS = ROOT / "benchmarks" / "records"
SITE = _load("docs_site_hook", ROOT / "docs" / "_hooks" / "site.py")  # the site's include lines, read as it reads them
INCLUDE = SITE.INCLUDE

# (page, figure) -> "=module:NAME" (the figure is that constant's value; % of a fraction) or "why: reason"
FIGURES: dict[tuple[str, str], str] = {
    ("README.md", "98.1%"): "why: tests/multiproc/test_doc_examples.py runs the main job and compares",
    ("docs/getting-started.md", "98.1%"): "why: tests/multiproc/test_doc_examples.py runs the main job and compares",
    ("docs/reliability.md", "15 s"): "=unidist.comm.watchdog:BACKSTOP_GRACE",
    ("docs/reliability.md", "10 s"): "=unidist.comm.watchdog:ENGINE_GRACE",
    ("docs/reliability.md", "30 s"): "=unidist.engines.horovod.manager:HOROVOD_GLOO_TIMEOUT",
    ("docs/reliability.md", "60 s"): "=unidist.config:Config.stall_warning",
    ("docs/reliability.md", "1 s"): "why: the watchdog's period, min(1.0, ...) in unidist/comm/watchdog.py",
    ("docs/reliability.md", "2 s"): "why: the warning tests/multiproc/test_stalls.py sets",
    ("docs/reliability.md", "5 s"): "why: the bound tests/multiproc/test_stalls.py asserts (WARNING + 5)",
    ("docs/reliability.md", "3 s"): "=unidist.comm.check:EXPLAIN_WAIT",
    ("docs/reliability.md", "1%"): "=unidist.comm.check:TARGET",
    ("docs/reliability.md", "1.05x"): "why: a target (issue 11), said to be missed at 64 KiB",
    ("docs/reliability.md", "~1 ms"): "why: gloo's small-call latency (RESULTS.md's 8 B rows)",
    ("docs/launchers/slurm.md", "15 s"): "why: the bound tests/slurm/test_slurm.py asserts for scancel",
    ("docs/settings.md", "10 s"): "=unidist.comm.watchdog:ENGINE_GRACE",
    ("docs/settings.md", "~1%"): "=unidist.comm.check:TARGET",
    ("docs/several-hosts.md", "15 s"): "=unidist.comm.watchdog:BACKSTOP_GRACE",
    ("docs/several-hosts.md", "2 s"): "=unidist.comm.processes:AGENT_GRACE",
    ("docs/several-hosts.md", "~15 minutes"): "why: Linux's TCP retransmission limit (tcp_retries2), not ours",
    ("docs/training.md", "4 x"): "why: a model's shape (4 layers of 1024 x 1024), not a measurement",
    ("docs/training.md", "2 x"): "why: a model's shape (2 Linear layers a block), not a measurement",
    ("docs/verify.md", "120 s"): "=unidist.verify:LOCATE_BUDGET",
}


def prose_figures(path: Path) -> list[tuple[int, str]]:
    """(line, figure) for every figure outside fenced blocks and include lines."""
    found, inside = [], False
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if FENCE.match(line):
            inside = not inside
            continue
        if inside or INCLUDE.match(line):
            continue
        found += [(number, m.group()) for m in FIGURE.finditer(line)]
    return found


def _value(figure: str) -> float:
    number = float(re.sub(r"[^\d.]", "", figure.split()[0] if " " in figure else re.sub(r"[a-z/%]+$", "", figure)))
    return number / 100 if figure.endswith("%") else number


def _constant(ref: str) -> float:
    module, _, name = ref[1:].partition(":")
    obj: object = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)
    return float(obj)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_figure_is_generated_or_checked(path: Path) -> None:
    page = str(path.relative_to(ROOT))
    for line, figure in prose_figures(path):
        how = FIGURES.get((page, figure))
        assert how, (f"{page}:{line}: {figure!r} is typed into the page: put measurements in a record "
                     f"(benchmarks/records.sh) and include it, or list a setting in FIGURES with where it lives")


@pytest.mark.parametrize(("key", "how"), [(k, v) for k, v in FIGURES.items() if v.startswith("=")],
                         ids=lambda x: x if isinstance(x, str) else "/".join(x))
def test_settings_stated_are_the_codes(key: tuple[str, str], how: str) -> None:
    page, figure = key
    assert _value(figure) == pytest.approx(_constant(how)), f"{page} says {figure}; {how[1:]} is {_constant(how)}"


def test_every_listed_figure_is_still_on_its_page() -> None:
    stale = [k for k in FIGURES if k[1] not in {f for _, f in prose_figures(ROOT / k[0])}]
    assert not stale, f"listed in FIGURES but no longer on the page (remove them): {stale}"


def test_records_say_what_made_them_and_are_shown() -> None:
    records = sorted(RECORDS.glob("*.md"))
    assert records, "benchmarks/records/ is empty: run benchmarks/records.sh"
    script = (ROOT / "benchmarks" / "records.sh").read_text()
    included = {m.group("path") for p in SOURCES for m in INCLUDE.finditer(p.read_text())}
    for record in records:
        text, rel = record.read_text(), str(record.relative_to(ROOT))
        assert text.startswith(HEADER), f"{rel}: not written by python -m unidist.bench.record"
        assert "machine: " in text and "load average" in text, f"{rel}: says neither the machine nor the load"
        assert f"$out/{record.name}" in script, f"{rel}: benchmarks/records.sh does not regenerate it"
        assert rel in included, f"{rel}: no page includes it"
    for page in SOURCES:  # each include line's link leads where its text says, as the site's hook checks
        for m in INCLUDE.finditer(page.read_text()):
            SITE.included(page, m)


def test_no_page_shows_a_bare_include_line() -> None:
    """Read as plain markdown (GitHub, an editor), a page shows a link where the site shows a table, never a
    snippet directive such as ``--8<--``."""
    bare = [f"{p.relative_to(ROOT)}:{n}" for p in SOURCES for n, line in enumerate(p.read_text().splitlines(), 1)
            if line.startswith("--8<--")]
    assert not bare, f"bare include lines (write [path](link) <!-- the site shows it here --> instead): {bare}"
