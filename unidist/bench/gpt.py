"""GPT-2 in a few lines, from its config (nothing downloaded, no transformers needed): the model ``bench step`` trains.

The architecture of Hugging Face's ``GPT2LMHeadModel``: token and position embeddings, ``n_layer`` pre-norm blocks
(causal self-attention through ``F.scaled_dot_product_attention``, a 4x GELU MLP), a final LayerNorm, and the output
projection tied to the token embedding (read by the top module itself: ZeRO-3 must gather it there). GPT-2 small is
``GPT2(n_layer=12, n_embd=768, n_head=12, vocab=50257, n_positions=1024)``: 124,439,808 parameters.
``--hf`` in ``bench step`` builds transformers' own instead, where it is installed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling
from torch import nn

__all__ = ["GPT2", "GPT2Config"]


@dataclass(frozen=True)
class GPT2Config:
    n_layer: int = 12
    n_embd: int = 768
    n_head: int = 12
    vocab: int = 50257
    n_positions: int = 1024


class Block(nn.Module):
    def __init__(self, c: GPT2Config) -> None:
        super().__init__()
        self.n_head = c.n_head
        self.ln_1, self.ln_2 = nn.LayerNorm(c.n_embd), nn.LayerNorm(c.n_embd)
        self.c_attn, self.c_proj = nn.Linear(c.n_embd, 3 * c.n_embd), nn.Linear(c.n_embd, c.n_embd)
        self.c_fc, self.mlp_proj = nn.Linear(c.n_embd, 4 * c.n_embd), nn.Linear(4 * c.n_embd, c.n_embd)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.n_head, d // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, d)
        x = x + self.c_proj(y)
        out: torch.Tensor = x + self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x)), approximate="tanh"))
        return out


class GPT2(nn.Module):
    """GPT-2's language model; ``forward(ids, labels)`` returns the mean next-token cross entropy."""

    def __init__(self, config: GPT2Config | None = None) -> None:
        super().__init__()
        c = config or GPT2Config()
        self.wte, self.wpe = nn.Embedding(c.vocab, c.n_embd), nn.Embedding(c.n_positions, c.n_embd)
        self.h = nn.ModuleList(Block(c) for _ in range(c.n_layer))
        self.ln_f = nn.LayerNorm(c.n_embd)
        for name, p in self.named_parameters():  # GPT-2's initialisation (residual projections scaled down)
            if p.dim() > 1:
                std = 0.02 / (2 * c.n_layer) ** 0.5 if name.endswith(("c_proj.weight", "mlp_proj.weight")) else 0.02
                nn.init.normal_(p, 0.0, std)
            elif name.endswith("bias"):
                nn.init.zeros_(p)

    def forward(self, ids: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        pos = torch.arange(ids.shape[1], device=ids.device)
        x = self.wte(ids) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = F.linear(self.ln_f(x), self.wte.weight)  # tied to the token embedding
        return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]).float(), labels[:, 1:].reshape(-1))
