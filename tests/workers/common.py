"""What the training workers share: start the Manager, fill a report, write <out>/rank<R>.json."""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import unidist


def report_main(fill: Callable[[Any, dict[str, Any]], None]) -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, required=True)
    ns = parser.parse_args(unidist.script_args())
    with unidist.init() as mgr:
        report: dict[str, Any] = {"backend": mgr.backend, "size": mgr.size}
        fill(mgr, report)
        (ns.out / f"rank{mgr.rank}.json").write_text(json.dumps(report))
