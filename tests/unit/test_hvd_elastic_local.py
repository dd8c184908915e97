"""hvd.elastic on one process: State/ObjectState/TorchState commit and restore, ElasticSampler, and run()'s
resume, reset and refusals. Launcher restarts are tested under torchrun and mpiexec
(tests/multiproc/test_hvd_elastic.py)."""

from __future__ import annotations

import random
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unidist
import unidist.compat.horovod as hvd
from unidist import CheckpointError, CollectiveTimeoutError, ConfigError, InvalidArgumentError, LaunchEnvironmentError
from unidist.compat.horovod.elastic.state import HostUpdateResult
from unidist.compat.horovod.elastic.store import commit_directory

X = torch.randn(24, 5, generator=torch.Generator().manual_seed(3))
Y = torch.randn(24, 2, generator=torch.Generator().manual_seed(4))


@pytest.fixture
def mgr(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[unidist.Manager]:
    monkeypatch.setenv("UNIDIST_ELASTIC_DIR", str(tmp_path / "commits"))
    monkeypatch.setenv("UNIDIST_ELASTIC_COMMIT_SECONDS", "0")
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
    assert "the last commit is" in capsys.readouterr().err
    assert [p.name for p in sorted((tmp_path / "commits").iterdir())] == ["commit-000000001", "commit-000000002"]

    model, opt = build(kind)  # a restarted process builds everything afresh
    torch.nn.init.zeros_(model[0].weight)  # ... even differently: the commit wins
    resets: list[int] = []
    state = hvd.elastic.TorchState(model, opt, step=0)
    state.register_reset_callbacks([lambda: resets.append(state.step)])
    train(state, 8)
    assert "resuming from" in capsys.readouterr().err
    assert resets == [4]
    worst = max(float((v - ref_model.state_dict()[k]).abs().max()) for k, v in model.state_dict().items())
    assert worst <= 1e-6
    assert list((tmp_path / "commits").iterdir()) == []  # the commits are removed once the function returned


def test_engine_failure_becomes_horovod_internal_error(mgr: unidist.Manager) -> None:
    model, opt = build()
    with pytest.raises(hvd.HorovodInternalError, match=r"commit-000000001.*'step': 2.*same command again") as info:
        hvd.elastic.run(_train)(hvd.elastic.TorchState(model, opt, step=0), 8, fail_at=3, error=CollectiveTimeoutError)
    assert isinstance(info.value.__cause__, CollectiveTimeoutError)


def test_commits_reach_disk_at_most_every_interval(mgr: unidist.Manager, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("UNIDIST_ELASTIC_COMMIT_SECONDS", "3600")
    model, opt = build()
    with pytest.raises(ValueError, match="injected"):
        hvd.elastic.run(_train)(hvd.elastic.TorchState(model, opt, step=0), 8, fail_at=7)
    assert [p.name for p in (tmp_path / "commits").iterdir()] == ["commit-000000001"]  # the first only


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
    monkeypatch.delenv("UNIDIST_ELASTIC_DIR")
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.delenv("TORCHELASTIC_RUN_ID", raising=False)
    first = commit_directory(mgr)
    assert first.parent.parent == tmp_path and first.parent.name.startswith("unidist-elastic-")
    assert commit_directory(mgr) == first  # the same command, the same directory
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "job/42")
    assert commit_directory(mgr).name == "torchrun-job_42"


def test_settings_parsed() -> None:
    cfg = unidist.Config.from_env({"UNIDIST_ELASTIC_DIR": "/shared/c", "UNIDIST_ELASTIC_COMMIT_SECONDS": "2.5"})
    assert (cfg.elastic_dir, cfg.elastic_commit_seconds) == ("/shared/c", 2.5)
    assert unidist.Config.from_env({}).elastic_commit_seconds == 10.0
    for bad in ("-1", "soon", "inf"):
        with pytest.raises(ConfigError, match="UNIDIST_ELASTIC_COMMIT_SECONDS"):
            unidist.Config.from_env({"UNIDIST_ELASTIC_COMMIT_SECONDS": bad})
