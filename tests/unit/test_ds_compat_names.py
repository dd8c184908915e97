"""Every DeepSpeed name scripts use either works here or says so (unidist/compat/deepspeed/names.py).

The names are tests/data/deepspeed_names/names.json's: every ``import deepspeed...``, ``from deepspeed... import
X`` and ``deepspeed.a.b`` attribute chain in DeepSpeedExamples' and Megatron-DeepSpeed's Python files (scan.py, at
the commits the JSON names). Each is resolved as a script resolves it, with ``deepspeed`` meaning
``unidist.compat.deepspeed``: submodules imported, attributes read. A ``works`` row must resolve; a ``refused`` row
must raise AttributeError or ModuleNotFoundError saying it is not in the layer and how to run it on DeepSpeed
(before the port's first line ran into Python's bare "cannot import name")."""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

import pytest

from unidist.compat.deepspeed.names import NAMES, markdown

SCAN = Path(__file__).resolve().parents[1] / "data" / "deepspeed_names" / "names.json"


def resolve(name: str) -> Any:
    """``name`` as a script reaches it: each part a submodule where the package has one, else an attribute."""
    obj: Any = importlib.import_module("unidist.compat.deepspeed")
    for part in name.split(".")[1:]:
        if hasattr(obj, "__path__") and part not in vars(obj):  # a package: ``import deepspeed.a.b`` finds b
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            except ModuleNotFoundError:
                if not hasattr(obj, part):
                    raise
        obj = getattr(obj, part)
    return obj


def test_every_scanned_name_has_a_row() -> None:
    scanned = set(json.loads(SCAN.read_text())["names"])
    rows = [name for name, _, _ in NAMES]
    assert sorted(rows) == sorted(set(rows)) == sorted(scanned)
    assert all(status in ("works", "refused") and note for _, status, note in NAMES)


@pytest.mark.parametrize(("name", "status"), [(n, s) for n, s, _ in NAMES], ids=[n for n, _, _ in NAMES])
def test_each_name_works_or_says_so(name: str, status: str) -> None:
    if status == "works":
        assert resolve(name) is not None
        return
    with pytest.raises((AttributeError, ModuleNotFoundError)) as err:
        resolve(name)
    said = str(err.value)
    assert "not in unidist's compatibility layer" in said and "Import deepspeed itself" in said, said


def test_the_docs_publish_the_table() -> None:
    doc = (Path(__file__).resolve().parents[2] / "docs" / "coming-from" / "deepspeed.md").read_text()
    assert markdown() in doc, "docs/coming-from/deepspeed.md's names table is stale: paste names.markdown()"
