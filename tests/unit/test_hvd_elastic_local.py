"""hvd.elastic on one process: State/ObjectState/TorchState commit and restore, ElasticSampler, and run()'s
resume, reset and refusals. Launcher restarts are tested under torchrun and mpiexec
(tests/multiproc/test_hvd_elastic.py)."""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unidist
import unidist.compat.horovod as hvd
from unidist import CheckpointError, CollectiveTimeoutError, ConfigError, InvalidArgumentError, LaunchEnvironmentError
from unidist.compat.horovod.elastic import store as store_module
from unidist.compat.horovod.elastic.sentinel import describe
from unidist.compat.horovod.elastic.state import HostUpdateResult
from unidist.compat.horovod.elastic.store import CommitStore, commit_directory, job_name

X = torch.randn(24, 5, generator=torch.Generator().manual_seed(3))
Y = torch.randn(24, 2, generator=torch.Generator().manual_seed(4))


@pytest.fixture
def mgr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[unidist.Manager]:
    monkeypatch.setenv("UNIDIST_ELASTIC_DIR", str(tmp_path / "commits"))
    monkeypatch.setenv("UNIDIST_ELASTIC_JOB", "job")  # commits in tmp_path/commits/job
    monkeypatch.delenv("UNIDIST_ELASTIC_COMMIT_SECONDS", raising=False)  # the default: every commit written
    monkeypatch.delenv("HOROVOD_ELASTIC", raising=False)
    with unidist.init(environ={}) as m:
        yield m


