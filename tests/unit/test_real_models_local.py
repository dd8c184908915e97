"""What real models need of prepare, on one process (the local backend, CPU): ZeRO-3 gathering a parameter wherever
it is read, unused parameters left alone, buffers, sparse embeddings, sync_batchnorm's argument. The same models
under every launcher at N ranks: tests/multiproc/test_model_zoo.py."""

from __future__ import annotations

import copy
from typing import Any

import pytest
import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

import unidist
from unidist import InvalidArgumentError


@pytest.fixture
def mgr() -> Any:
    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as m:
        yield m


def _encoder() -> torch.nn.Module:
    torch.manual_seed(3)
    layer = torch.nn.TransformerEncoderLayer(16, 4, 32, dropout=0.0, batch_first=True)
    return torch.nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)


def _train(model: Any, opt: Any, steps: int, backward: Any) -> None:
    for step in range(steps):
        x = torch.randn(4, 5, 16, generator=torch.Generator().manual_seed(step))
        backward(model(x).pow(2).mean())
        opt.step()
        opt.zero_grad()


def test_zero3_runs_torchs_attention_like_one_process(mgr: Any) -> None:
    """nn.MultiheadAttention reads out_proj.weight without calling out_proj: it failed with 'mat2 must be a matrix'."""
    ref = _encoder()
    ropt = torch.optim.AdamW(ref.parameters(), lr=1e-2)
    _train(ref, ropt, 3, lambda loss: loss.backward())
    model = _encoder()
    model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2), zero_stage=3)
    _train(model, opt, 3, mgr.backward)
    full = mgr.full_state_dict(model)
    assert max((full[k] - v).abs().max().item() for k, v in ref.state_dict().items()) == 0.0
    attn = model.layers[0].self_attn
    assert any(u is opt._order.slot_of(attn.out_proj.weight) for u in opt.fetcher.readers[attn])  # learned
    assert all(p.numel() == 0 for p in model.parameters())  # and still sharded between steps
    model.eval()  # the first eval forward under no_grad is watched too (other code paths)
    with torch.no_grad():
        ref.eval()
        x = torch.randn(2, 5, 16)
        assert torch.allclose(model(x), ref(x), atol=1e-6)


class ParentReads(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(4)
        self.proj, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)
        self.late = torch.nn.Linear(8, 2)
        self.use_late = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(x, self.proj.weight * 0.5, self.proj.bias) + self.proj(x))
        y = h @ self.out.weight.t() + self.out.bias
        return y + (h @ self.late.weight.t() if self.use_late else 0)


def test_a_read_the_first_step_did_not_show_is_explained_and_can_be_declared(mgr: Any) -> None:
    model = ParentReads()
    model, opt = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=3)
    for _ in range(2):
        mgr.backward(model(torch.randn(3, 8)).pow(2).sum())
        opt.step()
        opt.zero_grad()
    model.use_late = True  # now the parent reads a weight it was never seen reading
    with pytest.raises(RuntimeError) as err:
        model(torch.randn(3, 8))
    assert "opt.add_reader(module, parameter)" in "\n".join(getattr(err.value, "__notes__", []))
    opt.add_reader(model, model.late.weight)
    mgr.backward(model(torch.randn(3, 8)).pow(2).sum())
    opt.step()


def test_gathered_parameters_hold_through_a_forward(mgr: Any) -> None:
    model = ParentReads()
    model, _ = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), zero_stage=3)
    with mgr.gathered_parameters(model):
        model(torch.randn(3, 8))
        assert model.proj.weight.shape == (8, 8)  # a forward inside the block frees nothing
    assert model.proj.weight.numel() == 0


class Unused(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(5)
        self.used, self.never = torch.nn.Linear(4, 4), torch.nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.used(x)  # type: ignore[no-any-return]


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_a_parameter_without_gradient_is_not_stepped(mgr: Any, stage: int) -> None:
    model = Unused()
    before = copy.deepcopy(model.never.state_dict())
    model, opt = mgr.prepare(model, torch.optim.AdamW(model.parameters(), lr=0.1, weight_decay=0.5), zero_stage=stage)
    for _ in range(3):
        mgr.backward(model(torch.randn(3, 4)).pow(2).sum())
        opt.step()
        opt.zero_grad()
    full = mgr.full_state_dict(model)
    assert torch.equal(full["never.weight"], before["weight"]) and torch.equal(full["never.bias"], before["bias"])


def test_a_sparse_embedding_is_refused_before_anything_changes(mgr: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Embedding(10, 4, sparse=True), torch.nn.Linear(4, 2))
    with pytest.raises(InvalidArgumentError, match=r"0 is Embedding\(sparse=True\).*sparse=False"):
        mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    model[0].weight.requires_grad_(False)  # a frozen one makes no gradient: nothing to refuse
    mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_sync_batchnorm_takes_a_bool_and_converts(mgr: Any) -> None:
    model = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    with pytest.raises(InvalidArgumentError, match="sync_batchnorm='yes'"):
        mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm="yes")
    model, _ = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), sync_batchnorm=True)
    assert type(model[1]).__name__ == "SyncBatchNorm"
    assert list(model.state_dict()) == ["0.weight", "0.bias", "1.weight", "1.bias", "1.running_mean",
                                        "1.running_var", "1.num_batches_tracked"]


def test_the_buffers_that_travel_are_the_persistent_ones(mgr: Any) -> None:
    from unidist.train.buffer_sync import BufferSync

    model = torch.nn.Sequential(torch.nn.BatchNorm1d(3), torch.nn.Linear(3, 3))
    model[1].register_buffer("derived", torch.ones(3), persistent=False)
    sync = BufferSync(mgr, model)
    assert [name for _, name in sync.where] == ["running_mean", "running_var", "num_batches_tracked"]
    model[0].running_mean = torch.full((3,), 7.0)  # replaced, not updated in place: still the one that travels
    assert torch.equal(sync.tensors()[0], torch.full((3,), 7.0))
