"""``unidist.parallel.moe`` in one process (the local backend): the layer's output, ``l_aux`` and ``exp_counts``
against the same routing written out token by token, gradients through prepare, and the refusals. The numbers
against real DeepSpeed at 2 and 4 ranks are tests/multiproc/test_ds_examples.py's (``test_moe_path_...``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import unidist
from unidist.errors import InvalidArgumentError
from unidist.parallel.moe import MoE, is_expert_param

pytestmark = pytest.mark.local


@pytest.fixture(autouse=True)
def mgr(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    monkeypatch.setenv("UNIDIST_BACKEND", "local")
    monkeypatch.setenv("UNIDIST_DEVICE", "cpu")
    with unidist.init() as m:
        yield m


def _layer(k: int, drop_tokens: bool = True, capacity_factor: float = 1.0) -> MoE:
    torch.manual_seed(0)
    expert = torch.nn.Sequential(torch.nn.Linear(6, 6), torch.nn.Tanh())
    return MoE(6, expert, num_experts=3, k=k, capacity_factor=capacity_factor, min_capacity=0,
               drop_tokens=drop_tokens, use_rts=False, group=unidist.get_manager())


def _reference(layer: MoE, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Token by token, in the order the tokens come (no capacity: drop_tokens=False keeps every token)."""
    gates = torch.softmax(x @ layer.deepspeed_moe.gate.wg.weight.t(), dim=1)
    experts = layer.deepspeed_moe.experts.deepspeed_experts
    out = torch.zeros_like(x)
    chosen = torch.zeros_like(gates)
    for s in range(x.shape[0]):
        if layer.k == 1:
            e = int(gates[s].argmax())
            out[s] = gates[s, e] * experts[e](x[s:s + 1])[0]
            chosen[s, e] = 1
        else:
            top = gates[s].topk(2).indices.tolist()
            w = gates[s, top] / gates[s, top].sum()
            out[s] = sum(w[i] * experts[e](x[s:s + 1])[0] for i, e in enumerate(top))
            chosen[s, top[0]] = 1
    first = chosen.mean(0)
    l_aux = (gates.mean(0) * first).sum() * 3 if layer.k == 1 else (gates.mean(0) * first).mean() * 9
    return out, l_aux, chosen.sum(0)


def test_top1_equals_the_routing_written_out() -> None:
    layer = _layer(k=1, drop_tokens=False)
    x = torch.randn(10, 6, generator=torch.Generator().manual_seed(1))
    out, l_aux, counts = layer(x.reshape(2, 5, 6))
    want, want_aux, want_counts = _reference(layer, x)
    torch.testing.assert_close(out.reshape(10, 6), want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, want_aux)
    assert counts.tolist() == want_counts.tolist() and counts.sum() == 10


def test_top2_without_sampling_equals_the_routing_written_out() -> None:
    layer = _layer(k=2, drop_tokens=False)
    layer.deepspeed_moe.gate.second_sampling = False  # the second expert by argmax, as the reference picks it
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    out, l_aux, _ = layer(x)
    want, want_aux, _ = _reference(layer, x)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(l_aux, want_aux)


def test_capacity_drops_tokens_by_position() -> None:
    """capacity_factor 0.5 over 3 experts and 12 tokens: 2 slots each; use_rts=False keeps the first ones routed."""
    layer = _layer(k=1, capacity_factor=0.5)
    x = torch.randn(12, 6, generator=torch.Generator().manual_seed(3))
    out, _, counts = layer(x)
    kept = (out.abs().sum(1) > 0).sum()
    assert int(kept) == sum(min(int(c), 2) for c in counts)
    assert int(kept) < 12  # some were dropped


def test_experts_are_marked_and_prepare_trains_them(mgr: Any, tmp_path: Path) -> None:
    layer = _layer(k=1)
    marked = [n for n, p in layer.named_parameters() if is_expert_param(p)]
    names = [f"deepspeed_moe.experts.deepspeed_experts.{e}.0.{w}" for e in range(3) for w in ("weight", "bias")]
    assert marked == names
    model = torch.nn.Sequential(torch.nn.Linear(6, 6), layer)
    prepared, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), clip_grad_norm=1.0)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    out, l_aux, _ = prepared[1](prepared[0](torch.randn(8, 6)))
    mgr.backward(out.pow(2).mean() + 0.01 * l_aux)
    opt.step()
    opt.zero_grad()
    assert any((p - before[n]).abs().max() > 0 for n, p in model.named_parameters() if "experts" in n)
    mgr.save_checkpoint(tmp_path / "ck", prepared, opt)  # experts by their index in the layer (expert_layout.py)
    saved = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    mgr.load_checkpoint(tmp_path / "ck", prepared, opt)
    assert all(torch.equal(p, saved[n]) for n, p in model.named_parameters())
    m2 = torch.nn.Sequential(_layer(k=1))
    with pytest.raises(InvalidArgumentError, match="does not shard expert parameters"):
        mgr.prepare(m2, torch.optim.SGD(m2.parameters(), lr=0.1), zero_stage=1)


def test_bad_input_is_refused_before_any_collective(mgr: Any) -> None:
    expert = torch.nn.Linear(4, 4)
    for kwargs, match in (({"k": 3}, "top-1 and top-2"), ({"noisy_gate_policy": "Gumbel"}, "noisy_gate_policy"),
                          ({"k": 2, "noisy_gate_policy": "RSample"}, "top-1 gating only"),
                          ({"k": 2, "noisy_gate_policy": "None", "ep_size": 3}, "dividing the world size 1"),
                          ({"ep_size": 2}, "dividing the world size 1"), ({"num_experts": 0}, "positive int")):
        with pytest.raises(InvalidArgumentError, match=match):
            MoE(4, expert, **{"num_experts": 2, **kwargs}, group=mgr)
    with pytest.raises(InvalidArgumentError, match=r"torch\.nn\.Module"):
        MoE(4, "expert", num_experts=2, group=mgr)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="fewer than min_capacity"):
        MoE(4, expert, num_experts=2, min_capacity=8, group=mgr)(torch.randn(3, 4))
    with pytest.raises(InvalidArgumentError, match="group"):
        MoE(4, expert, num_experts=2, group=None)
