"""A skipped collective with UNIDIST_TIMEOUT below UNIDIST_STALL_WARNING (issue 40): the stall inspector still
looks before the timeout (at a fraction of it), so the job ends with its verdict, "a rank skipped ... a
collective", naming each rank's own line of the script, well before the timeout would have ended it; with the
inspector off, the timeout's message names each rank's line (tests/workers/skipped.py).

The launcher's output is read as it comes, each line stamped with the time it arrived.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import threading
import time
from pathlib import Path

import pytest
from helpers import ROOT, WORKERS, clean_env, mpiexec, require

from unidist.comm.watchdog import TIMEOUT_EXIT_CODE

pytestmark = pytest.mark.mpi
WORKER = WORKERS / "skipped.py"
TIMEOUT = 8.0  # below the default UNIDIST_STALL_WARNING (60 s), as the newcomer had it


def _line(marker: str) -> str:
    """``tests/workers/skipped.py:N``: where the worker's line ending in ``marker`` is, as the messages say it."""
    n = next(i for i, text in enumerate(WORKER.read_text().splitlines(), 1) if text.endswith(marker))
    return f"{WORKER.relative_to(ROOT)}:{n}"


def _launch(tmp_path: Path, env: dict[str, str]) -> tuple[int | None, list[tuple[float, str]], float, float]:
    """Run the worker under mpiexec -n 2 (in the repository, as the tests' launches are); the exit code (None:
    still running after 120 s), the output lines with their arrival times, when rank 1 began to skip and when the
    launcher exited."""
    proc = subprocess.Popen(mpiexec(2, str(WORKER), "--out", str(tmp_path)), env=clean_env(env), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    lines: list[tuple[float, str]] = []
    reader = threading.Thread(target=lambda: lines.extend((time.time(), line) for line in proc.stdout or ()))
    reader.start()
    try:
        code: int | None = proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        code = None
    ended = time.time()
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # whatever the launcher left behind
    except OSError:
        pass
    reader.join(timeout=10)
    began = float((tmp_path / "begin1").read_text()) if (tmp_path / "begin1").exists() else float("nan")
    return code, lines, began, ended


def test_a_skipped_collective_is_named_before_a_short_timeout(tmp_path: Path) -> None:
    require("mpi4py")
    # the desync check off: the one-in-K check could catch the skip itself; this is the inspector's case
    code, lines, began, ended = _launch(tmp_path, {"UNIDIST_TIMEOUT": str(TIMEOUT), "UNIDIST_CHECK_COLLECTIVES": "0"})
    text = "".join(line for _, line in lines)
    assert code is not None, f"the job did not end in 120 s\n{text[-4000:]}"
    assert code not in (0, TIMEOUT_EXIT_CODE), f"exit {code}: not ended by the inspector\n{text[-4000:]}"
    assert "left the broadcast" not in text and "longer than UNIDIST_TIMEOUT" not in text, text[-4000:]
    verdict = "unidist.errors.CollectiveMismatchError: ranks are in different calls: a rank skipped"
    said = [t for t, line in lines if verdict in line]
    assert len(said) == 2, f"each rank names the desync\n{text[-4000:]}"
    skipped, every = re.escape(_line("# the allreduce rank 1 skips")), re.escape(_line("# every rank"))
    for pattern in (rf"rank 0 is waiting in allreduce\(float32\[4\][^)]*\) at {skipped} \(collective #\d+ of all "
                    rf"ranks\); rank 1 on host \S+ is waiting in broadcast\(float32\[4\], 0\) at {every} ",
                    rf"rank 1 is waiting in broadcast\(float32\[4\], 0\) at {every} \(collective #\d+ of all ranks\); "
                    rf"rank 0 on host \S+ is waiting in allreduce\(float32\[4\][^)]*\) at {skipped} "):
        assert re.search(pattern, text), f"{pattern}\n{text[-4000:]}"
    print(f"named {said[0] - began:.1f} s into the wait, the job over {ended - began:.1f} s in "
          f"(UNIDIST_TIMEOUT={TIMEOUT:g})")
    # the inspector looks at a quarter of the timeout and needs two looks a period apart: ~3-4 s here
    assert said[0] - began <= TIMEOUT * 0.75, f"named {said[0] - began:.1f} s into the wait\n{text[-4000:]}"
    assert ended - began < TIMEOUT + 2, f"ended {ended - began:.1f} s into the wait\n{text[-4000:]}"  # ~5 s


def test_with_the_inspector_off_the_timeout_names_each_ranks_line(tmp_path: Path) -> None:
    require("mpi4py")
    code, lines, _, _ = _launch(tmp_path, {"UNIDIST_TIMEOUT": "3", "UNIDIST_STALL_WARNING": "0",
                                            "UNIDIST_CHECK_COLLECTIVES": "0"})
    text = "".join(line for _, line in lines)
    assert code == TIMEOUT_EXIT_CODE, f"exit {code}\n{text[-4000:]}"
    skipped, every = re.escape(_line("# the allreduce rank 1 skips")), re.escape(_line("# every rank"))
    for pattern in (rf"unidist: rank 0 of 2: allreduce\(float32\[4\][^)]*\) at {skipped} has waited [\d.]+ s, "
                    rf"longer than UNIDIST_TIMEOUT=3: rank 1 is alive, waiting in broadcast\(float32\[4\], 0\) at "
                    rf"{every}\. Another rank is stuck, dead, exited or made a different call",
                    rf"unidist: rank 1 of 2: broadcast\(float32\[4\], 0\) at {every} has waited [\d.]+ s, longer than "
                    rf"UNIDIST_TIMEOUT=3: rank 0 is alive, waiting in allreduce\(float32\[4\][^)]*\) at {skipped}\. "):
        assert re.search(pattern, text), f"{pattern}\n{text[-4000:]}"
