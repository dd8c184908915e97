"""The model zoo: each entry builds a model (seeded: every call gives the same weights), the global batch of a step
(the same on every rank), and the loss of some of its rows; nothing is downloaded.

Hugging Face models come from small configs (transformers is a test dependency: the ``models`` extra, pinned in
constraints.txt): GPT-2 (input and output embeddings tied), BERT for sequence classification (pooler, token types,
padding), a T5 encoder-decoder (one embedding shared by encoder, decoder and head), a Llama decoder (RoPE buffers,
RMSNorm, SwiGLU, grouped-query attention). torch's own: ``nn.TransformerEncoder`` (``nn.MultiheadAttention`` reads
``out_proj.weight`` without calling ``out_proj``) and ``nn.Transformer``. By hand: a ResNet with BatchNorm (plain,
and with ``sync_batchnorm=True``), a LoRA-style model (frozen base weights beside trainable biases and adapters),
a model whose branches are used on alternate steps and whose head is never used, two modules sharing one weight,
a parent that reads its children's weights itself, and a sparse embedding (refused).

Every dropout is 0, so N ranks and one process compute the same thing (``with_dropout`` builds the models that
have dropout with it on, for ``unidist verify``, which switches it off itself). Magnitudes are realistic:
cross-entropy on random labels and inputs with standard deviation 3 give gradient norms above 1.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

BATCH, VOCAB, DIM = 8, 64, 16
Batch = dict[str, torch.Tensor]
HAS_TRANSFORMERS = importlib.util.find_spec("transformers") is not None


@dataclass(frozen=True)
class Entry:
    """One zoo model.

    Attributes:
        build: the model, seeded (the same weights on every call).
        batch: the global batch of step s (``BATCH`` rows, the same on every rank).
        loss: (loss, the model's raw output) for some rows of a batch at step s.
        optimizer: the optimizer over the model's parameters (all of them: frozen ones too, as users pass them).
        transformers: needs Hugging Face transformers.
        sync_batchnorm: prepared with ``sync_batchnorm=True``.
        whole_batch: in float32 one process on all rows is the reference (False: BatchNorm's per-rank statistics,
            so the reference runs each rank's rows separately, as DDP computes).
        tied: pairs of parameter names that must stay one tensor.
        never_used: parameter name prefixes no forward ever reads (they must not move).
        refused: prepare must refuse the model with this error type's name.
        precisions: the precisions it runs in (sync_batchnorm's whole-batch statistics have no per-rank autocast
            reference: float32 only).
    """

    build: Callable[[], nn.Module]
    batch: Callable[[int], Batch]
    loss: Callable[[Any, Batch, int], tuple[torch.Tensor, Any]]
    optimizer: Callable[[nn.Module], torch.optim.Optimizer]
    transformers: bool = False
    sync_batchnorm: bool = False
    whole_batch: bool = True
    tied: tuple[tuple[str, str], ...] = ()
    never_used: tuple[str, ...] = ()
    refused: str | None = None
    precisions: tuple[str, ...] = ("32", "bf16-mixed", "bf16-master")


def adamw(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, weight_decay=5e-4)


def plain_sgd(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=0.05)


def _gen(step: int, salt: int) -> torch.Generator:
    return torch.Generator().manual_seed(1000 * salt + step)


def tokens(step: int, salt: int, length: int = 8) -> torch.Tensor:
    return torch.randint(2, VOCAB, (BATCH, length), generator=_gen(step, salt))


# ---------------------------------------------------------------- Hugging Face, from configs
def _hf(kind: str, dropout: float = 0.0) -> nn.Module:
    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(11)
    ids = {"bos_token_id": 0, "eos_token_id": 1, "pad_token_id": 0}
    p = dropout
    if kind == "gpt2":
        return transformers.GPT2LMHeadModel(transformers.GPT2Config(
            n_layer=2, n_embd=32, n_head=2, vocab_size=VOCAB, n_positions=16, resid_pdrop=p, embd_pdrop=p,
            attn_pdrop=p, **ids))
    if kind == "bert":
        return transformers.BertForSequenceClassification(transformers.BertConfig(
            hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, vocab_size=VOCAB,
            max_position_embeddings=16, num_labels=3, hidden_dropout_prob=p, attention_probs_dropout_prob=p,
            classifier_dropout=p, **ids))
    if kind == "t5":
        return transformers.T5ForConditionalGeneration(transformers.T5Config(
            d_model=32, d_ff=64, d_kv=16, num_layers=2, num_decoder_layers=2, num_heads=2, vocab_size=VOCAB,
            dropout_rate=p, decoder_start_token_id=0, tie_word_embeddings=True, **ids))
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=VOCAB, max_position_embeddings=32, attention_dropout=p, tie_word_embeddings=False, **ids))


def _lm_batch(step: int) -> Batch:
    ids = tokens(step, 1)
    return {"input_ids": ids, "labels": ids}


def _bert_batch(step: int) -> Batch:
    ids = tokens(step, 2)
    lengths = torch.randint(4, 9, (BATCH,), generator=_gen(step, 3))
    mask = (torch.arange(8)[None, :] < lengths[:, None]).long()
    types = (torch.arange(8)[None, :] >= 4).long().expand(BATCH, 8).contiguous()
    return {"input_ids": ids, "attention_mask": mask, "token_type_ids": types,
            "labels": torch.randint(0, 3, (BATCH,), generator=_gen(step, 4))}


def _t5_batch(step: int) -> Batch:
    return {"input_ids": tokens(step, 5), "labels": tokens(step, 6, 6)}


def _hf_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(**rows)
    return out.loss.float(), out


# ---------------------------------------------------------------- torch's own transformers
class Encoder(nn.Module):
    """``nn.TransformerEncoder`` and a regression head: MultiheadAttention reads ``out_proj.weight`` itself."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(12)
        layer = nn.TransformerEncoderLayer(DIM, 4, 32, dropout=dropout, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(x).mean(1))  # type: ignore[no-any-return]


class Seq2Seq(nn.Module):
    """``nn.Transformer`` (encoder, decoder, cross-attention) with a causal target mask."""

    def __init__(self, dropout: float = 0.0) -> None:
        super().__init__()
        torch.manual_seed(13)
        self.core = nn.Transformer(DIM, 4, 1, 1, 32, dropout=dropout, batch_first=True)
        self.head = nn.Linear(DIM, 4)

    def forward(self, src: torch.Tensor, tgt: torch.Tensor) -> torch.Tensor:
        mask = nn.Transformer.generate_square_subsequent_mask(tgt.shape[1])
        return self.head(self.core(src, tgt, tgt_mask=mask))  # type: ignore[no-any-return]


def _seq_batch(step: int) -> Batch:
    g = _gen(step, 7)
    x = 3 * torch.randn(BATCH, 6, DIM, generator=g)
    return {"x": x, "tgt": 3 * torch.randn(BATCH, 5, DIM, generator=g), "y": 4 * torch.randn(BATCH, 4, generator=g),
            "y_seq": 4 * torch.randn(BATCH, 5, 4, generator=g)}


def _encoder_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["x"])
    return F.mse_loss(out.float(), rows["y"]), out


def _seq2seq_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["x"], rows["tgt"])
    return F.mse_loss(out.float(), rows["y_seq"]), out


