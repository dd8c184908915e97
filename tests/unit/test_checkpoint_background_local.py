"""Background checkpoints on one process: the snapshot, wait/done, one save in flight, errors, the exit.

Under real launchers (several ranks, a SIGKILL mid-write): tests/multiproc/test_checkpoint_background.py.
"""

from __future__ import annotations

import argparse
import os
import threading
from pathlib import Path
from typing import Any

import pytest
import torch

import unidist
import unidist.checkpoint as ckpt
from unidist import CheckpointError, InvalidArgumentError
from unidist.checkpoint.background import SaveHandle

# the models and batches here are CPU tensors: the Manager is told the CPU, so that a GPU machine runs the same tests
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


def make() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Tanh(), torch.nn.Linear(7, 2))


@pytest.fixture
def mgr() -> Any:
    with unidist.init(environ=ON_CPU) as m:
        yield m


def prepared(mgr: unidist.Manager, zero_stage: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make()
    return mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), zero_stage=zero_stage)


def step(mgr: unidist.Manager, model: torch.nn.Module, opt: torch.optim.Optimizer, n: int = 1) -> None:
    for i in range(n):
        mgr.backward(model(torch.full((3, 5), float(i + 1))).pow(2).sum())
        opt.step()
        opt.zero_grad()


def state(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    out = [v.clone() for v in model.state_dict().values()]
    for st in opt.state_dict()["state"].values():
        out += [v.clone() for v in st.values()]
    return out


def loaded(mgr: unidist.Manager, path: Path, zero_stage: int = 0) -> tuple[list[torch.Tensor], dict[str, Any]]:
    model, opt = prepared(mgr, zero_stage)
    extra = mgr.load_checkpoint(path, model, opt)
    return state(model, opt), extra


class Gate:
    """Holds the background writer inside its shard write until opened (``unidist.checkpoint.save_tensors``)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.open, self.entered, self.nice = threading.Event(), threading.Event(), None
        real = ckpt.save_tensors

        def gated(obj: Any, path: Path, pace: Any = None) -> tuple[int, str]:
            self.nice = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
            self.entered.set()
            self.open.wait(30)
            return real(obj, path, pace)
        monkeypatch.setattr(ckpt, "save_tensors", gated)


@pytest.mark.parametrize("zero_stage", [0, 3])
def test_snapshot_taken_before_return_equals_sync_save(mgr: unidist.Manager, tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch, zero_stage: int) -> None:
    """Training steps while the writer is held mid-save change nothing in the checkpoint: it loads equal to a
    synchronous save of the same step (model, Adam state and its step count, extra). Nothing is published
    before wait(); done() says when this rank's files are written."""
    model, opt = prepared(mgr, zero_stage)
    step(mgr, model, opt, 2)
    sync = mgr.save_checkpoint(tmp_path / "sync" / "s2", model, opt, step=2)
    gate = Gate(monkeypatch)
    handle = mgr.save_checkpoint(tmp_path / "bg" / "s2", model, opt, step=2, lrs=[0.5], blocking=False)
    assert isinstance(handle, SaveHandle) and handle.path == (tmp_path / "bg" / "s2").absolute()
    assert gate.entered.wait(30) and not handle.done() and not handle.published
    step(mgr, model, opt, 3)  # the parameters and Adam's in-place step tensors move on
    assert mgr.latest_checkpoint(tmp_path / "bg") is None
    gate.open.set()
    assert handle.wait() == handle.path and handle.done() and handle.published
    assert handle.wait() == handle.path  # again: the same path, nothing run twice
    assert mgr.latest_checkpoint(tmp_path / "bg") == handle.path
    got, extra = loaded(mgr, handle.path, zero_stage)
    want, _ = loaded(mgr, sync, zero_stage)
    assert extra == {"step": 2, "lrs": [0.5]}
    assert len(got) == len(want) and all(torch.equal(a, b) for a, b in zip(got, want, strict=True))
    assert any(not torch.equal(a, b) for a, b in zip(got, state(model, opt), strict=True))
    if hasattr(os, "getpriority") and os.getpriority(os.PRIO_PROCESS, 0) < 19:
        assert gate.nice is not None and gate.nice > os.getpriority(os.PRIO_PROCESS, 0)  # the writer yields


def test_second_save_waits_for_the_first(mgr: unidist.Manager, tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """One save in flight: the next save_checkpoint (background or not) and load_checkpoint publish it first."""
    model, opt = prepared(mgr)
    step(mgr, model, opt)
    first = mgr.save_checkpoint(tmp_path / "a", model, opt, step=1, blocking=False)
    second = mgr.save_checkpoint(tmp_path / "b", model, opt, step=1, blocking=False)
    assert first.published and mgr.latest_checkpoint(tmp_path) == first.path
    path = mgr.save_checkpoint(tmp_path / "c", model, opt, step=1)
    assert second.published and path.is_dir()
    third = mgr.save_checkpoint(tmp_path / "d", model, opt, step=7, blocking=False)
    assert mgr.load_checkpoint(third.path, model, opt) == {"step": 7} and third.published


def test_writer_error_is_raised_typed_and_keeps_the_previous(mgr: unidist.Manager, tmp_path: Path,
                                                             monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed write raises CheckpointError (with the writer's own error) from wait(), again on a second
    wait(); the previous checkpoint stays the latest and no temporary directory is left."""
    model, opt = prepared(mgr)
    step(mgr, model, opt)
    before = mgr.save_checkpoint(tmp_path / "s1", model, opt, step=1)

    def broken(obj: Any, path: Path, pace: Any = None) -> tuple[int, str]:
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(ckpt, "save_tensors", broken)
    handle = mgr.save_checkpoint(tmp_path / "s2", model, opt, step=2, blocking=False)
    for _ in range(2):
        with pytest.raises(CheckpointError, match="No space left on device"):
            handle.wait()
    assert handle.done() and handle.finished and not handle.published
    assert mgr.latest_checkpoint(tmp_path) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s1"]
    # not waited for: the next save raises it, once, and the one after works
    unwaited = mgr.save_checkpoint(tmp_path / "s3", model, opt, step=3, blocking=False)
    with pytest.raises(CheckpointError, match="No space left on device"):
        mgr.save_checkpoint(tmp_path / "s4", model, opt, step=4)
    assert unwaited.finished
    monkeypatch.undo()
    assert mgr.save_checkpoint(tmp_path / "s4", model, opt, step=4).is_dir()


def test_refusals_come_before_returning(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = prepared(mgr)
    with pytest.raises(InvalidArgumentError, match="blocking"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, blocking="no")  # type: ignore[call-overload]
    with pytest.raises(CheckpointError, match="weights_only"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, blocking=False, thing=lambda: 0)
    with pytest.raises(InvalidArgumentError, match="keep"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, blocking=False, keep=0)
    assert not tmp_path.joinpath("x").exists() and list(tmp_path.iterdir()) == []


def test_exit_publishes_a_save_never_waited_for(tmp_path: Path) -> None:
    with unidist.init(environ=ON_CPU) as mgr:
        model, opt = prepared(mgr)
        step(mgr, model, opt)
        handle = mgr.save_checkpoint(tmp_path / "s1", model, opt, keep=1, step=1, blocking=False)
    assert handle.published and ckpt.latest_checkpoint(tmp_path) == handle.path


def test_failing_exit_abandons_it(tmp_path: Path) -> None:
    """An exception leaving the with block: no collective is attempted, nothing is published, the previous
    checkpoint stays the latest."""
    saved: list[Any] = []

    def failing_job() -> None:
        with unidist.init(environ=ON_CPU) as mgr:
            model, opt = prepared(mgr)
            step(mgr, model, opt)
            saved.append(mgr.save_checkpoint(tmp_path / "s1", model, opt, step=1))
            saved.append(mgr.save_checkpoint(tmp_path / "s2", model, opt, step=2, blocking=False))
            raise RuntimeError("boom")
    with pytest.raises(RuntimeError, match="boom"):
        failing_job()
    first, handle = saved
    assert handle.finished and not handle.published
    with pytest.raises(CheckpointError, match="abandoned"):
        handle.wait()
    assert ckpt.latest_checkpoint(tmp_path) == first


def test_bench_background_table(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                monkeypatch: pytest.MonkeyPatch) -> None:
    """`python -m unidist.bench.checkpoint --dir D --background` (README), in this process on a small model:
    its table, and D removed (the machine line, seconds of measuring under load, is bench/machine.py's own)."""
    import unidist.bench.checkpoint as bench

    monkeypatch.setattr(bench, "machine_line", lambda: "machine: (not measured)")
    for name, value in ON_CPU.items():  # the benchmark starts its own Manager from the environment
        monkeypatch.setenv(name, value)

    args = argparse.Namespace(dir=tmp_path / "b", width=64, layers=2, rounds=1, stage=0, batch=4, steps=1,
                              writer_nice=None, writer_duty=None)
    assert bench.background(args) == 0
    out = capsys.readouterr().out
    rows = [line for line in out.splitlines() if line.startswith("| ") and " s |" in line]
    assert len(rows) == 5 and rows[-1].startswith("| torch.save + fsync |") and "% of torch.save |" in rows[-1], out
    assert "| training step while a background save is written |" in out and out.startswith("machine: "), out
    assert not (tmp_path / "b").exists()
