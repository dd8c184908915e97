"""``mgr.partitioned_build()`` (unidist/train/zero_init.py) in one process: what a parameter built inside holds,
the write-through of initialisation, ``gathered``, ``materialize``, and what is refused (the multi-rank behaviour:
tests/multiproc/test_partitioned_build.py)."""

from __future__ import annotations

import pytest
import torch

import unidist
from unidist.errors import InvalidArgumentError
from unidist.train import zero_init


def _mgr() -> unidist.Manager:
    return unidist.init(environ={"UNIDIST_DEVICE": "cpu"})


class Parent(torch.nn.Module):
    """Children built first, then the parent re-initialises them (as Hugging Face's post_init does), writes a row
    through a view (an embedding's padding row) and scales a weight in place."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(6, 4)
        self.lin = torch.nn.Linear(4, 3)
        with torch.no_grad():
            torch.nn.init.normal_(self.lin.weight, std=0.5)
            torch.nn.init.zeros_(self.emb.weight[2])
            self.lin.bias.mul_(3.0)


def _whole() -> dict[str, torch.Tensor]:
    torch.manual_seed(5)
    return Parent().state_dict()


def test_built_partitioned_holds_placeholders_and_equals_the_whole_build() -> None:
    with _mgr() as mgr:
        torch.manual_seed(5)
        with mgr.partitioned_build():
            model = Parent()
        for p in model.parameters():
            assert zero_init.is_partitioned(p) and p.untyped_storage().nbytes() == p.element_size()
            assert not any(p.stride())  # a placeholder: the parameter's shape over one element
        assert model.lin.weight.shape == (3, 4) and model.emb.weight.dtype == torch.float32
        assert zero_init.materialize(model.parameters()) == 3
        got, want = model.state_dict(), _whole()
        assert all(torch.equal(got[k], want[k]) for k in want)
        assert float(got["emb.weight"][2].abs().sum()) == 0.0 and float(got["emb.weight"][1].abs().sum()) > 0


def test_gathered_keeps_edits_only_with_a_modifier_rank() -> None:
    with _mgr() as mgr:
        with mgr.partitioned_build():
            lin = torch.nn.Linear(3, 3)
        with zero_init.gathered([lin.weight]), torch.no_grad():
            before = lin.weight.clone()
            lin.weight.fill_(7.0)  # read-only block: dropped
        with zero_init.gathered([lin.weight], modifier_rank=0), torch.no_grad():
            assert torch.equal(lin.weight, before)
            lin.weight[0].fill_(2.0)
        zero_init.materialize([lin.weight])
        assert torch.equal(lin.weight[0], torch.full((3,), 2.0)) and torch.equal(lin.weight[1:], before[1:])


def test_data_assigned_inside_the_build_is_partitioned_again() -> None:
    with _mgr() as mgr:
        with mgr.partitioned_build():
            lin = torch.nn.Linear(2, 2)
            lin.weight.data = torch.arange(4.0).view(2, 2)
        assert zero_init.is_partitioned(lin.weight) and not any(lin.weight.stride())
        zero_init.materialize([lin.weight])
        assert torch.equal(lin.weight.detach(), torch.arange(4.0).view(2, 2))


def test_writes_that_cannot_be_followed_fail_loudly() -> None:
    with _mgr() as mgr:
        with mgr.partitioned_build():
            lin = torch.nn.Linear(4, 3)
        with pytest.raises(RuntimeError, match="single memory location"), torch.no_grad():
            lin.weight.normal_()  # outside the block: torch refuses to write the placeholder
        row = lin.weight.data[0]  # a view of the placeholder taken outside the block
        with mgr.partitioned_build(), pytest.raises(InvalidArgumentError, match="GatheredParameters"), \
                torch.no_grad():
            row.zero_()


def test_disabled_builds_whole_and_a_foreign_group_is_refused() -> None:
    with _mgr() as mgr:
        with mgr.partitioned_build(enabled=False):
            lin = torch.nn.Linear(2, 2)
        assert not zero_init.is_partitioned(lin.weight)
        with pytest.raises(InvalidArgumentError, match="partitioned_build"):
            mgr.partitioned_build(group="world")
        with mgr.partitioned_build():
            built = torch.nn.Linear(2, 2)
        group = mgr.new_group([0])
        with pytest.raises(InvalidArgumentError, match="pass the same group to both"):
            mgr.prepare(built, torch.optim.SGD(built.parameters(), lr=0.1), zero_stage=3, group=group)


def test_compat_init_partitions_a_built_module_and_refuses_nvme() -> None:
    import unidist.compat.deepspeed as deepspeed
    from unidist.compat.deepspeed.exceptions import DeepSpeedUnsupportedError

    with _mgr():
        lin = torch.nn.Linear(2, 2)
        want = lin.weight.detach().clone()
        deepspeed.zero.Init(module=lin)
        assert zero_init.is_partitioned(lin.weight)
        with deepspeed.zero.GatheredParameters([lin.weight]):
            assert torch.equal(lin.weight.detach(), want)
        assert zero_init.is_partitioned(lin.weight)
        with pytest.raises(DeepSpeedUnsupportedError, match="NVMe"):
            deepspeed.zero.Init(remote_device="nvme")


def test_gathered_inside_the_build_keeps_deepspeeds_meaning() -> None:
    """GatheredParameters inside zero.Init (DeepSpeed scripts edit a layer there): with a modifier rank the edits
    stay; without one they are dropped, as DeepSpeed drops them."""
    with _mgr() as mgr:
        with mgr.partitioned_build():
            lin = torch.nn.Linear(3, 3)
            with zero_init.gathered([lin.weight, lin.bias]), torch.no_grad():
                before = lin.weight.detach().clone()
                lin.weight.fill_(7.0)
            with zero_init.gathered([lin.weight], modifier_rank=0), torch.no_grad():
                assert torch.equal(lin.weight.detach(), before)
                lin.weight[1].zero_()
        assert zero_init.is_partitioned(lin.weight) and not any(lin.weight.stride())  # inside, stride gathers
        zero_init.materialize([lin.weight])
        assert float(lin.weight[1].detach().abs().sum()) == 0.0 and torch.equal(lin.weight[0], before[0])
