"""Stub: Compression.none / fp16."""

from __future__ import annotations

from typing import Any


class Compression:
    pass
