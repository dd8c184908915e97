"""Preemption under real launchers (issue 27): a signal to one rank stops every rank at the same step, the example
saves a checkpoint there, exits 0 and resumes to the weights of an uninterrupted run; a SIGTERM the loop never
asks about still ends the job after the grace.

MPI and torchrun only (CI budget, ~40 s): the handlers and the agreement are the same code on every backend (one
MAX allreduce through the Manager), and these two cover an MPI launcher and one that watches its workers. The
example's save and resume (three runs) runs under mpiexec only: the checkpoint is the one every backend writes,
and tests/multiproc/test_checkpoint.py resumes it under torchrun.
The signals are real (``kill`` from this test, or the example's last rank signalling itself); nothing is mocked.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import torch
from helpers import MARKS, WORKERS, Launch, clean_env, main_launches, require, run

WORKER = str(WORKERS / "preempt.py")
LAUNCHES = {k: v for k, v in main_launches(2).items() if v.backend in ("mpi", "torch")}
CASES = [pytest.param(k, marks=MARKS[v.backend], id=k) for k, v in LAUNCHES.items()]
DIGITS = ["examples/train_digits.py", "--epochs", "2", "--checkpoint-every", "1000"]  # 58 steps, no periodic save
AT = 30  # the step the example's last rank sends itself SIGUSR1 (inside epoch 2)
GRACE = 2.0


@pytest.mark.mpi
def test_example_preempted_then_resumed_ends_with_uninterrupted_weights(tmp_path: Path) -> None:
    """examples/train_digits.py --checkpoint-dir: the last rank alone gets SIGUSR1 at step 30; every rank stops
    there, rank 0 says so, the checkpoint is on disk, the job exits 0 (--requeue outside Slurm changes nothing);
    the same command again resumes at step 30 and ends with exactly the weights of an uninterrupted run."""
    lch = LAUNCHES["mpiexec-2"]
    require(*lch.engines)
    ref = tmp_path / "ref.pt"
    proc = run(lch.command(*DIGITS, "--save-weights", str(ref)), env=lch.env, timeout=300)
    assert proc.returncode == 0, proc.describe()

    got, ckpt = tmp_path / "got.pt", tmp_path / "ckpt"
    argv = lch.command(*DIGITS, "--checkpoint-dir", str(ckpt), "--signal-at-step", str(AT), "--requeue",
                       "--save-weights", str(got))
    first = run(argv, env=lch.env, timeout=300)
    assert first.returncode == 0, first.describe()
    saved = ckpt / f"step-{AT:06d}"
    assert f"preempted by SIGUSR1 at step {AT}: checkpoint saved to {saved}\n" in first.stdout, first.describe()
    assert (saved / "manifest.json").exists(), sorted(os.listdir(ckpt))
    assert "final test accuracy" not in first.stdout and "requeued" not in first.stdout, first.describe()
    assert not got.exists()

    second = run(argv, env=lch.env, timeout=300)
    assert second.returncode == 0, second.describe()
    assert f"resumed from {saved} at step {AT}" in second.stdout, second.describe()
    assert "preempted by" not in second.stdout, second.describe()
    want, have = torch.load(ref, weights_only=True), torch.load(got, weights_only=True)
    worst = max(float((want[k] - have[k]).abs().max()) for k in want)
    assert worst == 0.0, worst


@pytest.mark.parametrize("name", CASES)
def test_signal_to_one_rank_stops_every_rank_at_the_same_step(name: str, tmp_path: Path) -> None:
    """SIGUSR1 from outside to rank 1 only, while the ranks loop (an allreduce and a sleep a step, requested()
    agreeing every 3rd call): both ranks stop at the same step, a multiple of 3, and name the signal; only rank 1
    received it; the job exits 0."""
    lch = LAUNCHES[name]
    require(*lch.engines)
    code, out, sent, ended = _signal_one_rank(lch, tmp_path, signal.SIGUSR1, "--mode", "agree", "--every", "3")
    assert code == 0, (out / "log").read_text()[-4000:]
    reports = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert reports[0]["step"] == reports[1]["step"], reports
    assert reports[0]["step"] % 3 == 0, reports
    assert [r["signal"] for r in reports] == ["SIGUSR1", "SIGUSR1"], reports
    assert reports[0]["received_at"] is None and reports[1]["received_at"] >= sent - 1, reports
    assert ended - sent < 60, ended - sent


@pytest.mark.parametrize("name", CASES)
def test_sigterm_the_loop_never_asks_about_ends_the_job_after_the_grace(name: str, tmp_path: Path) -> None:
    """SIGTERM to rank 1, whose loop never calls requested(): after the grace (2 s) it is raised again with the
    default handler, rank 1 ends and the launcher ends the job, non-zero, saying why."""
    lch = LAUNCHES[name]
    require(*lch.engines)
    code, out, sent, ended = _signal_one_rank(lch, tmp_path, signal.SIGTERM, "--mode", "ignore", "--grace",
                                              str(GRACE))
    log = (out / "log").read_text()
    assert code not in (0, None), log[-4000:]
    assert "rank 1: SIGTERM arrived 2 s ago and stop.requested() has not reported it" in log, log[-4000:]
    assert GRACE <= ended - sent < GRACE + 30, (ended - sent, log[-4000:])
    assert not (out / "rank1.json").exists()


def _signal_one_rank(lch: Launch, tmp_path: Path, signum: int, *args: str) -> tuple[int | None, Path, float, float]:
    """Start the worker, send ``signum`` to rank 1's process once every rank has its handlers, wait for the job:
    (exit code or None on timeout, the output directory, when the signal was sent, when the job ended)."""
    out = tmp_path / "out"
    out.mkdir()
    with open(out / "log", "w") as sink:
        proc = subprocess.Popen(lch.command(WORKER, "--out", str(out), *args), env=clean_env(lch.env), stdout=sink,
                                stderr=subprocess.STDOUT, start_new_session=True)
        try:
            end = time.monotonic() + 120
            while not (out / "ready").exists() and proc.poll() is None and time.monotonic() < end:
                time.sleep(0.02)
            assert (out / "ready").exists(), f"the workers never got ready\n{(out / 'log').read_text()[-4000:]}"
            time.sleep(0.2)  # a few steps in
            sent = time.time()
            os.kill(int((out / "pid1").read_text()), signum)
            try:
                code: int | None = proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                code = None
            ended = time.time()
        finally:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    return code, out, sent, ended
