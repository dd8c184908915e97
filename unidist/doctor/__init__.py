"""``unidist info --check``: which engines and launchers are installed and usable here, with the fix for what
is not (as ``horovodrun --check-build`` and ``ds_report`` do for their engines).

Plain ``unidist info`` reads package metadata only and stays fast; this imports every engine for real, in a
child process under a time limit (``probe``, ``ask``), asks every launcher program to answer, looks at the
CPUs, GPUs and network interfaces, and turns the answers into one verdict a backend (``verdict``), printed
by ``render``.
"""

from __future__ import annotations

import platform
import sys
import threading
import time
from collections.abc import Mapping
from dataclasses import asdict
from typing import Any

from unidist import net, registry
from unidist.doctor import ask, verdict

__all__ = ["check"]


def check(environ: Mapping[str, str], limit: float = 20.0) -> dict[str, Any]:
    """Everything ``unidist info --check`` reports, as data (``--json`` prints it), with its ``exit_code``.

    Args:
        environ: the environment the engines would run in (the probe child gets it).
        limit: seconds each probe step and each launcher program has to answer.
    """
    start = time.monotonic()
    chosen = verdict.would_run(environ)  # first: UNIDIST_BACKEND may name a plugin, registered when looked up
    packages = list(dict.fromkeys(pkg for rec in registry.records() for pkg in rec.requires))
    programs: dict[str, Any] = {}
    asking = threading.Thread(target=lambda: programs.update(ask.ask_programs(limit)), daemon=True)
    asking.start()  # the launchers answer while the probe child imports the engines
    answers = ask.ask_packages(packages, environ, limit)
    ifaces = net.interfaces()
    asking.join()
    verdicts = {rec.name: verdict.backend_verdict(rec, answers, programs, ask.this_python)
                for rec in registry.records()}
    torch = answers.get("torch", {})
    return {
        "python": f"{platform.python_version()} ({sys.executable})",
        "packages": answers,
        "programs": programs,
        "machine": {**ask.cpus(), "gpus": torch.get("gpus") if torch.get("ok") else None},
        "nccl_variables": {k: v for k, v in sorted(environ.items()) if k.startswith("NCCL_")},
        "devices": verdict.device_plan(environ, torch.get("gpus") if torch.get("ok") else None),
        "network": {"interfaces": [asdict(i) for i in ifaces], "variables": verdict.iface_variables(environ, ifaces)},
        "backends": verdicts,
        "would_run": chosen,
        "usable_launched": [rec.name for rec in registry.records() if rec.launcher and verdicts[rec.name]["usable"]],
        "exit_code": verdict.exit_code(verdicts, chosen),
        "seconds": round(time.monotonic() - start, 2),
    }
