"""TEMPORARY minimal stand-in (the lead's bootstrap); helper DIST's accelerator replaces it."""

from __future__ import annotations

from typing import Any


class _CPU:
    def device_name(self, i: Any = None) -> str:
        return "cpu"

    def is_bf16_supported(self) -> bool:
        return True

    def is_fp16_supported(self) -> bool:
        return True


def get_accelerator() -> Any:
    return _CPU()
