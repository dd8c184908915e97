"""README and CI agree: .ci/run runs the README's commands exactly as written there."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _bash_blocks(text: str) -> list[str]:
    return [b.strip() for b in re.findall(r"```bash\n(.*?)```", text, flags=re.S)]


def test_ci_runs_readme_setup_commands_verbatim() -> None:
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text().splitlines()
    blocks = _bash_blocks(readme)
    test_cmd = "python3 -m pip install tox && python3 -m tox"
    main_cmd = next(b for b in blocks if "unidist launch" in b and b.startswith("python3 -m venv"))
    assert test_cmd in blocks
    assert test_cmd in ci and main_cmd in ci


def test_every_launch_script_is_executable() -> None:
    for script in (ROOT / "launch_scripts").glob("*.sh"):
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env bash"), script.name
