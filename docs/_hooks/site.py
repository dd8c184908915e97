"""MkDocs hook: what the pages show that lives outside docs/, taken from where it is generated, so no copy can go
stale.

- The benchmark plot RESULTS.md draws, added to the build as a file.
- Generated tables (benchmarks/RESULTS.md, benchmarks/records/*.md): a page names one by a link on a line of its
  own, followed by the marker comment (``INCLUDE``). Read as plain markdown (GitHub, an editor) the line is a link
  to the table; on the site the line is replaced by the table itself. The link's target is relative to the page,
  as any link, and its text is the file's path from the repository root (tests/unit/test_doc_figures.py reads it).
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mkdocs itself only when the site is built (the tests read INCLUDE without it)
    from mkdocs.structure.files import Files

ROOT = Path(__file__).resolve().parents[2]
# docs path -> the generated file it is
GENERATED = {"collectives.png": ROOT / "benchmarks" / "collectives.png"}
# a generated table shown in a page: [path from the root](path from the page) <!-- the site shows it here -->
INCLUDE = re.compile(r"^\[(?P<path>[\w./-]+\.md)\]\((?P<target>[\w./-]+\.md)\) <!-- the site shows it here -->[ \t]*$",
                     re.M)


def on_files(files: Files, config: Any) -> Files:
    from mkdocs.structure.files import File

    for dest, src in GENERATED.items():
        files.append(File.generated(config, dest, abs_src_path=str(src)))
    return files


def included(page_path: Path, match: re.Match[str]) -> Path:
    """The file an include line names; a ValueError where its text and its link disagree or it does not exist."""
    target = (page_path.parent / match.group("target")).resolve()
    if target != (ROOT / match.group("path")).resolve() or not target.is_file():
        raise ValueError(f"{page_path}: the include line {match.group(0).strip()!r} links to {target}, which is not "
                         f"an existing {match.group('path')}")
    return target


def on_page_markdown(markdown: str, page: Any, config: Any, files: Files) -> str:
    where = Path(page.file.abs_src_path)
    return INCLUDE.sub(lambda m: included(where, m).read_text().rstrip("\n"), markdown)
