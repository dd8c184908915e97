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
    for script in [*(ROOT / "launch_scripts").glob("*.sh"), ROOT / "launch_scripts" / "slurm.sbatch"]:
        assert script.stat().st_mode & 0o111, f"{script.name} is not executable"
        assert script.read_text().startswith("#!/usr/bin/env bash"), script.name


def test_slurm_recipe_is_valid_bash_and_asks_pmi_for_the_backends_that_need_it() -> None:
    """The recipe's own table (mpi: --mpi=pmi2, the others --mpi=none) agrees with the registry's needs_pmi;
    tests/slurm/test_slurm.py submits it to a real Slurm for every backend."""
    import re
    import subprocess

    from unidist import registry

    path = ROOT / "launch_scripts" / "slurm.sbatch"
    subprocess.run(["bash", "-n", str(path)], check=True)
    text = path.read_text()
    assert 'srun --kill-on-bad-exit=1 --mpi="$mpi"' in text
    needing = set(re.findall(r"^\s*([\w|]+)\) mpi=\$\{SLURM_MPI_TYPE:-pmi2\}", text, re.M)[0].split("|"))
    built_in = {b.name for b in registry.records() if b.needs_pmi and not b.name.startswith("mpi_")}  # not tests'
    assert needing == built_in, f"slurm.sbatch asks PMI for {needing}; the registry's needs_pmi: {built_in}"


def test_ds_config_is_json_with_a_zero_stage() -> None:
    import json

    cfg = json.loads((ROOT / "launch_scripts" / "ds_config.json").read_text())
    assert cfg["zero_optimization"]["stage"] in (0, 1, 2, 3)
