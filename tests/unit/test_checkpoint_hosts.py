"""Checkpoints on hosts without a shared filesystem, in one process: ranks are threads, each "host" a
directory of its own (the different-paths-per-host case; the same path on different disks runs on the
simulated cluster, tests/cluster/test_cluster_checkpoints.py).
"""

from __future__ import annotations

import json
import pickle
import shutil
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import unidist.checkpoint as ckpt
import unidist.checkpoint.local_disks as hosts
from unidist import CheckpointCorruptError, CheckpointError, CheckpointMissingError

_HOST = threading.local()


class ThreadWorld:
    """Rank ``rank`` of ``size`` threads; objects travel pickled, as between processes."""

    backend = "fake"

    def __init__(self, rank: int, size: int, common: dict[str, Any]) -> None:
        self.rank, self.size, self.common = rank, size, common

    def allgather_object(self, obj: Any) -> list[Any]:
        slots, gate = self.common["slots"], self.common["gate"]
        slots[self.rank] = pickle.dumps(obj)
        gate.wait()
        out = [pickle.loads(s) for s in slots]
        gate.wait()
        return out

    def broadcast_object(self, obj: Any, root: int = 0) -> Any:
        return self.allgather_object(obj)[root]

    def barrier(self) -> None:
        self.common["gate"].wait()