# ---------------------------------------------------------------- a ResNet with BatchNorm
class Block(nn.Module):
    def __init__(self, cin: int, cout: int, stride: int) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(cin, cout, 3, stride, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(cout)
        self.conv2 = nn.Conv2d(cout, cout, 3, 1, 1, bias=False)
        self.bn2 = nn.BatchNorm2d(cout)
        self.down = None if stride == 1 and cin == cout else nn.Sequential(
            nn.Conv2d(cin, cout, 1, stride, bias=False), nn.BatchNorm2d(cout))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.bn2(self.conv2(F.relu(self.bn1(self.conv1(x)))))
        return F.relu(out + (x if self.down is None else self.down(x)))


class ResNet(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(14)
        self.stem = nn.Sequential(nn.Conv2d(3, 8, 3, 1, 1, bias=False), nn.BatchNorm2d(8), nn.ReLU())
        self.layers = nn.Sequential(Block(8, 8, 1), Block(8, 16, 2))
        self.fc = nn.Linear(16, 10)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc(self.layers(self.stem(x)).mean((2, 3)))  # type: ignore[no-any-return]


def _image_batch(step: int) -> Batch:
    g = _gen(step, 8)
    return {"x": 3 * torch.randn(BATCH, 3, 8, 8, generator=g) + 1.0,
            "y": torch.randint(0, 10, (BATCH,), generator=g)}


def _image_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["x"])
    return F.cross_entropy(out.float(), rows["y"]), out


# ---------------------------------------------------------------- parameters used in unusual ways
class LoRA(nn.Module):
    """Frozen base weights (``requires_grad=False``) beside trainable biases and low-rank adapters, as in LoRA
    fine-tuning; the optimizer is handed every parameter, frozen ones included."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(15)
        self.base1, self.base2 = nn.Linear(DIM, 32), nn.Linear(32, 4)
        self.a1, self.b1 = nn.Parameter(0.3 * torch.randn(4, DIM)), nn.Parameter(0.3 * torch.randn(32, 4))
        self.a2, self.b2 = nn.Parameter(0.3 * torch.randn(2, 32)), nn.Parameter(0.3 * torch.randn(4, 2))
        for base in (self.base1, self.base2):
            base.weight.requires_grad_(False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.base1(x) + x @ self.a1.t() @ self.b1.t())
        return self.base2(h) + h @ self.a2.t() @ self.b2.t()  # type: ignore[no-any-return]


class Branches(nn.Module):
    """``branch_even`` runs on even steps, ``branch_odd`` on odd ones, ``never`` never: a parameter without a gradient
    in a step must neither hang the step nor move."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(16)
        self.trunk = nn.Linear(DIM, 32)
        self.branch_even, self.branch_odd = nn.Linear(32, 32), nn.Linear(32, 32)
        self.never = nn.Linear(32, 4)
        self.head = nn.Linear(32, 4)

    def forward(self, x: torch.Tensor, step: int) -> torch.Tensor:
        h = torch.tanh(self.trunk(x))
        h = torch.tanh((self.branch_even if step % 2 == 0 else self.branch_odd)(h))
        return self.head(h)  # type: ignore[no-any-return]


class Shared(nn.Module):
    """One weight registered in two modules (``second.weight is first.weight``), each calling its own forward."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(17)
        self.first, self.second, self.head = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, 4)
        self.second.weight = self.first.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.second(torch.tanh(self.first(x)))))  # type: ignore[no-any-return]


class ParentReads(nn.Module):
    """The parent reads its children's weights itself: ``proj`` is used both through its forward and by the parent,
    ``out`` only by the parent (its forward never runs), as a hand-written tied head does."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(18)
        self.proj, self.out = nn.Linear(DIM, DIM), nn.Linear(DIM, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(F.linear(x, 0.5 * self.proj.weight, self.proj.bias))
        h = torch.tanh(self.proj(h))
        return h @ self.out.weight.t() + self.out.bias


class SparseEmbedding(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(19)
        self.emb, self.head = nn.Embedding(VOCAB, DIM, sparse=True), nn.Linear(DIM, 4)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(ids).mean(1))  # type: ignore[no-any-return]


def _vector_batch(step: int) -> Batch:
    g = _gen(step, 9)
    return {"x": 3 * torch.randn(BATCH, DIM, generator=g), "y": 4 * torch.randn(BATCH, 4, generator=g),
            "ids": tokens(step, 10)}


def _vector_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["x"])
    return F.mse_loss(out.float(), rows["y"]), out


def _branches_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["x"], step)
    return F.mse_loss(out.float(), rows["y"]), out


