"""Checkpoints on one process: format, atomicity, retention, and every refusal before anything changes.

Cross-backend, cross-world-size and crash tests run under the real launchers (tests/multiproc/test_checkpoint.py).
"""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path

import pytest
import torch

import unidist
from unidist import CheckpointCorruptError, CheckpointError, CheckpointMismatchError, InvalidArgumentError

# the models and batches here are CPU tensors: the Manager is told the CPU, so that a GPU machine runs the same tests
ON_CPU = {"UNIDIST_DEVICE": "cpu"}


def make(width: int = 7, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(5, width), torch.nn.Tanh(), torch.nn.Linear(width, 2)).to(dtype)


@pytest.fixture
def mgr() -> unidist.Manager:
    with unidist.init(environ=ON_CPU) as m:
        yield m


def trained(mgr: unidist.Manager, zero_stage: int = 0) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = make()
    model, opt = mgr.prepare(model, torch.optim.Adam(model.parameters(), lr=1e-2), zero_stage=zero_stage)
    for step in range(2):
        mgr.backward(model(torch.full((3, 5), float(step))).pow(2).sum())
        opt.step()
        opt.zero_grad()
    return model, opt


def snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_round_trip_and_layout(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = trained(mgr)
    path = mgr.save_checkpoint(tmp_path / "ck", model, opt, step=2, note="hi", lrs=[0.1, 0.2])
    assert sorted(p.name for p in path.iterdir()) == ["manifest.json", "meta.pt", "shard-00000-of-00001.pt"]
    manifest = json.loads((path / "manifest.json").read_text())
    assert manifest["format"] == "unidist-checkpoint" and manifest["world_size"] == 1
    assert manifest["state"]["model"]["0.weight"] == {"shape": [7, 5], "dtype": "torch.float32"}
    assert manifest["state"]["optimizer"]["class"] == "Adam"
    fresh = make()
    fresh, fresh_opt = mgr.prepare(fresh, torch.optim.Adam(fresh.parameters(), lr=5.0))
    extra = mgr.load_checkpoint(path, fresh, fresh_opt)
    assert extra == {"step": 2, "note": "hi", "lrs": [0.1, 0.2]}
    for k, v in model.state_dict().items():
        assert torch.equal(fresh.state_dict()[k], v)
    got, want = fresh_opt.state_dict(), opt.state_dict()
    assert got["param_groups"][0]["lr"] == 1e-2
    for i, st in want["state"].items():
        for key, value in st.items():
            assert torch.equal(got["state"][i][key], value), (i, key)


def test_weights_only(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, _ = trained(mgr, zero_stage=3)
    path = mgr.save_checkpoint(tmp_path / "w", model)
    assert "optimizer" not in json.loads((path / "manifest.json").read_text())["state"]
    fresh = make()
    fresh = mgr.prepare(fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))[0]
    mgr.load_checkpoint(path, fresh)
    full = mgr.full_state_dict(model)
    assert all(torch.equal(fresh.state_dict()[k], v) for k, v in full.items())
    with pytest.raises(CheckpointMismatchError, match="without an optimizer"):
        mgr.load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


@pytest.mark.parametrize(("other", "words"), [
    (lambda: make(width=8), "'0.weight' is torch.float32 [7, 5] in the checkpoint and torch.float32 [8, 5]"),
    (lambda: make(dtype=torch.float64), "'0.weight' is torch.float32 [7, 5] in the checkpoint and torch.float64"),
    (lambda: torch.nn.Sequential(torch.nn.Linear(5, 7)), "the checkpoint has '2.weight', which the model does not"),
    (lambda: torch.nn.Sequential(make(), torch.nn.Linear(2, 2)), "the model has '0.0.weight'"),
])
def test_mismatch_names_the_parameter_and_changes_nothing(mgr: unidist.Manager, tmp_path: Path, other, words) -> None:
    model, opt = trained(mgr)
    path = mgr.save_checkpoint(tmp_path / "ck", model, opt)
    target = other()
    before = snapshot(target)
    with pytest.raises(CheckpointMismatchError) as info:
        mgr.load_checkpoint(path, target)
    assert words in str(info.value)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


def test_optimizer_class_mismatch(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = trained(mgr)
    path = mgr.save_checkpoint(tmp_path / "ck", model, opt)
    fresh = make()
    with pytest.raises(CheckpointMismatchError, match="holds Adam state and the optimizer is SGD"):
        mgr.load_checkpoint(path, fresh, torch.optim.SGD(fresh.parameters(), lr=0.1))


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "manifest"])
def test_damaged_files_are_typed_errors(mgr: unidist.Manager, tmp_path: Path, damage: str) -> None:
    model, opt = trained(mgr)
    path = mgr.save_checkpoint(tmp_path / "ck", model, opt)
    shard = path / "shard-00000-of-00001.pt"
    if damage == "truncate":
        shard.write_bytes(shard.read_bytes()[:100])
    elif damage == "flip":
        data = bytearray(shard.read_bytes())
        data[len(data) // 2] ^= 0xFF
        shard.write_bytes(bytes(data))
    elif damage == "delete":
        shard.unlink()
    else:
        (path / "manifest.json").write_text("{not json")
    target = make()
    before = snapshot(target)
    with pytest.raises(CheckpointCorruptError) as info:
        mgr.load_checkpoint(path, target)
    assert ("manifest.json" if damage == "manifest" else "shard-00000-of-00001.pt") in str(info.value)
    assert all(torch.equal(target.state_dict()[k], v) for k, v in before.items())


def test_not_a_checkpoint(mgr: unidist.Manager, tmp_path: Path) -> None:
    with pytest.raises(CheckpointError, match="not a complete unidist checkpoint"):
        mgr.load_checkpoint(tmp_path, make())


def test_unsafe_extra_is_refused_and_nothing_is_published(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = trained(mgr)
    for thing in (Fraction(1, 3), lambda: 0):  # picklable but refused by weights_only; not picklable at all
        with pytest.raises(CheckpointError, match="weights_only"):
            mgr.save_checkpoint(tmp_path / "ck", model, opt, thing=thing)
    assert mgr.latest_checkpoint(tmp_path) is None
    assert list(tmp_path.iterdir()) == []  # the temporary directory went with the failed save


def test_keep_and_latest(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = trained(mgr)
    for step in range(4):
        mgr.save_checkpoint(tmp_path / f"step-{step}", model, opt, keep=2, step=step)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step-2", "step-3"]
    (tmp_path / ".step-4.tmp-1-1").mkdir()  # an unfinished save (crashed): never taken for a checkpoint
    assert mgr.latest_checkpoint(tmp_path) == tmp_path / "step-3"
    assert mgr.latest_checkpoint(tmp_path / "nothing-here") is None
    with pytest.raises(InvalidArgumentError, match="keep=0"):
        mgr.save_checkpoint(tmp_path / "x", model, opt, keep=0)


def test_overwrite_in_place(mgr: unidist.Manager, tmp_path: Path) -> None:
    model, opt = trained(mgr)
    mgr.save_checkpoint(tmp_path / "ck", model, opt, step=1)
    mgr.save_checkpoint(tmp_path / "ck", model, opt, step=2)
    assert mgr.load_checkpoint(tmp_path / "ck", model, opt) == {"step": 2}
    assert [p.name for p in tmp_path.iterdir()] == ["ck"]  # the replaced one is gone


class _OverlappingWorld:
    """Rank 0 of 2 whose peer reports a data-parallel group {0, 1} while rank 0's model is prepared over {0}:
    the groups do not partition the world, so no part numbering is consistent."""

    rank, size, backend = 0, 2, "fake"

    def broadcast_object(self, obj: object, root: int = 0) -> object:
        return obj

    def allgather_object(self, obj: object) -> list[object]:
        return [obj, (0, 1)]

    def barrier(self) -> None:
        pass


def test_layouts_whose_groups_do_not_partition_the_world_are_refused(tmp_path: Path) -> None:
    import unidist.checkpoint as ckpt

    layout = ckpt.FullLayout(0, 1, make(), None, ranks=(0,))
    with pytest.raises(InvalidArgumentError, match="do not partition the world"):
        ckpt.save(_OverlappingWorld(), tmp_path / "c", layout)
    with pytest.raises(InvalidArgumentError, match="do not partition the world"):
        ckpt.load(_OverlappingWorld(), tmp_path / "c", layout)
    assert not list(tmp_path.iterdir())  # refused before anything was written