@pytest.fixture(autouse=True)
def per_thread_hosts(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(hosts, "host_name", lambda: _HOST.name)
    monkeypatch.setattr(ckpt, "host_name", lambda: _HOST.name)


def ranks(placement: list[str], fn: Callable[[ThreadWorld], Any]) -> list[Any]:
    """Run ``fn`` on one thread per rank (``placement``: each rank's host); each rank's result or exception."""
    common = {"slots": [None] * len(placement), "gate": threading.Barrier(len(placement), timeout=60)}
    out: list[Any] = [None] * len(placement)

    def main(rank: int) -> None:
        _HOST.name = placement[rank]
        try:
            out[rank] = fn(ThreadWorld(rank, len(placement), common))
        except Exception as err:  # the test looks at every rank's
            out[rank] = err
    threads = [threading.Thread(target=main, args=(r,)) for r in range(len(placement))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return out


def make() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Sequential(torch.nn.Linear(6, 10), torch.nn.Tanh(), torch.nn.Linear(10, 3))
    g = torch.Generator().manual_seed(0)  # not torch.manual_seed: the ranks are threads sharing its state
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model, torch.optim.Adam(model.parameters(), lr=1e-2)


def trained() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model, opt = make()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        torch.nn.functional.mse_loss(model(torch.randn(8, 6, generator=g)), torch.randn(8, 3, generator=g)).backward()
        opt.step()
        opt.zero_grad()
    return model, opt


def save(dirs: list[Path], step: int = 3, names: list[str] | None = None) -> list[Any]:
    def one(w: ThreadWorld) -> Path:
        model, opt = trained()
        return ckpt.save(w, dirs[w.rank] / "ck", ckpt.FullLayout(w.rank, w.size, model, opt), keep=1,
                         extra={"step": step})
    return ranks(names or [d.name for d in dirs], one)


def load(dirs: list[Path], names: list[str] | None = None) -> list[Any]:
    def one(w: ThreadWorld) -> Any:
        model, opt = make()
        extra = ckpt.load(w, dirs[w.rank] / "ck", ckpt.FullLayout(w.rank, w.size, model, opt))
        return extra, model.state_dict(), opt.state_dict()
    return ranks(names or [d.name for d in dirs], one)


def same_as_trained(result: Any) -> None:
    assert not isinstance(result, BaseException), result
    extra, state, opt_state = result
    model, opt = trained()
    assert extra == {"step": 3}
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    want = opt.state_dict()["state"]
    assert all(torch.equal(opt_state["state"][i][k], v) for i, st in want.items() for k, v in st.items())


def test_each_host_keeps_its_shards_and_one_replicated_manifest(tmp_path: Path) -> None:
    h1, h2 = tmp_path / "h1", tmp_path / "h2"
    saved = save([h1, h1, h2, h2])
    assert saved == [h1 / "ck"] * 2 + [h2 / "ck"] * 2
    assert sorted(p.name for p in (h1 / "ck").iterdir()) == [
        "manifest.json", "meta.pt", "shard-00000-of-00004.pt", "shard-00001-of-00004.pt"]
    assert sorted(p.name for p in (h2 / "ck").iterdir()) == [
        "manifest.json", "meta.pt", "shard-00002-of-00004.pt", "shard-00003-of-00004.pt"]
    manifest = (h1 / "ck" / "manifest.json").read_text()
    assert manifest == (h2 / "ck" / "manifest.json").read_text()
    assert (h1 / "ck" / "meta.pt").read_bytes() == (h2 / "ck" / "meta.pt").read_bytes()
    m = json.loads(manifest)
    assert m["storage"] == [
        {"hosts": ["h1"], "ranks": [0, 1], "path": str(h1 / "ck"),
         "files": ["shard-00000-of-00004.pt", "shard-00001-of-00004.pt"]},
        {"hosts": ["h2"], "ranks": [2, 3], "path": str(h2 / "ck"),
         "files": ["shard-00002-of-00004.pt", "shard-00003-of-00004.pt"]}]
    assert [f["host"] for f in m["files"]] == ["h1", "h1", "h2", "h2"]
    assert not [p for p in tmp_path.rglob(".*")]  # no temporary directory left on either host
    # the same layout resumes; so do 3 hosts (h3 has nothing: it is sent the manifest and every shard)
    for result in load([h1, h1, h2, h2]):
        same_as_trained(result)
    for result in load([h1, h2, tmp_path / "h3"]):
        same_as_trained(result)
    # the hosts' directories copied together make the checkpoint a shared filesystem would have held
    shutil.copytree(h2 / "ck", h1 / "ck", dirs_exist_ok=True)
    for result in load([h1]):
        same_as_trained(result)


def test_one_shared_directory_writes_the_old_format(tmp_path: Path) -> None:
    shared = tmp_path / "nfs"
    save([shared] * 3, names=["h1", "h2", "h3"])  # three hosts that all see every file
    m = json.loads((shared / "ck" / "manifest.json").read_text())
    assert "storage" not in m and not any("host" in f for f in m["files"])
    assert sorted(p.name for p in (shared / "ck").iterdir()) == [
        "manifest.json", "meta.pt", *(f"shard-0000{r}-of-00003.pt" for r in range(3))]
    for result in load([shared] * 2, names=["h1", "h2"]):
        same_as_trained(result)


def test_a_missing_host_directory_is_named_with_the_fix(tmp_path: Path) -> None:
    h1, h2 = tmp_path / "h1", tmp_path / "h2"
    save([h1, h1, h2, h2])
    results = load([h1, h1])
    for r in results:
        assert isinstance(r, CheckpointMissingError) and isinstance(r, CheckpointCorruptError), r
    text = str(results[0])
    assert text == str(results[1])
    assert (f"no host of this job has shard-00002-of-00004.pt, shard-00003-of-00004.pt (written by ranks 2, 3 on h2 "
            f"into its {h2 / 'ck'})") in text, text
    assert "without a shared filesystem" in text and "this job runs on h1 (ranks 0, 1)" in text, text
    assert f"rsync -a h2:{h2 / 'ck'}/ {h1 / 'ck'}/" in text, text


def test_hosts_that_completed_different_saves_are_refused(tmp_path: Path) -> None:
    h1, h2 = tmp_path / "h1", tmp_path / "h2"
    save([h1, h2], step=3)
    shutil.copytree(h2 / "ck", tmp_path / "old")
    save([h1, h2], step=4)
    shutil.rmtree(h2 / "ck")
    shutil.copytree(tmp_path / "old", h2 / "ck")  # as if the second save had stopped before h2 published
    results = load([h1, h2])
    assert all(isinstance(r, CheckpointError) for r in results), results
    assert "the ranks do not see the same checkpoint (h2 (rank 1) the one saved at" in str(results[0]), results[0]
    assert "; h1 (rank 0) the one saved at" in str(results[0]), results[0]


def test_inconsistent_visibility_is_a_mount_problem() -> None:
    views = [("h1", "/c", [True, False, False]), ("h2", "/c", [False, True, False]), ("h3", "/c", [True, True, True])]
    with pytest.raises(CheckpointError, match="h1 sees the files of h1; h2 sees the files of h2; h3 sees the files "
                                              "of h1, h2, h3"):
        hosts.domains(views, Path("/c"))
    assert hosts.domains([("h1", "/c", [True, False, True]), ("h2", "/c", [False, True, False]),
                          ("h3", "/c", [True, False, True])], Path("/c")) == [[0, 2], [1]]


def test_hosts_sharing_a_filesystem_form_one_domain(tmp_path: Path) -> None:
    nfs, local = tmp_path / "nfs", tmp_path / "local"
    save([nfs, nfs, local], names=["h1", "h2", "h3"])  # h1 and h2 mount the same directory, h3 its own disk
    storage = json.loads((local / "ck" / "manifest.json").read_text())["storage"]
    assert [(s["hosts"], s["ranks"]) for s in storage] == [(["h1", "h2"], [0, 1]), (["h3"], [2])]
    assert sorted(p.name for p in (nfs / "ck").glob("shard-*")) == [f"shard-0000{r}-of-00003.pt" for r in (0, 1)]
    for result in load([nfs, nfs, local], names=["h1", "h2", "h3"]):
        same_as_trained(result)


def test_keep_applies_on_every_host(tmp_path: Path) -> None:
    h1, h2 = tmp_path / "h1", tmp_path / "h2"

    def one(w: ThreadWorld, step: int) -> Path:
        model, opt = trained()
        where = [h1, h2][w.rank] / f"step-{step}"
        return ckpt.save(w, where, ckpt.FullLayout(w.rank, w.size, model, opt), keep=1, extra={"step": step})
    for step in (3, 4):
        assert not any(isinstance(r, BaseException) for r in ranks(["h1", "h2"], lambda w, s=step: one(w, s)))
    assert [sorted(p.name for p in d.iterdir()) for d in (h1, h2)] == [["step-4"], ["step-4"]]