def _sparse_loss(model: Any, rows: Batch, step: int) -> tuple[torch.Tensor, Any]:
    out = model(rows["ids"])
    return F.mse_loss(out.float(), rows["y"]), out


class Pair(NamedTuple):
    """An output as some models return it: a namedtuple (the output-type checks, tests/workers/model_zoo.py)."""

    logits: torch.Tensor
    extra: dict[str, torch.Tensor]


@dataclass(frozen=True)
class Frozen:
    """A frozen dataclass output holding a namedtuple (the output-type checks)."""

    pair: Pair


ZOO: dict[str, Entry] = {
    "gpt2": Entry(lambda: _hf("gpt2"), _lm_batch, _hf_loss, adamw, transformers=True,
                  tied=(("transformer.wte.weight", "lm_head.weight"),)),
    "bert": Entry(lambda: _hf("bert"), _bert_batch, _hf_loss, adamw, transformers=True),
    "t5": Entry(lambda: _hf("t5"), _t5_batch, _hf_loss, adamw, transformers=True,
                tied=(("shared.weight", "lm_head.weight"), ("shared.weight", "encoder.embed_tokens.weight"),
                      ("shared.weight", "decoder.embed_tokens.weight"))),
    "llama": Entry(lambda: _hf("llama"), _lm_batch, _hf_loss, adamw, transformers=True),
    # SGD: attention's key bias has a gradient of exactly zero in exact arithmetic, and Adam turns its rounding noise
    # into steps of +-lr, so any change of summation order shows as ~lr per step (measured 9e-4 after 3 steps between
    # 2 ranks and one process in float32, 2.6e-3 under DeepSpeed's ZeRO-3 in bf16). The Hugging Face models run AdamW
    "torch_encoder": Entry(Encoder, _seq_batch, _encoder_loss, sgd),
    "torch_transformer": Entry(Seq2Seq, _seq_batch, _seq2seq_loss, sgd),
    "resnet": Entry(ResNet, _image_batch, _image_loss, sgd, whole_batch=False),
    "resnet_syncbn": Entry(ResNet, _image_batch, _image_loss, sgd, sync_batchnorm=True, precisions=("32",)),
    "lora": Entry(LoRA, _vector_batch, _vector_loss, adamw),
    # SGD with momentum and weight decay: a branch unused in a step must keep its weights and its momentum exactly
    # (Adam's step count is one per ZeRO unit, so Adam cannot be exact there: docs/models.md)
    "branches": Entry(Branches, _vector_batch, _branches_loss, sgd, never_used=("never.",)),
    "shared": Entry(Shared, _vector_batch, _vector_loss, adamw, tied=(("first.weight", "second.weight"),)),
    "parent_reads": Entry(ParentReads, _vector_batch, _vector_loss, adamw),
    # refused where gradients travel in unidist's dense buckets or shards; Horovod's own optimizer (horovod backend,
    # stage 0) allgathers sparse gradients and trains it. Plain SGD: torch's Adam family takes no sparse gradients
    "sparse_embedding": Entry(SparseEmbedding, _vector_batch, _sparse_loss, plain_sgd, refused="InvalidArgumentError"),
}


