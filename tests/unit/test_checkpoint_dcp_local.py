"""``save_checkpoint(format="dcp")`` on one process: the boxes that tile a flat slice (against a direct marking of
the elements), a round trip through torch's own ``dcp.load`` + ``set_state_dict`` and through unidist's reader,
and the arguments it refuses. FSDP2 resuming what several ranks wrote: tests/multiproc/test_dcp_interop.py."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

import unidist
from unidist import InvalidArgumentError
from unidist.checkpoint.dcp_writer import boxes

ON_CPU = {"UNIDIST_DEVICE": "cpu"}


@pytest.mark.parametrize("shape", [(), (7,), (3, 5), (4, 3, 5), (2, 1, 3, 4)], ids=str)
def test_boxes_tile_every_slice_exactly_once(shape: tuple[int, ...]) -> None:
    n = int(torch.Size(shape).numel())
    for start, end in itertools.combinations(range(n + 1), 2):
        seen = torch.zeros(shape, dtype=torch.int64)
        flat_order = torch.arange(n).view(shape)
        taken = 0
        for off, size, at in boxes(shape, start, end):
            index = tuple(slice(o, o + s) for o, s in zip(off, size, strict=True))
            seen[index] += 1
            # a box's elements are the flat slice's, in order, from its first element ``at``
            assert torch.equal(flat_order[index].reshape(-1), torch.arange(at, at + int(torch.Size(size).numel())))
            taken += int(torch.Size(size).numel())
        want = torch.zeros(n, dtype=torch.int64)
        want[start:end] = 1
        assert torch.equal(seen.reshape(-1), want) and taken == end - start, (start, end)


class Tied(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(11, 6)
        self.norm = torch.nn.LayerNorm(6)
        self.out = torch.nn.Linear(6, 11, bias=False)
        self.out.weight = self.emb.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.norm(self.emb(x)))  # type: ignore[no-any-return]


def trained(mgr: unidist.Manager, stage: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(0)
    model = Tied()
    model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zero_stage=stage)
    for step in range(2):
        mgr.backward(model(torch.arange(5) + step).pow(2).mean())
        opt.step()
        opt.zero_grad()
    return model, opt


@pytest.mark.parametrize("stage", [0, 3])
def test_torchs_own_load_reads_what_unidist_wrote(tmp_path: Path, stage: int) -> None:
    with unidist.init(environ=ON_CPU) as mgr:
        model, opt = trained(mgr, stage)
        path = mgr.save_checkpoint(tmp_path / "ck", model, opt, format="dcp", step=2, note="hi")
        want, want_opt = mgr.full_state_dict(model), mgr.full_optimizer_state_dict(opt)
    assert sorted(p.name for p in path.iterdir()) == [".metadata", "__0_0.distcp"]
    theirs = Tied()
    their_opt = torch.optim.AdamW(theirs.parameters(), lr=0.5)
    msd, osd = get_state_dict(theirs, their_opt)
    state = {"model": msd, "optim": osd, "step": 0, "note": ""}
    dcp.load(state, checkpoint_id=str(path), no_dist=True)
    set_state_dict(theirs, their_opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    assert (state["step"], state["note"]) == (2, "hi")
    assert all(torch.equal(theirs.state_dict()[k], v) for k, v in want.items())
    got = their_opt.state_dict()
    assert got["param_groups"][0]["lr"] == 1e-2
    for i, st in want_opt["state"].items():  # the optimizer's parameters in the same order on both sides
        assert all(torch.equal(got["state"][i][k], v) for k, v in st.items()), i


def test_unidist_reads_it_back_at_another_stage(tmp_path: Path) -> None:
    with unidist.init(environ=ON_CPU) as mgr:
        model, opt = trained(mgr, 0)
        path = mgr.save_checkpoint(tmp_path / "ck", model, opt, format="dcp", step=2)
        want = mgr.full_state_dict(model)
        fresh = Tied()
        fresh, fresh_opt = mgr.prepare(fresh, torch.optim.AdamW(fresh.parameters()), zero_stage=3)
        assert mgr.load_checkpoint(path, fresh, fresh_opt) == {"step": 2}
        assert all(torch.equal(mgr.full_state_dict(fresh)[k], v) for k, v in want.items())


@pytest.mark.parametrize(("kwargs", "says"), [({"format": "zip"}, r"takes 'unidist' \(the default\), 'dcp'"),
                                              ({"format": "dcp", "keep": 2}, "keep= and blocking=False apply"),
                                              ({"format": "dcp", "blocking": False}, "keep= and blocking=False")])
def test_refused_arguments(tmp_path: Path, kwargs: dict[str, object], says: str) -> None:
    with unidist.init(environ=ON_CPU) as mgr:
        model, opt = trained(mgr, 0)
        with pytest.raises(InvalidArgumentError, match=says):
            mgr.save_checkpoint(tmp_path / "ck", model, opt, **kwargs)  # type: ignore[call-overload]
    assert not list(tmp_path.iterdir())
