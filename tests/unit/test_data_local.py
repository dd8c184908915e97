"""``mgr.to_device`` and ``mgr.loader``: batches on the rank's device without boilerplate. The meta device stands in
for a GPU where a move must be seen (tensors really move there on a CPU-only machine); the GPU suite runs them on
CUDA (tests/multiproc/test_gpu.py)."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any, NamedTuple

import pytest
import torch

import unidist
from unidist import InvalidArgumentError
from unidist.train.data import Loader
from unidist.tree import to_device

META = torch.device("meta")


class Pair(NamedTuple):
    x: torch.Tensor
    y: torch.Tensor


@dataclasses.dataclass(frozen=True)
class Batch:
    ids: torch.Tensor
    note: str


def test_to_device_moves_every_tensor_and_keeps_every_container() -> None:
    batch = {"pair": Pair(torch.ones(2), torch.zeros(2, dtype=torch.long)), "b": Batch(torch.arange(3), "n"),
             "list": [torch.ones(1), "text", 3]}
    out = to_device(batch, META)
    assert type(out["pair"]) is Pair and out["pair"].x.device == META and out["pair"].y.dtype == torch.long
    assert type(out["b"]) is Batch and out["b"].ids.device == META and out["b"].note == "n"
    assert out["list"][0].device == META and out["list"][1:] == ["text", 3]
    assert batch["pair"].x.device.type == "cpu"  # the input is left as it was


def test_to_device_leaves_what_is_there() -> None:
    batch = {"x": torch.ones(2)}
    assert to_device(batch, torch.device("cpu")) is batch


def test_manager_to_device_uses_its_device() -> None:
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        batch = [torch.ones(2)]
        assert mgr.to_device(batch) is batch and mgr.device.type == "cpu"


def _data(n: int = 10) -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(torch.arange(n).float(), torch.arange(n))


def _rows(loader: Any) -> list[int]:
    return [int(v) for _, ys in loader for v in ys]


def test_each_rank_gets_its_share_and_a_new_order_every_epoch() -> None:
    ranks = [Loader(_data(), rank=r, size=2, device=torch.device("cpu"), batch_size=2, shuffle=True, seed=3)
             for r in range(2)]
    first = [_rows(lo) for lo in ranks]
    assert sorted(first[0] + first[1]) == list(range(10)) and not set(first[0]) & set(first[1])
    second = [_rows(lo) for lo in ranks]  # iterating again is the next epoch: another permutation, same on all
    assert sorted(second[0] + second[1]) == list(range(10)) and second != first
    ranks[0].set_epoch(0)
    assert _rows(ranks[0]) == first[0]  # a resumed run replays epoch 0's order
    assert ranks[0].epoch == 1 and len(ranks[0]) == 3  # 5 rows in batches of 2


def test_batches_arrive_on_the_device() -> None:
    loader = Loader(_data(), rank=1, size=2, device=META, batch_size=4)
    xs, ys = next(iter(loader))
    assert xs.device == META and ys.device == META
    assert not loader.loader.pin_memory  # pinned only for a GPU


def test_uneven_shares_wrap_around_or_drop() -> None:
    wrap = [_rows(Loader(_data(5), rank=r, size=2, device=torch.device("cpu"), batch_size=8)) for r in range(2)]
    assert [len(w) for w in wrap] == [3, 3]  # every rank as many rows: the first row again
    drop = [_rows(Loader(_data(5), rank=r, size=2, device=torch.device("cpu"), batch_size=1, drop_last=True))
            for r in range(2)]
    assert [len(d) for d in drop] == [2, 2]


@pytest.mark.parametrize(("kwargs", "match"), [({"sampler": None}, "sampler"), ({"shuffle": True}, None),
                                                ({"batch_size": 0}, "batch_size=0")])
def test_what_would_undo_the_sharding_is_refused(kwargs: dict[str, Any], match: str | None) -> None:
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        if "shuffle" in kwargs:  # shuffle is loader()'s own argument: accepted
            mgr.loader(_data(), **kwargs)
            return
        with pytest.raises(InvalidArgumentError, match=match):
            mgr.loader(_data(), **kwargs)


def test_an_iterable_dataset_is_refused_with_the_way_out() -> None:
    class Stream(torch.utils.data.IterableDataset[int]):
        def __iter__(self) -> Any:
            return iter(range(3))

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr, pytest.raises(InvalidArgumentError,
                                                                                match="map-style"):
        mgr.loader(Stream())


def _ids(loader: Loader, batches: int) -> list[int]:
    """The entries of the loader's next ``batches`` batches (fetching no more: a batch fetched counts as read)."""
    return [i for batch in itertools.islice(loader, batches) for i in batch.tolist()]


def test_a_loader_resumes_mid_epoch_at_any_number_of_ranks() -> None:
    """The position counts the entries of the epoch's order all ranks consumed together; a loader given it goes on
    with the rest of that epoch (each entry once, spread over its own ranks), then the next epoch as usual."""
    data = list(range(20))
    two = [Loader(data, rank=r, size=2, device=torch.device("cpu"), batch_size=2, shuffle=True, seed=4)
           for r in range(2)]
    seen = [i for loader in two for i in _ids(loader, 3)]  # 3 batches each, then stopped mid-epoch
    assert [loader.state_dict() for loader in two] == [{"epoch": 0, "samples": 12}] * 2
    one = Loader(data, rank=0, size=1, device=torch.device("cpu"), batch_size=4, shuffle=True, seed=4)
    one.load_state_dict(two[0].state_dict())
    rest = [i for batch in one for i in batch.tolist()]
    assert sorted(seen + rest) == data and len(rest) == 8  # the epoch's other 8 entries, once each
    assert one.state_dict() == {"epoch": 1, "samples": 0} and one.epoch == 1
    assert sorted(i for batch in one for i in batch.tolist()) == data  # then a whole epoch
    with pytest.raises(InvalidArgumentError, match="not a loader position"):
        one.load_state_dict({"epoch": 0, "samples": 21})


def test_checkpoints_keep_a_loaders_position_and_refuse_other_loaders(tmp_path: Any) -> None:
    from unidist.errors import CheckpointError

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model = torch.nn.Linear(2, 2)
        loader = mgr.loader(list(range(10)), batch_size=2, shuffle=True, seed=1)
        _ids(loader, 2)
        with pytest.raises(InvalidArgumentError, match=r"loader\(\.\.\.\)"):
            mgr.save_checkpoint(tmp_path / "bad", model, loader=torch.utils.data.DataLoader(list(range(4))))
        mgr.save_checkpoint(tmp_path / "ck", model, loader=loader)
        mgr.save_checkpoint(tmp_path / "plain", model)
        again = mgr.loader(list(range(10)), batch_size=2, shuffle=True, seed=1)
        assert mgr.load_checkpoint(tmp_path / "ck", model, loader=again) == {}
        assert again.state_dict() == {"epoch": 0, "samples": 4}
        with pytest.raises(CheckpointError, match="no loader position"):
            mgr.load_checkpoint(tmp_path / "plain", model, loader=again)