def with_dropout(name: str, p: float) -> nn.Module:
    """Zoo model ``name`` built with every dropout rate at ``p`` (as the models ship: GPT-2 0.1, BERT 0.1, torch's
    Transformer 0.1), the same weights as ``ZOO[name].build()``; for the models that have dropout."""
    if name in ("gpt2", "bert", "t5", "llama"):
        return _hf(name, p)
    return {"torch_encoder": Encoder, "torch_transformer": Seq2Seq}[name](p)


def available() -> dict[str, Entry]:
    """The zoo's entries this environment can build (the Hugging Face ones need transformers)."""
    return {k: v for k, v in ZOO.items() if HAS_TRANSFORMERS or not v.transformers}


def rows(batch: Batch, rank: int, size: int) -> Batch:
    """Rank ``rank``'s contiguous share of the global batch."""
    per = BATCH // size
    return {k: v[rank * per:(rank + 1) * per] for k, v in batch.items()}


def frozen_names(model: nn.Module) -> list[str]:
    return [n for n, p in model.named_parameters(remove_duplicate=False) if not p.requires_grad]


def lookup(model: nn.Module, name: str) -> torch.Tensor:
    """The tensor a dotted name points at (``transformer.wte.weight``)."""
    obj: Any = model
    for part in name.split("."):
        obj = getattr(obj, part)
    return obj  # type: ignore[no-any-return]