def build(kind: str = "adam") -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(5, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    opt = (torch.optim.Adam(model.parameters(), lr=0.05) if kind == "adam"
           else torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    return model, opt


def step(model: torch.nn.Module, opt: torch.optim.Optimizer, i: int) -> None:
    opt.zero_grad()
    rows = slice(4 * (i % 6), 4 * (i % 6) + 4)
    torch.nn.functional.mse_loss(model(X[rows]), Y[rows]).backward()
    opt.step()


def weights(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def test_object_state_commit_restore_sync(mgr: unidist.Manager) -> None:
    sent: list[Any] = []
    state = hvd.elastic.ObjectState(bcast_object=lambda obj: sent.append(obj) or obj, get_rank=lambda: 0,
                                    epoch=0, batch=0, history=[])
    state.epoch, state.batch = 2, 5
    state.commit()
    state.epoch, state.batch = 3, 1
    state.restore()
    assert (state.epoch, state.batch) == (2, 5)
    state.sync()  # broadcasts the saved state, as Horovod's
    assert sent[-1] == {"epoch": 2, "batch": 5, "history": []}
    assert sent[0] == (0, 0, 0, False)  # commit's one broadcast: (prev, newest timestamp, updates, write)


def test_torch_state_restores_model_and_optimizer(mgr: unidist.Manager) -> None:
    model, opt = build()
    state = hvd.elastic.TorchState(model, opt, epoch=0)
    for i in range(3):
        step(model, opt, i)
    state.epoch = 1
    state.commit()
    kept, kept_opt = weights(model), {k: v["exp_avg"].clone() for k, v in enumerate(opt.state.values())}
    for i in range(3, 6):
        step(model, opt, i)
    state.epoch = 2
    assert any(not torch.equal(kept[k], v) for k, v in weights(model).items())
    state.restore()
    assert state.epoch == 1
    assert all(torch.equal(kept[k], v) for k, v in weights(model).items())
    assert all(torch.equal(kept_opt[k], v["exp_avg"]) for k, v in enumerate(opt.state.values()))
    assert state.model is model and state.optimizer is opt


def test_torch_state_assignment_and_none(mgr: unidist.Manager) -> None:
    state = hvd.elastic.TorchState(model=None, optimizer=None, batch=0)
    assert state.model is None and state.optimizer is None and state.batch == 0
    model, opt = build("sgd")
    state = hvd.elastic.TorchState(model, opt)
    other, _ = build("sgd")
    torch.nn.init.zeros_(other[0].weight)
    state.model = other  # a tracked name: the handler follows, and saves (Horovod's set_value)
    step(other, torch.optim.SGD(other.parameters(), lr=1.0), 0)
    state.restore()
    assert torch.equal(other[0].weight, torch.zeros_like(other[0].weight))


def test_sampler_matches_horovods_order_and_resumes_mid_epoch(mgr: unidist.Manager) -> None:
    sampler = hvd.elastic.ElasticSampler(list(range(20)), shuffle=True, seed=5)
    sampler.set_epoch(1)
    order = list(range(20))
    random.Random(5 + 1).shuffle(order)
    assert list(iter(sampler)) == order and len(sampler) == 20
    assert sampler.get_indices(1, 4) == order[4:8]
    for b in range(3):
        sampler.record_batch(b, 4)
    saved = sampler.state_dict()
    resumed = hvd.elastic.ElasticSampler(list(range(20)), shuffle=True, seed=5)
    resumed.load_state_dict(saved)
    rest = list(iter(resumed))
    assert rest == order[12:] and len(resumed) == 8
    resumed.record_indices(rest[:2])  # older Horovod's per-index form
    again = hvd.elastic.ElasticSampler(list(range(20)), shuffle=True, seed=5)
    again.load_state_dict(resumed.state_dict())
    assert list(iter(again)) == order[14:]
    again.set_epoch(2)
    assert sorted(iter(again)) == list(range(20))
    assert list(iter(hvd.elastic.ElasticSampler(list(range(6)), shuffle=False))) == list(range(6))


def _train(state: Any, steps: int, fail_at: int | None = None, error: type[Exception] = ValueError) -> None:
    """``state.step`` counts finished steps; a commit after every second one."""
    while state.step < steps:
        step(state.model, state.optimizer, state.step)
        state.step += 1
        if state.step == fail_at:
            raise error("injected")
        if state.step % 2 == 0:
            state.commit()


@pytest.mark.parametrize("kind", ["sgd", "adam"])
def test_run_resumes_from_the_last_commit(mgr: unidist.Manager, tmp_path: Path, kind: str,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    ref_model, ref_opt = build(kind)
    for i in range(8):
        step(ref_model, ref_opt, i)
    train = hvd.elastic.run(_train)

    model, opt = build(kind)
    state = hvd.elastic.TorchState(model, opt, step=0)
    with pytest.raises(ValueError, match="injected"):
        train(state, 8, fail_at=5)  # commits after steps 2 and 4
    err = capsys.readouterr().err
    assert "job 'job': no commit to resume in" in err and "starting from rank 0's state on 1 rank(s)" in err, err
    assert re.search(r"the last commit is \S+/commits/job/commit-000000002 \(step 4\), written 0 s ago by 1 rank\(s\): "
                     r"run the same command again \(any number of processes\) to resume from it with "
                     r"UNIDIST_ELASTIC_JOB=job$", err, re.M), err
    job = tmp_path / "commits" / "job"
    assert sorted(p.name for p in job.iterdir()) == [".lock", "commit-000000001", "commit-000000002", "latest.json"]

    model, opt = build(kind)  # a restarted process builds everything afresh
    torch.nn.init.zeros_(model[0].weight)  # ... even differently: the commit wins
    resets: list[int] = []
    state = hvd.elastic.TorchState(model, opt, step=0)
    state.register_reset_callbacks([lambda: resets.append(state.step)])
    train(state, 8)
    err = capsys.readouterr().err
    assert "job 'job': attempt 0 on 1 rank(s) resumes: the last commit is" in err and "(step 4)" in err, err
    assert f"to start afresh instead, delete {job}" in err, err
    assert resets == [4]
    worst = max(float((v - ref_model.state_dict()[k]).abs().max()) for k, v in model.state_dict().items())
    assert worst <= 1e-6
    assert list((tmp_path / "commits").iterdir()) == []  # the job's directory is removed once the function returned


def test_engine_failure_becomes_horovod_internal_error(mgr: unidist.Manager) -> None:
    model, opt = build()
    with pytest.raises(hvd.HorovodInternalError, match=r"commit-000000001 \(step 2\).*same command again") as info:
        hvd.elastic.run(_train)(hvd.elastic.TorchState(model, opt, step=0), 8, fail_at=3, error=CollectiveTimeoutError)
    assert isinstance(info.value.__cause__, CollectiveTimeoutError)


def test_commits_reach_disk_at_most_every_interval(mgr: unidist.Manager, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIDIST_ELASTIC_COMMIT_SECONDS", "3600")
    model, opt = build()
    with pytest.raises(ValueError, match="injected"):
        hvd.elastic.run(_train)(hvd.elastic.TorchState(model, opt, step=0), 8, fail_at=7)
    assert sorted(p.name for p in (tmp_path / "commits" / "job").glob("commit-*")) == ["commit-000000001"]  # the first


def test_auto_interval_keeps_writes_under_a_tenth(mgr: unidist.Manager, monkeypatch: pytest.MonkeyPatch,
                                                  capsys: pytest.CaptureFixture[str]) -> None:
    """UNIDIST_ELASTIC_COMMIT_SECONDS=auto: a commit is written once nine times the last write's cost has
    passed since it, so a 20 ms write is made at nearly every commit and a 2 s one at most every 18 s."""
    monkeypatch.setenv("UNIDIST_ELASTIC_COMMIT_SECONDS", "auto")
    store = CommitStore.open(mgr)
    now = [100.0]
    monkeypatch.setattr(store_module.time, "monotonic", lambda: now[0])
    assert store.min_seconds is None and store.due()  # the first commit: always
    store.last_write, store.last_cost = 100.0, 0.02
    now[0] = 100.17
    assert not store.due()
    assert "a commit takes 0.02 s to write here, so one is written at most every 0.18 s" in capsys.readouterr().err
    now[0] = 100.19
    assert store.due()
    store.last_write, store.last_cost = 100.19, 2.0
    now[0] = 110.0
    assert not store.due() and capsys.readouterr().err == ""  # said once
    now[0] = 118.2
    assert store.due()
    store.remove()


def test_hosts_updated_resets_and_calls_again(mgr: unidist.Manager) -> None:
    calls: list[int] = []
    state = hvd.elastic.ObjectState(epoch=0)
    state.register_reset_callbacks([lambda: calls.append(-1)])

    @hvd.elastic.run
    def train(state: Any) -> str:
        calls.append(state.epoch)
        if len(calls) == 1:
            state.epoch = 7
            state.on_hosts_updated(1.0, HostUpdateResult.added)
            state.commit()
        return "done"

    assert train(state) == "done"
    assert calls == [0, -1, 7]


def test_refusals(mgr: unidist.Manager, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidArgumentError, match=r"hvd\.elastic\.State"):
        hvd.elastic.run(lambda s: s)(object())
    with pytest.raises(CheckpointError, match="cannot pickle"):
        # (a local bcast_object: the Manager's would refuse the lambda at the initial sync already)
        hvd.elastic.run(lambda s: s.commit())(hvd.elastic.ObjectState(bcast_object=lambda o: o, fn=lambda: 0))
    monkeypatch.setenv("HOROVOD_ELASTIC", "1")
    with pytest.raises(LaunchEnvironmentError, match="--min-np"):
        hvd.elastic.run(lambda s: s)(hvd.elastic.ObjectState(epoch=0))


def test_default_directory(mgr: unidist.Manager, monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """The job is the working directory, the script and its arguments: not the world size, not torchrun's run id
    (a fresh uuid each time torchrun --standalone starts), so the same command run again resumes."""
    monkeypatch.delenv("UNIDIST_ELASTIC_DIR")
    monkeypatch.delenv("UNIDIST_ELASTIC_JOB")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first = commit_directory(mgr)
    assert first.parent.parent == tmp_path and first.parent.name.startswith("unidist-elastic-")
    assert commit_directory(mgr) == first  # the same command, the same directory
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "9f3c")
    assert commit_directory(mgr) == first
    cfg = unidist.Config.from_env({})
    assert job_name(cfg, cwd="/a", argv=["--lr", "1"]) == job_name(cfg, cwd="/a", argv=["--lr", "1"])
    assert len({job_name(cfg, cwd="/a", argv=["--lr", "1"]), job_name(cfg, cwd="/b", argv=["--lr", "1"]),
                job_name(cfg, cwd="/a", argv=["--lr", "2"])}) == 3
    monkeypatch.setenv("UNIDIST_ELASTIC_JOB", "digits-1")
    assert commit_directory(mgr) == first.parent / "digits-1"


def test_a_second_job_of_the_same_name_is_refused(mgr: unidist.Manager, tmp_path: Path) -> None:
    """Rank 0 locks the job's directory while the job runs: the same command started twice does not share (or
    resume) commits; the lock goes with the process however it ends, and when the function returns."""
    store = CommitStore.open(mgr)
    with pytest.raises(LaunchEnvironmentError, match=r"another job named 'job' is running \(rank 0 is pid \d+ on host "
                                                     r".*UNIDIST_ELASTIC_JOB=NAME"):
        CommitStore.open(mgr)
    store.close()
    CommitStore.open(mgr).remove()
    assert not (tmp_path / "commits" / "job").exists()


def test_the_watcher_says_which_commit_when_rank_0_is_killed(tmp_path: Path) -> None:
    """A process that starts the watcher and is then killed by SIGKILL (mpiexec's end of every other rank): the
    watcher names the last commit from latest.json; one that settles ``done`` or ``said`` leaves it silent."""
    job = tmp_path / "job"
    (job / "commit-000000003").mkdir(parents=True)
    (job / "commit-000000003" / "manifest.json").write_text("{}")
    (job / "latest.json").write_text(json.dumps({"commit": "commit-000000003", "seq": 3, "size": 2,
                                                 "launcher": "mpich", "time": time.time() - 300,
                                                 "shown": {"epoch": 2, "batch": 0}}))
    code = ("import os, signal, sys; from pathlib import Path; "
            "from unidist.compat.horovod.elastic.sentinel import Sentinel; "
            f"w = Sentinel(Path({str(job)!r}), 'digits', 'run it again'); assert w.watching; "
            "(w.settle(sys.argv[1]) if sys.argv[1] != 'kill' else os.kill(os.getpid(), signal.SIGKILL))")
    for how in ("kill", "done", "said"):
        proc = subprocess.run([sys.executable, "-c", code, how], capture_output=True, text=True, timeout=60)
        if how == "kill":
            assert proc.returncode == -9
            assert (f"hvd.elastic: job 'digits' ended before its training function returned (rank 0's process is gone: "
                    f"a lost rank or the launcher ended it); the last commit is {job}/commit-000000003 (epoch 2, batch "
                    "0), written 5 min ago by 2 rank(s): run it again") in proc.stderr, proc.stderr
        else:
            assert proc.returncode == 0 and "hvd.elastic" not in proc.stderr, proc.stderr
    assert describe(tmp_path / "none") == f"no commit was written yet ({tmp_path / 'none'}): a rerun starts from the " \
        "beginning"


def test_settings_parsed() -> None:
    cfg = unidist.Config.from_env({"UNIDIST_ELASTIC_DIR": "/shared/c", "UNIDIST_ELASTIC_COMMIT_SECONDS": "2.5",
                                   "UNIDIST_ELASTIC_JOB": "bert.lr-3e4_2"})
    assert (cfg.elastic_dir, cfg.elastic_commit_seconds, cfg.elastic_job) == ("/shared/c", 2.5, "bert.lr-3e4_2")
    default = unidist.Config.from_env({})
    assert (default.elastic_commit_seconds, default.elastic_job) == (0.0, None)  # every commit written
    assert unidist.Config.from_env({"UNIDIST_ELASTIC_COMMIT_SECONDS": "auto"}).elastic_commit_seconds is None
    for name in ("../up", "a/b", "-x", "x" * 65, "sp ace"):
        with pytest.raises(ConfigError, match="UNIDIST_ELASTIC_JOB"):
            unidist.Config.from_env({"UNIDIST_ELASTIC_JOB": name})
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ConfigError, match="UNIDIST_ELASTIC_COMMIT_SECONDS"):
            unidist.Config.from_env({"UNIDIST_ELASTIC_COMMIT_SECONDS": bad})
