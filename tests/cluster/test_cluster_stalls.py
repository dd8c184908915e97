"""The stall inspector across hosts (issue 24): one rank on each of 2 simulated hosts under mpiexec, so rank 0
sees rank 1's position only over the liveness channel (never a heartbeat file). The worker
(tests/workers/stalls.py) makes rank 1 a straggler, then stopped, then skip a collective; each must be named
within UNIDIST_STALL_WARNING + 5 s, and the skipped collective must end the job with CollectiveMismatchError.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

from fakehosts import Cluster
from jobs import LAUNCHES, Job, run_job

WORKER = str(Path(__file__).resolve().parents[1] / "workers" / "stalls.py")
WARNING = 2.0
VERDICTS = {  # what rank 0, on h1, must say of rank 1 on h2
    "straggler": "rank 1 on host h2 is computing, not yet at",
    "stopped": "rank 1 is not responding (stopped or hung: its host took the probe",
    "desync": "unidist.errors.CollectiveMismatchError: ranks are in different calls",
}


def test_far_stall_is_explained(cluster2: Cluster) -> None:
    out = cluster2.shared / "stalls"
    out.mkdir()
    seen: dict[str, float] = {}  # verdict -> when its line first reached the job's log
    done: dict[str, object] = {}

    def job() -> None:
        done["job"] = run_job(cluster2, LAUNCHES["mpiexec"], {"h1": 1, "h2": 1}, [WORKER, "--out", str(out)],
                              {"UNIDIST_STALL_WARNING": str(WARNING)}, timeout=120)

    runner = threading.Thread(target=job)
    runner.start()
    try:
        while runner.is_alive():  # the job's log (run_job writes it under the shared directory) as it grows
            for log in cluster2.shared.glob("job-*.log"):
                text = log.read_text(errors="replace")
                for stall, words in VERDICTS.items():
                    if stall not in seen and words in text and (out / stall).exists():
                        seen[stall] = time.time()
            time.sleep(0.1)
    finally:
        runner.join()
        for host in ("h1", "h2"):
            cluster2.kill_all(host)
    result = done["job"]
    assert isinstance(result, Job)
    text = result.output
    assert result.code not in (0, None), f"exit {result.code}\n{text[-6000:]}"
    for stall, words in VERDICTS.items():
        assert words in text and stall in seen, f"the {stall} stall was not named ({words!r})\n{text[-6000:]}"
        took = seen[stall] - float((out / stall).read_text())
        assert took <= WARNING + 5, f"{stall} named {took:.1f} s after it began\n{text[-6000:]}"
        print(f"far {stall}: named after {took:.1f} s")
