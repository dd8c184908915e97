"""The DeepSpeed names Python files use: every ``import deepspeed...``, ``from deepspeed... import X`` and attribute
chain on a name bound to deepspeed (``deepspeed.runtime.utils.set_random_seed``), with the files using each.

    python tests/data/deepspeed_names/scan.py OUT.json REPO_GIT_DIR [REPO_GIT_DIR ...]

Each REPO_GIT_DIR is a git directory (the ``fetch`` tool's mirrors: ``/work/.mirror/<owner>+<name>/repo``); its
HEAD is read, and its commit recorded. Names with a private part (``PipelineEngine._INSTRUCTION_MAP``) are left out:
they are DeepSpeed's internals, not its API. names.json here is this script's output for DeepSpeedExamples and
Megatron-DeepSpeed; unidist/compat/deepspeed/names.py gives every name in it a row.
"""

from __future__ import annotations

import ast
import json
import subprocess
import sys
from collections import defaultdict
from pathlib import Path


def _git(repo: str, *args: str) -> str:
    return subprocess.run(["git", "-C", repo, *args], capture_output=True, text=True, check=True).stdout


def _is_deepspeed(module: str) -> bool:
    return module == "deepspeed" or module.startswith("deepspeed.")


def names_in(source: str) -> set[str]:
    """The deepspeed names one file's source uses."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return set()
    found: set[str] = set()
    bound: dict[str, str] = {}  # a local name -> the deepspeed module it stands for
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if _is_deepspeed(alias.name):
                    found.add(alias.name)
                    bound[alias.asname or "deepspeed"] = alias.name if alias.asname else "deepspeed"
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module and _is_deepspeed(node.module):
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            chain: list[str] = []
            cur: ast.expr = node
            while isinstance(cur, ast.Attribute):
                chain.append(cur.attr)
                cur = cur.value
            if isinstance(cur, ast.Name) and cur.id in bound:
                found.add(".".join([bound[cur.id], *reversed(chain)]))
    return {n for n in found if not any(part.startswith("_") for part in n.split(".")[1:])}


def main() -> None:
    out, repos = Path(sys.argv[1]), sys.argv[2:]
    uses: dict[str, set[str]] = defaultdict(set)
    sources = {}
    for repo in repos:
        label = Path(repo).parent.name.replace("+", "/")
        sources[label] = _git(repo, "rev-parse", "HEAD").strip()
        for path in _git(repo, "ls-tree", "-r", "HEAD", "--name-only").split():
            if path.endswith(".py"):
                text = _git(repo, "show", f"HEAD:{path}")
                if "deepspeed" in text:
                    for name in names_in(text):
                        uses[name].add(f"{label}:{path}")
    out.write_text(json.dumps({"sources": sources, "names": {k: sorted(v) for k, v in uses.items()}}, indent=1,
                              sort_keys=True))
    print(f"{len(uses)} names")


if __name__ == "__main__":
    main()
