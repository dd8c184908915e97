"""MkDocs hook: files the pages show that live outside docs/ (the benchmark plot RESULTS.md draws), added to the
build from where they are generated, so no copy can go stale."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

ROOT = Path(__file__).resolve().parents[2]
# docs path -> the generated file it is
GENERATED = {"collectives.png": ROOT / "benchmarks" / "collectives.png"}


def on_files(files: Files, config: Any) -> Files:
    for dest, src in GENERATED.items():
        files.append(File.generated(config, dest, abs_src_path=str(src)))
    return files
