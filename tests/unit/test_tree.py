"""unidist/tree.py and precision's output cast: every container a model returns keeps its type."""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, NamedTuple

import pytest
import torch

import unidist
from unidist.train.precision import Precision, cast_floats
from unidist.tree import map_tensors, tensors


class Pair(NamedTuple):
    logits: torch.Tensor
    aux: Any


@dataclasses.dataclass(frozen=True)
class Frozen:
    logits: torch.Tensor
    label: str = "x"


@dataclasses.dataclass
class Plain:
    logits: torch.Tensor
    extra: list[torch.Tensor]
    cached: torch.Tensor | None = dataclasses.field(default=None, init=False)


class Opaque:
    def __init__(self, t: torch.Tensor) -> None:
        self.t = t


class Ordered(collections.OrderedDict):  # type: ignore[type-arg]
    pass


def _bf16(n: int = 3) -> torch.Tensor:
    return torch.ones(n, dtype=torch.bfloat16)


def test_every_container_keeps_its_type_and_its_floats_are_cast() -> None:
    plain = Plain(_bf16(), [_bf16(), torch.arange(3)])
    plain.cached = _bf16()
    data = {"pair": Pair(_bf16(), (_bf16(), "s")), "frozen": Frozen(_bf16()), "plain": plain,
            "dd": collections.defaultdict(list, a=_bf16()), "od": Ordered(b=_bf16()), "ints": torch.arange(2),
            "opaque": Opaque(_bf16()), "none": None, "nested": [[{"x": _bf16()}]]}
    out = cast_floats(data, torch.float32)
    assert type(out) is dict and list(out) == list(data)
    assert type(out["pair"]) is Pair and out["pair"].logits.dtype == torch.float32
    assert out["pair"].aux[0].dtype == torch.float32 and out["pair"].aux[1] == "s"
    assert type(out["frozen"]) is Frozen and out["frozen"].logits.dtype == torch.float32 and out["frozen"].label == "x"
    assert type(out["plain"]) is Plain and out["plain"].extra[0].dtype == torch.float32
    assert out["plain"].extra[1].dtype == torch.int64 and out["plain"].cached.dtype == torch.float32  # init=False too
    assert type(out["dd"]) is collections.defaultdict and out["dd"].default_factory is list
    assert out["dd"]["a"].dtype == torch.float32
    assert type(out["od"]) is Ordered and out["od"]["b"].dtype == torch.float32
    assert out["ints"] is data["ints"]
    assert out["opaque"] is data["opaque"] and out["opaque"].t.dtype == torch.bfloat16  # unidist cannot see inside
    assert out["nested"][0][0]["x"].dtype == torch.float32
    assert data["frozen"].logits.dtype == torch.bfloat16  # the input is left as it was


def test_nothing_to_change_returns_the_input_itself() -> None:
    data = {"a": [torch.ones(2), (torch.zeros(1), "s")], "f": Frozen(torch.ones(1))}
    assert map_tensors(data, lambda t: t) is data
    assert cast_floats(data, torch.float32) is data


def test_tensors_finds_every_tensor_in_order() -> None:
    data = Pair(torch.tensor([1.0]), {"b": [torch.tensor([2.0])], "c": Frozen(torch.tensor([3.0]))})
    assert [float(t) for t in tensors(data)] == [1.0, 2.0, 3.0]


def test_hugging_face_model_output_keeps_its_type() -> None:
    transformers = pytest.importorskip("transformers", reason="transformers is not installed (the models extra)")
    out = transformers.modeling_outputs.CausalLMOutputWithCrossAttentions(loss=torch.tensor(1.0), logits=_bf16())
    got = cast_floats(out, torch.float32)
    assert type(got) is type(out) and got.logits.dtype == torch.float32 and got["logits"].dtype == torch.float32
    assert got.loss is out.loss and list(got.keys()) == ["loss", "logits"]


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_prepared_forward_returns_the_models_type_as_float32(precision: str) -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> Frozen:
            return Frozen(self.lin(x))

    model = Model()
    Precision.of(precision).apply(model, torch.device("cpu"))
    out = model(torch.randn(3, 4))
    assert type(out) is Frozen and out.logits.dtype == torch.float32


def test_prepare_keeps_a_namedtuple_output() -> None:
    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.lin = torch.nn.Linear(4, 2)

        def forward(self, x: torch.Tensor) -> Pair:
            return Pair(self.lin(x), None)

    with unidist.init(environ={"UNIDIST_DEVICE": "cpu"}) as mgr:
        model = Model()
        model, _ = mgr.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), precision="bf16-mixed")
        out = model(torch.randn(3, 4))
    assert type(out) is Pair and out.logits.dtype == torch.float32 and out.aux is None
