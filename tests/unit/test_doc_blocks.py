"""The README and the documentation pages keep their promises (tests/docsource.py says how blocks are marked):
every code block is run by a test or visibly a fragment; every error class has its Troubleshooting section;
every page is in the site's navigation; installs come from the clone with constraints.txt; figures and paths
the pages state match the code. Fast: no launch, no mkdocs (the docs tox env builds the site)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from docsource import DOCS, ROOT, SOURCES, all_blocks, commands, runnable

RUN_KINDS = {"ci", "tox", "install", "launch", "bench", "cluster", "timeline", "elastic", "shell",
             "python", "mpiexec", "torchrun", "deepspeed", "horovodrun"}
PYTHON_KINDS = {"python", "mpiexec", "torchrun", "deepspeed", "horovodrun"}
TEXTS = {p: p.read_text() for p in SOURCES}


def test_sources_found() -> None:
    assert ROOT / "README.md" in SOURCES and len(SOURCES) >= 30, SOURCES


@pytest.mark.parametrize("block", all_blocks(), ids=lambda b: b.where)
def test_every_block_is_run_or_a_visible_fragment(block: object) -> None:
    b = block
    assert b.run is not None or b.title == "output" or b.title.startswith(("Fragment", "Excerpt")), (  # type: ignore[attr-defined]
        f"{b.where}: mark this block <!-- run: KIND --> (tests/docsource.py) or give it "  # type: ignore[attr-defined]
        f'title="Fragment: ..." / title="Excerpt: ..." in its info string')


def test_run_markers_name_a_test_and_fit_the_block() -> None:
    for b in all_blocks():
        if b.run is None:
            continue
        assert b.kind in RUN_KINDS, f"{b.where}: unknown run kind {b.kind!r} (one of {sorted(RUN_KINDS)})"
        want = "python" if b.kind in PYTHON_KINDS else "bash"
        assert b.lang == want, f"{b.where}: a {b.kind} block is ```{want}, not ```{b.lang}"
        if b.title == "output":
            raise AssertionError(f"{b.where}: an output block follows a runnable one; it is not run itself")


def test_output_blocks_follow_a_runnable_block() -> None:
    for path in SOURCES:
        text = TEXTS[path]
        for m in re.finditer(r'```text title="output"', text):
            before = text[: m.start()].rstrip()
            assert before.endswith("```"), f"{path.name}: an output block must follow its runnable block"
    with_output = [b for b in all_blocks() if b.output is not None]
    assert len(with_output) >= 8, [b.where for b in with_output]


def test_ci_blocks_are_what_ci_runs() -> None:
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    blocks = runnable("ci")
    assert {b.path.name for b in blocks} >= {"README.md", "getting-started.md"}, [b.where for b in blocks]
    for b in blocks:
        for cmd in commands(b):
            assert cmd in ci, f"{b.where}: {cmd!r} is not a line of .ci/run"


def test_tox_blocks_name_envs_ci_runs() -> None:
    env_list = re.search(r"(?m)^env_list = (.*)$", (ROOT / "tox.ini").read_text())
    assert env_list
    envs = {e.strip() for e in env_list.group(1).split(",")}
    assert "python3 -m tox" in (ROOT / ".ci" / "run").read_text()
    for b in runnable("tox"):
        for cmd in commands(b):
            m = re.fullmatch(r"python3 -m tox -e (\w+)", cmd)
            assert m and m.group(1) in envs, f"{b.where}: {cmd!r} is not an env `python3 -m tox` runs"


def test_install_lines_are_what_the_tox_envs_install() -> None:
    tox = (ROOT / "tox.ini").read_text()
    pyproject = (ROOT / "pyproject.toml").read_text()
    extras_in_tox = {e.strip() for line in re.findall(r"(?m)^extras = (.*)$", tox) for e in line.split(",")}
    lines = [cmd for b in runnable("install") for cmd in commands(b)]
    assert any("install_horovod.sh" in c for c in lines) and len(lines) >= 3, lines
    for cmd in lines:
        if cmd.startswith("pip install"):
            m = re.fullmatch(r"pip install -c constraints.txt '\.\[([\w,]+)\]'", cmd)
            assert m, f"{cmd!r}: installs come from the clone, with constraints.txt"
            for extra in m.group(1).split(","):
                assert re.search(rf"(?m)^{extra} = \[", pyproject), f"{extra}: no such extra in pyproject.toml"
                assert extra in extras_in_tox or extra == "mpi", f"{extra}: no tox env installs it"
        else:
            assert cmd == "bash launch_scripts/install_horovod.sh", cmd
            assert "launch_scripts{/}install_horovod.sh" in tox, "the horovod env no longer runs the script"


def test_no_page_installs_pypis_unidist() -> None:
    """PyPI's `unidist` is Modin's, another project: every install is from the clone."""
    for path, text in TEXTS.items():
        bad = re.search(r"pip3? install[^\n`]*?(?<![\w./'-])unidist\b", text)
        assert not bad, f"{path.name}: {bad.group(0)!r}"


def test_every_page_is_in_the_navigation() -> None:
    nav = (ROOT / "mkdocs.yml").read_text()
    for path in SOURCES[1:]:
        rel = path.relative_to(DOCS).as_posix()
        assert re.search(rf"(?m)^\s+- (?:[^:\n]+: )?{re.escape(rel)}$", nav), f"{rel} is not in mkdocs.yml's nav"


def _error_classes() -> set[str]:
    names = set()
    for path in (ROOT / "unidist").rglob("*.py"):
        names |= set(re.findall(r"(?m)^class (\w+(?:Error|Interrupt))\(", path.read_text()))
    return names


def test_troubleshooting_covers_every_error() -> None:
    page = (DOCS / "troubleshooting.md").read_text()
    sections = set(re.findall(r"(?m)^### (\w+)$", page))
    errors = _error_classes()
    assert len(errors) >= 25, errors
    missing = sorted(errors - sections)
    assert not missing, f"docs/troubleshooting.md has no section for {missing}: say their cause and fix"
    for name in errors:
        body = page.split(f"### {name}\n", 1)[1].split("\n#", 1)[0]
        assert "Cause" in body and "Fix" in body, f"{name}: its section says its cause and its fix"


def test_the_suite_size_stated_is_the_suite_size() -> None:
    from workers.collectives import plan

    count = len(plan(2))
    for path, text in TEXTS.items():
        for stated in re.findall(r"collective suite \((\d+) cases", text.replace("\n", " ")):
            assert int(stated) == count, f"{path.name} says {stated} cases; tests/workers/collectives.py has {count}"


def test_paths_the_pages_name_exist() -> None:
    """`tests/...`, `unidist/...`, `examples/...`, `launch_scripts/...`, `benchmarks/...` in backticks are files
    or folders of this clone."""
    pattern = re.compile(r"`((?:tests|unidist|examples|launch_scripts|benchmarks|docs)/[\w./-]+?)`")
    for path, text in TEXTS.items():
        for rel in pattern.findall(text):
            target = rel.split("::")[0].rstrip("/")
            assert (ROOT / target).exists() or "*" in target, f"{path.name}: `{rel}` does not exist"


def test_images_shown_exist() -> None:
    for path, text in TEXTS.items():
        for src in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", text):
            here = (path.parent / src)
            generated = src == "collectives.png" and (ROOT / "benchmarks" / "collectives.png").exists()
            assert here.exists() or generated, f"{path.name}: image {src} missing"


def test_fences_are_balanced() -> None:
    for path, text in TEXTS.items():
        fences = re.findall(r"(?m)^\s*```", text)
        assert len(fences) % 2 == 0, f"{path.name}: an unclosed code fence"


def test_screenshots_and_hooks_are_not_pages() -> None:
    assert all(not p.relative_to(DOCS).parts[0].startswith("_") for p in SOURCES[1:])
    assert Path(DOCS / "_hooks" / "site.py").exists()
