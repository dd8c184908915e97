"""``unidist.compat.deepspeed.pipe`` in one process (the local backend): a one-stage PipelineModule trained by
``train_batch`` against plain torch, the partition arithmetic, and every refusal before any collective. The
numbers against real DeepSpeed at 2 and 4 ranks are tests/multiproc/test_ds_pipeline.py's."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch
from helpers import compat_local_manager, require

import unidist.compat.deepspeed as deepspeed
from unidist.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec, partition
from unidist.compat.deepspeed.pipe.topology import check_stages, stages_of
from unidist.compat.deepspeed.runtime.pipe.topology import (
    PipeDataParallelTopology,
    PipeModelDataParallelTopology,
    ProcessTopology,
)
from unidist.compat.deepspeed.utils import RepeatingLoader
from unidist.errors import InvalidArgumentError

pytestmark = pytest.mark.local


@pytest.fixture(autouse=True)
def manager(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """Each test in its own local-backend Manager (helpers.compat_local_manager)."""
    yield from compat_local_manager(monkeypatch)


def _layers() -> list[Any]:
    torch.manual_seed(3)
    return [torch.nn.Linear(6, 12), torch.nn.Tanh(), LayerSpec(torch.nn.Linear, 12, 12), torch.relu,
            torch.nn.Linear(12, 3)]


def _data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(48, 6, generator=gen) * 4
    return torch.utils.data.TensorDataset(x, torch.randint(0, 3, (48,), generator=gen))


CONFIG = {"train_batch_size": 12, "train_micro_batch_size_per_gpu": 3, "steps_per_print": 2, "gradient_clipping": 0.6,
          "optimizer": {"type": "Adam", "params": {"lr": 0.05, "torch_adam": True}}}


def test_one_stage_trains_as_plain_torch(capsys: pytest.CaptureFixture[str]) -> None:
    """4 micro-batches of 3, averaged; clipped at 0.6; torch's AdamW (torch_adam, weight decay 0.01): the same
    losses and weights as the loop written out in plain torch."""
    net = PipelineModule(layers=_layers(), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=1)
    start = {k: v.clone() for k, v in net.state_dict().items()}
    engine, _, loader, _ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                                                training_data=_data(), config=CONFIG)
    assert engine.micro_batches == 4 and engine.train_batch_size() == 12
    losses = [float(engine.train_batch()) for _ in range(5)]  # 48 samples: the fifth batch repeats the first

    ref = torch.nn.ModuleList([torch.nn.Linear(6, 12), torch.nn.Tanh(), torch.nn.Linear(12, 12), torch.nn.Identity(),
                               torch.nn.Linear(12, 3)])
    ref.load_state_dict(start)  # the same starting weights (named by layer index, as DeepSpeed names them)
    opt = torch.optim.AdamW(ref.parameters(), lr=0.05)
    data = _data()
    want, norms = [], []
    for step in range(5):
        total = 0.0
        for j in range(4):
            at = (step * 12 + j * 3) % 48
            x, y = data.tensors[0][at:at + 3], data.tensors[1][at:at + 3]
            loss = torch.nn.functional.cross_entropy(ref[4](torch.relu(ref[2](ref[1](ref[0](x))))), y) / 4
            loss.backward()
            total += float(loss.detach())
        norms.append(float(torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.6)))
        opt.step()
        opt.zero_grad()
        want.append(total)
    assert min(norms) < 0.6 < max(norms)  # clipping acted on some steps, not all
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(want), rtol=1e-6, atol=0)
    got = dict(net.named_parameters())
    names = ("0.weight", "0.bias", "2.weight", "2.bias", "4.weight", "4.bias")
    for name, p in zip(names, ref.parameters(), strict=True):
        torch.testing.assert_close(got[name], p, rtol=1e-5, atol=1e-6)
    out = capsys.readouterr().out
    assert "steps: 2 loss:" in out and "steps: 4 loss:" in out and "steps: 3 loss:" not in out
    assert isinstance(engine.training_dataloader, RepeatingLoader) and loader is engine.training_dataloader
    ev = engine.eval_batch(iter(torch.utils.data.DataLoader(_data(), batch_size=3)))
    assert ev.dim() == 0 and float(ev) > 0
    with pytest.raises(InvalidArgumentError, match="Only train_batch"):
        engine(torch.zeros(3, 6))
    with pytest.raises(InvalidArgumentError, match="Only train_batch"):
        engine.step()


def test_partition_methods() -> None:
    assert partition.uniform(5, 2) == [0, 3, 5] and partition.uniform(2, 3) == [0, 1, 2, 2]
    assert partition.balanced([10, 0, 10, 10, 0], 2)[0] == 0 and partition.balanced([1, 1, 1, 1], 2) == [0, 2, 4]
    assert partition.type_weights(["Embedding", "Block", "block", None], "block") == [0, 1, 1, 0]
    for bad in ("profile", "size", "type:", 3):
        with pytest.raises(InvalidArgumentError, match="partition_method"):
            partition.check_method(bad)
    with pytest.raises(InvalidArgumentError, match="no layer's class name matches"):
        partition.type_weights(["Linear"], "Block")
    net = PipelineModule(layers=_layers(), num_stages=1, partition_method="type:linear")
    assert net.partitions() == [0, 5] and net.stage_owner(4) == 0


def test_bad_input_is_refused_before_any_collective() -> None:
    with pytest.raises(InvalidArgumentError, match=r"must divide the world size 1.*use one of 1"):
        PipelineModule(layers=_layers(), num_stages=2)
    with pytest.raises(InvalidArgumentError, match="must divide the world size 6"):
        check_stages(4, 6)
    with pytest.raises(InvalidArgumentError, match="positive int"):
        PipelineModule(layers=_layers(), num_stages=0)
    with pytest.raises(InvalidArgumentError, match="'profile'"):
        PipelineModule(layers=_layers(), num_stages=1, partition_method="profile")
    with pytest.raises(InvalidArgumentError, match=r"nn\.Module subclass"):
        LayerSpec(len)  # type: ignore[arg-type]
    with pytest.raises(InvalidArgumentError, match="nesting"):
        PipelineModule(layers=[PipelineModule(layers=_layers(), num_stages=1)], num_stages=1)
    with pytest.raises(InvalidArgumentError, match="topology"):
        PipelineModule(layers=_layers(), topology=object())
    with pytest.raises(InvalidArgumentError, match=r"tensor parallelism.*num_mp=1"):
        stages_of(PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2), 4, None)
    with pytest.raises(InvalidArgumentError, match=r"covers 4 ranks .* the world has 1"):
        PipelineModule(layers=_layers(), topology=PipeDataParallelTopology(num_pp=2, num_dp=2))
    with pytest.raises(InvalidArgumentError, match="'pipe' before 'data'"):
        stages_of(ProcessTopology(["data", "pipe"], [2, 2]), 4, None)
    with pytest.raises(InvalidArgumentError, match=r"\['sequence'\]"):
        stages_of(ProcessTopology(["pipe", "sequence"], [2, 2]), 4, None)
    with pytest.raises(InvalidArgumentError, match="disagree"):
        stages_of(PipeDataParallelTopology(num_pp=2, num_dp=2), 4, 4)
    net = PipelineModule(layers=_layers(), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=1)
    with pytest.raises(InvalidArgumentError, match="incompatible with pipeline parallelism"):
        deepspeed.initialize(model=net, model_parameters=list(net.parameters()),
                             config={**CONFIG, "zero_optimization": {"stage": 2}})


def test_a_topology_gives_the_stages_as_num_stages_does() -> None:
    """Megatron-DeepSpeed passes PipeModelDataParallelTopology(num_pp, num_mp, num_dp) instead of num_stages: with
    num_mp=1 its rank order is pipe x data, the grid num_stages makes."""
    assert stages_of(PipeModelDataParallelTopology(num_pp=2, num_mp=1, num_dp=2), 4, None) == 2
    assert stages_of(PipeDataParallelTopology(num_pp=4, num_dp=1), 4, 4) == 4
    net = PipelineModule(layers=_layers(), loss_fn=torch.nn.CrossEntropyLoss(),
                         topology=PipeModelDataParallelTopology(num_pp=1, num_mp=1, num_dp=1))
    assert net.num_stages == 1


def test_tied_layers_share_one_module_and_seed_layers_seeds_each_build() -> None:
    layers = [TiedLayerSpec("emb", torch.nn.Embedding, 10, 4),
              TiedLayerSpec("emb", torch.nn.Embedding, 10, 4, forward_fn=lambda m, x: x @ m.weight.t())]
    net = PipelineModule(layers=layers, num_stages=1, seed_layers=True, base_seed=5)
    assert list(dict(net.named_parameters())) == ["tied_modules.emb.weight"]
    torch.manual_seed(5)
    torch.testing.assert_close(net.tied_modules["emb"].weight, torch.nn.Embedding(10, 4).weight)
    assert net(torch.tensor([[1, 2]])).shape == (1, 2, 10)
    assert net.replicated_parameters() == []  # one stage: nothing is counted twice


def test_repeating_loader_starts_again() -> None:
    assert [b for _, b in zip(range(5), RepeatingLoader([1, 2]), strict=False)] == [1, 2, 1, 2, 1]


@pytest.mark.deepspeed
def test_partitions_are_deepspeeds() -> None:
    """The cuts DeepSpeed 0.19.8's own functions make, on 300 random weight lists (ties included: small integers)."""
    require("deepspeed")
    from deepspeed.runtime import utils as ds_utils

    gen = torch.Generator().manual_seed(0)
    for _ in range(300):
        n, parts = int(torch.randint(1, 14, (1,), generator=gen)), int(torch.randint(1, 6, (1,), generator=gen))
        weights = torch.randint(0, 5, (n,), generator=gen).tolist()
        assert partition.balanced(weights, parts) == [int(x) for x in ds_utils.partition_balanced(weights, parts)]
        assert partition.uniform(n, parts) == [int(x) for x in ds_utils.partition_uniform(n, parts)]


def test_the_configs_pipeline_section_sets_the_checkpoint_interval() -> None:
    """DeepSpeed's ``pipeline`` section: its activation_checkpoint_interval overrides the module's (the engine sets
    it, runtime/pipe/engine.py:217-218); the partitioning flags change nothing without tensor parallelism."""
    net = PipelineModule(layers=_layers(), loss_fn=torch.nn.CrossEntropyLoss(), num_stages=1)
    engine, *_ = deepspeed.initialize(model=net, model_parameters=list(net.parameters()), training_data=_data(),
                                      config={**CONFIG, "pipeline": {"activation_checkpoint_interval": 2,
                                                                     "pipe_partitioned": True,
                                                                     "grad_partitioned": True}})
    assert net.activation_checkpoint_interval == 2
    assert float(engine.train_batch()) > 0
