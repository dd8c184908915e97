"""The model tests/workers/ckpt_interop.py trains under real DeepSpeed and resumes in unidist: what DeepSpeed's files
treat apart, an embedding tied to the output layer (``shared_params``), a LayerNorm, a buffer."""

from __future__ import annotations

import torch

VOCAB, WIDTH = 16, 32


class TinyLM(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = torch.nn.Embedding(VOCAB, WIDTH)
        self.norm = torch.nn.LayerNorm(WIDTH)
        self.up = torch.nn.Linear(WIDTH, 2 * WIDTH)
        self.down = torch.nn.Linear(2 * WIDTH, WIDTH)
        self.head = torch.nn.Linear(WIDTH, VOCAB, bias=False)
        self.head.weight = self.emb.weight  # tied, as GPT-2's lm_head
        self.register_buffer("scale", torch.tensor(3.0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x))
        h = h + self.down(torch.nn.functional.gelu(self.up(h)))
        return self.head(h) * self.scale  # type: ignore[no-any-return]


def build() -> TinyLM:
    torch.manual_seed(0)
    return TinyLM()
