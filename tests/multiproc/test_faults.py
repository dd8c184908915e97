"""One rank misbehaves under every launcher; the job must end, non-zero, within UNIDIST_TIMEOUT + 15 s of the
fault, with a message that names the rank and the call (issue 12's fault table).

The worker (tests/workers/faults.py) trains a small model; at step 3 the last rank is killed, stopped, raises,
exits 0, or makes a mismatched collective. The launcher's output goes to files, not pipes: a stopped rank a
launcher leaves behind would hold a pipe open. Whatever is left of the session is SIGKILLed afterwards.
Set UNIDIST_FAULT_TABLE=<file> to collect launcher, fault, seconds, exit code and the first message line.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import time
from pathlib import Path

import pytest
from helpers import MARKS, WORKERS, clean_env, main_launches, require, ways

from unidist.comm.watchdog import BACKSTOP_GRACE

WORKER = str(WORKERS / "faults.py")
TIMEOUT = 3.0
# every way each backend is started (its record's launches), at 2 ranks; the check mode has tests of its own
LAUNCH_AT_2 = {k: v for k, v in ways(2).items() if "UNIDIST_CHECK_COLLECTIVES" not in v.env}
FAULTS = ("kill", "stop", "raise", "exit0", "sum_max", "kind")

# what names the culprit: the last rank (1) and, where the rank is alive to say so, its call
CULPRIT = {
    "kill": r"rank 1 is not responding|rank 1 has died|local_rank: 1|rank 1\]|KILLED BY SIGNAL: 9|return code = -9|"
            r"exit code: -9|signal 9|\[1\]<stderr>:Killed|exitcode\s*: -9",
    # or, when the healthy rank is stuck in C holding the GIL (Horovod's enqueue), the faulthandler backstop
    "stop": r"rank 1 is not responding \(stopped|^(\[0\]<stderr>:)?Timeout \(0:00:\d\d\)!",
    "raise": r"deliberate failure on rank 1",
    # (the stall inspector's desync, or the timeout's message; the inspector off: what the heartbeat says)
    "exit0": r"rank 1 of 2: the barrier ranks meet in when they leave the `with` block at \S+faults\.py:\d+|"
             r"rank 1 (on host \S+ |is alive, )?(is )?waiting in the barrier ranks meet in when they leave the `with` "
             r"block at \S+faults\.py:\d+",
    "sum_max": r"rank 0 called allreduce\(op=sum.*rank 1 called allreduce\(op=max",
    # or, when the default one-in-K check samples that call (comm/check.py), the check's own error
    "kind": r"rank 1 of 2: broadcast\(\S+ at \S+faults\.py:\d+|"
            r"rank 1 (on host \S+ |is alive, )?(is )?waiting in broadcast\(.* at \S+faults\.py:\d+|"
            r"rank 1 called broadcast\(",
}


# Every fault on each built-in engine's main launch; the other ways (a second launcher of the engine, the tests'
# outside backend on MPI's engine) get the two whose ending is the launcher's doing (a killed or stopped rank):
# the others end inside unidist, the same under any launcher (12 launches fewer, ~2.5 minutes of CI)
EVERY_FAULT = {n for n, v in main_launches(2).items() if v.backend in ("mpi", "torch", "deepspeed", "horovod")}
CASES = [pytest.param(n, f, marks=MARKS[v.backend], id=f"{n}-{f}") for n, v in LAUNCH_AT_2.items() for f in FAULTS
         if n in EVERY_FAULT or f in ("kill", "stop")]


@pytest.mark.parametrize(("name", "fault"), CASES)
def test_fault_ends_the_job(name: str, fault: str, tmp_path: Path) -> None:
    launch = LAUNCH_AT_2[name]
    require(*launch.engines)
    env = {**launch.env, "UNIDIST_TIMEOUT": str(TIMEOUT)}
    if fault == "sum_max":
        env["UNIDIST_CHECK_COLLECTIVES"] = "1"
    out, log = tmp_path / "out", tmp_path / "log"
    out.mkdir()
    with open(log, "w") as sink:
        proc = subprocess.Popen(launch.command(WORKER, "--out", str(out), "--fault", fault), env=clean_env(env),
                                stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = proc.wait(timeout=TIMEOUT + 120)
        except subprocess.TimeoutExpired:
            code = None
        ended = time.time()
        _kill_session(proc.pid, out)
    text = log.read_text()
    assert code is not None, f"{name} {fault}: the job did not end in {TIMEOUT + 120} s\n{text[-4000:]}"
    assert (out / "fault").exists(), f"{name} {fault}: the fault was never injected (exit {code})\n{text[-4000:]}"
    seconds = ended - float((out / "fault").read_text())
    first = next((line.strip() for line in text.splitlines() if re.search(CULPRIT[fault], line)), "")
    table = os.environ.get("UNIDIST_FAULT_TABLE")
    if table:
        with open(table, "a") as f:
            f.write(json.dumps({"launch": name, "fault": fault, "seconds": round(seconds, 1), "exit": code,
                                "message": first[:300]}) + "\n")
    assert code != 0, f"{name} {fault}: exit 0\n{text[-4000:]}"
    budget = TIMEOUT + 15
    if name.startswith("horovod") and fault == "stop":
        # Known gap (issue 12): Horovod's enqueue can hold the GIL while blocked, so only the faulthandler backstop
        # (BACKSTOP_GRACE after the timeout) ends rank 0, and it cannot SIGKILL the stopped rank, which horovodrun
        # then takes ~10 s to kill. Measured 22.8 s; without the backstop the job hung.
        budget += BACKSTOP_GRACE
    assert seconds <= budget, f"{name} {fault}: ended {seconds:.1f} s after the fault\n{text[-4000:]}"
    assert first, f"{name} {fault}: no message names the culprit ({CULPRIT[fault]!r})\n{text[-4000:]}"
    assert "finished, last allreduce" not in text, text[-4000:]


def _kill_session(pid: int, out: Path) -> None:
    """SIGKILL the launcher's session and any rank that left it (a stopped rank must not outlive the test)."""
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    for f in out.glob("pid*"):
        try:
            os.kill(int(f.read_text()), signal.SIGKILL)
        except (ProcessLookupError, ValueError):
            pass
