"""The precision modes' one table (unidist/precisions.py) and the places that read it: each row's dtypes are real
torch dtypes with the epsilon torch gives them, a model prepared in a mode holds what the row says, DeepSpeed's
sections map both ways, and verify's bound takes each mode's weights' epsilon (a new mode cannot silently get
float32's)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import unidist
from unidist.engines.deepspeed.config import config_precision, precision_section
from unidist.precisions import EPSILON, MODES, PRECISIONS, masters_of
from unidist.train.precision import Precision
from unidist.verify.envelope import EPS


def test_every_dtype_named_is_torchs_with_its_epsilon() -> None:
    for name, eps in EPSILON.items():
        assert torch.finfo(getattr(torch, name)).eps == eps
    for mode in MODES.values():
        assert {mode.params, mode.compute, mode.reduce, mode.master} <= set(EPSILON), mode
        assert EPS[mode.name] == torch.finfo(getattr(torch, mode.params)).eps


@pytest.mark.parametrize("name", PRECISIONS)
def test_a_prepared_model_holds_what_its_row_says(name: str) -> None:
    """One process (LocalManager): the parameters' dtype, what the optimizer steps, the output's dtype."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    mode = Precision.of(name)
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:  # one process: the local backend
        model, opt = mgr.prepare(model, opt, precision=name)
        assert {p.dtype for p in model.parameters()} == {mode.params}
        stepped = {p.dtype for g in opt.param_groups for p in g["params"]}
        assert stepped == {mode.master}, (name, stepped)
        before = [p.detach().clone() for p in model.parameters()]
        out = model(torch.randn(5, 4))
        assert out.dtype == torch.float32
        mgr.backward(out.mean())  # small: fp16's first scale (65536) must not overflow
        opt.step()
        opt.zero_grad()
        moved = [not torch.equal(a, p) for a, p in zip(before, model.parameters(), strict=True)]
        assert all(moved), (name, moved)  # the copies' update reached the model's parameters
        if mode.keeps_masters:
            copies = [p for g in opt.param_groups for p in g["params"]]
            assert all(torch.equal(c.to(mode.params), p) for c, p in zip(copies, model.parameters(), strict=True))
            assert all(p.grad is None for p in model.parameters())  # zero_grad cleared the model's too


def test_deepspeed_sections_map_both_ways() -> None:
    for mode in MODES.values():
        section = precision_section(mode.name)
        if mode.autocast:
            assert section["torch_autocast"]["dtype"] == mode.compute
        elif mode.keeps_masters:
            assert section == {"bf16": {"enabled": True}}
            assert config_precision(section)[0] == mode.name
        else:
            assert section == {}
    assert masters_of("bfloat16") is MODES["bf16-master"] and masters_of("float16") is None


def test_master_copies_skip_frozen_parameters_and_survive_a_checkpoint(tmp_path: Path) -> None:
    """bf16-master at stage 0 with a frozen layer: the optimizer keeps the frozen parameter itself (no copy, no step),
    and a fresh prepare that loads the checkpoint holds the same float32 copies, not the rounded weights."""

    def build() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
        model[0].requires_grad_(False)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-4)

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model, opt = mgr.prepare(*build(), precision="bf16-master")
        frozen = [p for p in model.parameters() if not p.requires_grad]
        stepped = [p for g in opt.param_groups for p in g["params"]]
        assert all(any(p is q for q in stepped) for p in frozen)  # the group holds the frozen ones themselves
        assert {p.dtype for p in stepped if p.requires_grad} == {torch.float32}
        for _ in range(2):
            mgr.backward(model(torch.randn(5, 4)).mean())
            opt.step()
            opt.zero_grad()
        copies = [p.detach().clone() for p in stepped if p.requires_grad]
        assert any(not torch.equal(c, c.to(torch.bfloat16).float()) for c in copies)  # finer than the weights
        mgr.save_checkpoint(tmp_path / "ck", model, opt)
        opt.remove_hooks()
        model2, opt2 = mgr.prepare(*build(), precision="bf16-master")
        mgr.load_checkpoint(tmp_path / "ck", model2, opt2)
        again = [p.detach() for g in opt2.param_groups for p in g["params"] if p.requires_grad]
        assert all(torch.equal(a, b) for a, b in zip(copies, again, strict=True))
        assert all(torch.equal(a, b) for a, b in zip(model.state_dict().values(), model2.state_dict().values(),
                                                     strict=True))
