"""A DeepSpeed pipeline script with what the upstream example lacks: TiedLayerSpec (an embedding reused as the
output projection, on the first and last stages), LayerSpecs built per stage, (hidden, integer mask) tuples between
stages, ``partition_method="type:..."`` (ZeRO 0),
``seed_layers`` and ``activation_checkpoint_interval`` (ZeRO 1), gradients large enough that clipping
(DeepSpeed's default 1.0) acts, ``eval_batch(return_logits=True)``, and at ZeRO 1 the grid given as
Megatron-DeepSpeed gives it (``topology=PipeModelDataParallelTopology(num_pp, num_mp=1, num_dp)``).

Run by tests/multiproc/test_ds_pipeline.py as DeepSpeed's own script (``UNIDIST_TEST_REAL_DS=1``: ``import
deepspeed``) under the deepspeed launcher, and with the compat import under mpiexec/torchrun. Prints
``pipe <stage> <step> <loss>`` on global rank 0 and writes each rank's parameters to ``$OUT/z<stage>-rank<r>.json``.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

if os.environ.get("UNIDIST_TEST_REAL_DS") == "1":
    import deepspeed
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology
else:
    import unidist.compat.deepspeed as deepspeed
    from unidist.compat.deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from unidist.compat.deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

VOCAB, WIDTH, SEQ = 32, 16, 6


class Block(nn.Module):
    """A residual block passing (hidden, mask) on: the activations between stages are tuples with an integer part,
    as Megatron-DeepSpeed's (hidden, attention mask)."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.fc = nn.Linear(width, width)

    def forward(self, x: tuple[torch.Tensor, torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        h, mask = x
        return h + torch.tanh(self.fc(h)) * 2.0 * mask, mask


def with_mask(h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hidden, a per-position integer mask: every position but the first of each sequence)."""
    mask = torch.ones((*h.shape[:-1], 1), dtype=torch.long)
    mask[:, 0] = 0
    return h, mask


def project(embedding: nn.Embedding, x: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    return x[0] @ embedding.weight.t()


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1))


def data() -> torch.utils.data.TensorDataset:
    gen = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, VOCAB, (96, SEQ), generator=gen)
    return torch.utils.data.TensorDataset(tokens, (tokens * 7 + 3) % VOCAB)  # a learnable map


def train(stage: int, stages: int, out: Path) -> None:
    torch.manual_seed(11)
    layers = [TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH), with_mask,
              *[LayerSpec(Block, WIDTH) for _ in range(4)],
              TiedLayerSpec("embed", nn.Embedding, VOCAB, WIDTH, forward_fn=project)]
    # DeepSpeed 0.19.8's seed_layers needs the uniform partition: a balanced one's stage bounds are numpy ints,
    # which its random.seed(base_seed + index) refuses (TypeError); so ZeRO 0 runs type:block, ZeRO 1 seed_layers
    how = {"partition_method": "type:block"} if stage == 0 else {"partition_method": "uniform", "seed_layers": True,
                                                                  "base_seed": 77, "activation_checkpoint_interval": 2,
                                                                  "checkpointable_layers": ["Block"]}
    # ZeRO 1 names its grid as Megatron-DeepSpeed does: a pipe x data x model topology (model 1)
    grid: dict[str, Any] = {"num_stages": stages} if stage == 0 else {"topology": PipeModelDataParallelTopology(
        num_pp=stages, num_mp=1, num_dp=deepspeed.comm.get_world_size() // stages)}
    net = PipelineModule(layers=layers, loss_fn=loss_fn, **grid, **how)
    config = {"train_batch_size": 16, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 100,
              "optimizer": {"type": "Adam", "params": {"lr": 0.02, "weight_decay": 0.0, "torch_adam": True}},
              "zero_optimization": {"stage": stage}}
    engine, _, _, _ = deepspeed.initialize(model=net, model_parameters=[p for p in net.parameters()],
                                           training_data=data(), config=config)
    for step in range(6):
        loss = engine.train_batch()
        if engine.global_rank == 0:
            print(f"pipe {stage} {step} {float(loss):.9g}", flush=True)
    held_out = data()
    batches = [(held_out.tensors[0][i:i + 4], held_out.tensors[1][i:i + 4]) for i in range(0, 16, 4)]
    evaluated = engine.eval_batch(iter(batches))  # 4 micro-batches (the accumulation steps), no training
    if engine.global_rank == 0:
        print(f"pipe {stage} eval {float(evaluated):.9g}", flush=True)
    again, logits = engine.eval_batch(iter(batches), return_logits=True)  # the last stage's last micro-batch
    assert float(again) == float(evaluated)
    weights = {name: [float(p.double().sum()), float(p.double().pow(2).sum())]
               for name, p in net.state_dict().items()}
    # the outputs on the last stage (4 rows x SEQ x VOCAB), None on the first: (sum, squares, count)
    weights["eval logits"] = [0.0, 0.0, 0.0] if logits is None else \
        [float(logits.double().sum()), float(logits.double().pow(2).sum()), float(logits.numel())]
    (out / f"z{stage}-rank{engine.global_rank}.json").write_text(json.dumps(weights))


if __name__ == "__main__":
    deepspeed.init_distributed(dist_backend="gloo")
    out = Path(os.environ["OUT"])
    for stage in (0, 1):
        train(stage, int(sys.argv[1]) if len(sys.argv) > 1 and not sys.argv[1].startswith("--") else 2, out)
