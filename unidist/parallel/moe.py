"""Mixture of Experts over any unidist communicator: a gate picks each token's top-1 or top-2 experts, tokens travel
to the ranks holding those experts by all-to-all and come back weighted by their gate values, on every backend.

The arithmetic is GShard's as DeepSpeed 0.19.8 computes it (deepspeed/moe/sharded_moe.py), so a DeepSpeed MoE
script gives the same numbers through ``unidist.compat.deepspeed.moe``:

- the gate is a bias-free Linear in float32; ``softmax`` over its logits gives each token's expert probabilities;
- top-1: each token's most probable expert (``noisy_gate_policy="RSample"``: argmax of logits plus Gumbel noise;
  ``"Jitter"``: the input multiplied by uniform noise in [0.99, 1.01]); capacity ``ceil(tokens / experts *
  capacity_factor)``, at least ``min_capacity``; past capacity, tokens are dropped by random token selection
  (``use_rts``: the kept ones are the top ``capacity`` of uniform draws) or by position; ``drop_tokens=False``
  raises the capacity to the busiest expert's count over the expert-parallel group;
- top-2: the second expert is the argmax of the logits without the first, plus Gumbel noise
  (``top2_2nd_expert_sampling``); capacity doubles; the two gate values are renormalised to sum to 1;
- ``l_aux`` (the load-balancing loss) = experts x sum(mean gate probability x fraction of tokens routed) for top-1,
  experts^2 x mean(...) for top-2; ``exp_counts`` = tokens routed to each expert before capacity.

Placement: ``num_experts`` are split over the ``ep_size`` ranks of an expert-parallel group (``expert_groups``: the
world cut into consecutive runs of ``ep_size`` ranks, as DeepSpeed's); each rank holds ``num_experts / ep_size``
copies of ``expert`` (deep copies, so they start equal). Expert parameters carry ``allreduce = False`` and
``group_name`` (DeepSpeed's marks): ``prepare`` averages them over their expert-data-parallel group (the ranks
holding the same experts) and divides by the whole data-parallel size, as DeepSpeed does, since every rank's
tokens reach them.
"""

from __future__ import annotations

import copy
from typing import Any

import torch
import torch.nn.functional as F  # noqa: N812 - torch's own spelling

from unidist.comm.param_comm import ExpertSlot, set_expert_slot, set_reduce_comm
from unidist.comm.protocol import Comm
from unidist.errors import InvalidArgumentError

__all__ = ["GATE_POLICIES", "MoE", "expert_groups", "is_expert_param"]

GATE_POLICIES = (None, "None", "Jitter", "RSample")


def is_expert_param(p: torch.Tensor) -> bool:
    """Whether ``p`` is an expert's parameter (DeepSpeed's mark: ``p.allreduce is False``)."""
    return getattr(p, "allreduce", True) is False


def expert_groups(mgr: Any, ep_size: int) -> tuple[Any, Any]:
    """(expert-parallel Group, expert-data-parallel Group) of this rank for ``ep_size``; every rank calls it.

    The world is cut into consecutive runs of ``ep_size`` ranks (each run holds every expert once); the ranks at
    the same place in each run hold the same experts and form the expert-data-parallel group (DeepSpeed's
    ``_create_expert_and_data_parallel`` layout without tensor or pipeline parallelism).
    """
    check_ep_size(ep_size, mgr.size)
    run, place = divmod(mgr.rank, ep_size)
    return mgr.split(run, key=place), mgr.split(place, key=run)


def check_ep_size(ep_size: object, world: int) -> int:
    if isinstance(ep_size, bool) or not isinstance(ep_size, int) or ep_size < 1 or world % ep_size:
        fits = [d for d in range(1, world + 1) if world % d == 0]
        raise InvalidArgumentError(f"MoE(ep_size={ep_size!r}) must be a positive int dividing the world size {world} "
                                   f"(the expert-parallel groups tile the world); use one of "
                                   f"{', '.join(map(str, fits))}")
    return ep_size


class _AllToAll(torch.autograd.Function):
    """Row blocks exchanged over the group; backward sends the gradients back the same way."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, group: Comm) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        group.alltoall(x, out=out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return _AllToAll.apply(grad, ctx.group), None  # type: ignore[no-untyped-call]


def _capacity(tokens: int, experts: int, factor: float, minimum: int) -> int:
    """ceil(tokens / experts * factor), at least ``minimum``: the factor in float32, as DeepSpeed's tensor math."""
    return max(int(torch.ceil((tokens / experts) * torch.tensor(factor))), minimum)


class Gate(torch.nn.Module):
    """The top-k gate: routes (expert index, slot, weight) per token and route, ``l_aux``, ``exp_counts``."""

    def __init__(self, model_dim: int, num_experts: int, k: int, capacity_factor: float, eval_capacity_factor: float,
                 min_capacity: int, noisy_gate_policy: str | None, drop_tokens: bool, use_rts: bool,
                 second_sampling: bool) -> None:
        super().__init__()
        self.wg = torch.nn.Linear(model_dim, num_experts, bias=False)
        self.k, self.num_experts = k, num_experts
        self.capacity_factor, self.eval_capacity_factor = capacity_factor, eval_capacity_factor
        self.min_capacity, self.noisy_gate_policy = min_capacity, noisy_gate_policy
        self.drop_tokens, self.use_rts, self.second_sampling = drop_tokens, use_rts, second_sampling
        self.ep_group: Comm | None = None

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor,
                                                torch.Tensor]:
        """(l_aux, capacity, indices [k, s], slots within the expert [k, s], weights [k, s], exp_counts)."""
        x32 = x.float()
        if self.noisy_gate_policy == "Jitter" and self.training:
            x32 = x32 * torch.distributions.uniform.Uniform(torch.tensor(1.0 - 1e-2, device=x.device),
                                                            torch.tensor(1.0 + 1e-2, device=x.device)
                                                            ).rsample(x32.shape)
        logits = F.linear(x32, self.wg.weight.float())
        factor = self.capacity_factor if self.training else self.eval_capacity_factor
        if self.k == 1:
            return self._top1(logits, factor, self.noisy_gate_policy if self.training else None)
        return self._top2(logits, factor)

    def _busiest(self, counts: torch.Tensor) -> int:
        """``drop_tokens=False``: the capacity is the busiest expert's count over the expert-parallel group."""
        top = counts.max().reshape(1)
        if self.ep_group is not None and self.ep_group.size > 1:
            self.ep_group.allreduce_(top, "max")
        return int(top[0])

    def _top1(self, logits: torch.Tensor, factor: float, policy: str | None
              ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        noisy = logits + torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=logits.device),
                                                          torch.tensor(1.0, device=logits.device)
                                                          ).rsample(logits.shape) if policy == "RSample" else None
        gates = F.softmax(logits, dim=1)
        tokens, experts = gates.shape
        capacity = _capacity(tokens, experts, factor, self.min_capacity)
        first = torch.argmax(noisy if noisy is not None else gates, dim=1)
        mask = F.one_hot(first, num_classes=experts)
        counts = mask.sum(dim=0).detach()
        if not self.drop_tokens:
            capacity = min(self._busiest(counts), tokens)
        l_aux = torch.sum(gates.mean(dim=0) * mask.float().mean(dim=0)) * experts
        if tokens < self.min_capacity:
            raise InvalidArgumentError(f"MoE: {tokens} tokens on this rank, fewer than min_capacity="
                                       f"{self.min_capacity}; set min_capacity=0 or pass more tokens")
        ranked = mask * torch.rand(mask.shape, device=mask.device) if self.use_rts else mask
        kept = torch.topk(ranked, k=min(capacity, tokens), dim=0)[1]
        mask = mask * torch.zeros_like(mask).scatter_(0, kept, 1)
        slot = torch.sum((torch.cumsum(mask, dim=0) - 1) * mask, dim=1)
        index = torch.minimum(first, mask.sum(dim=1) * experts - 1)  # dropped tokens: -1
        weight = (gates * mask).sum(dim=1)
        return l_aux, capacity, index[None], slot[None], weight[None], counts

    def _top2(self, logits: torch.Tensor, factor: float
              ) -> tuple[torch.Tensor, int, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        gates = F.softmax(logits, dim=1)
        tokens, experts = gates.shape
        first = torch.argmax(gates, dim=1)
        mask1 = F.one_hot(first, num_classes=experts)
        if self.second_sampling:
            logits = logits + torch.distributions.gumbel.Gumbel(torch.tensor(0.0, device=logits.device),
                                                               torch.tensor(1.0, device=logits.device)
                                                               ).rsample(logits.shape)
        second = torch.argmax(logits.masked_fill(mask1.bool(), float("-inf")), dim=1)
        mask2 = F.one_hot(second, num_classes=experts)
        at1 = torch.cumsum(mask1, dim=0) - 1
        at2 = torch.cumsum(mask2, dim=0) - 1 + mask1.sum(dim=0, keepdim=True)
        l_aux = torch.mean(gates.mean(dim=0) * mask1.float().mean(dim=0)) * experts * experts
        counts = (mask1 + mask2).sum(dim=0).detach()
        if self.drop_tokens:
            capacity = _capacity(tokens, experts, factor * 2, self.min_capacity)
            mask1 = mask1 * torch.lt(at1, capacity)
            mask2 = mask2 * torch.lt(at2, capacity)
        else:
            capacity = self._busiest(counts)
        g1 = (gates * mask1.float()).sum(dim=1)
        g2 = (gates * mask2.float()).sum(dim=1)
        denom = torch.clamp(g1 + g2, min=torch.finfo(g1.dtype).eps)
        g1, g2 = g1 / denom, g2 / denom
        i1 = torch.where(mask1.any(dim=1), first, torch.full_like(first, -1))
        i2 = torch.where(mask2.any(dim=1), second, torch.full_like(second, -1))
        slots = torch.stack([torch.sum(at1 * mask1, dim=1), torch.sum(at2 * mask2, dim=1)])
        return l_aux, capacity, torch.stack([i1, i2]), slots, torch.stack([g1, g2]), counts


class Experts(torch.nn.Module):
    """The experts this rank holds: copies of one module, each run on its share of the dispatched tokens."""

    def __init__(self, expert: torch.nn.Module, count: int, group_name: str) -> None:
        super().__init__()
        self.deepspeed_experts = torch.nn.ModuleList([copy.deepcopy(expert) for _ in range(count)])
        for p in self.deepspeed_experts.parameters():
            p.allreduce = False  # type: ignore[attr-defined]  # DeepSpeed's mark, read by prepare and its helpers
            p.group_name = group_name  # type: ignore[attr-defined]

    def forward(self, dispatched: torch.Tensor) -> torch.Tensor:
        """``dispatched``: [ep_size, local experts, capacity, width]; each expert takes its slice of dim 1."""
        outs = []
        for chunk, expert in zip(dispatched.chunk(len(self.deepspeed_experts), dim=1), self.deepspeed_experts,
                                 strict=True):
            out = expert(chunk)
            outs.append(out[0] if isinstance(out, tuple) else out)
        return torch.cat(outs, dim=1)


class _Layer(torch.nn.Module):
    """The gate and the experts, under DeepSpeed's names (``deepspeed_moe.gate.wg``,
    ``deepspeed_moe.experts.deepspeed_experts.N``): state dicts and checkpoints carry DeepSpeed's keys."""

    def __init__(self, gate: Gate, experts: Experts) -> None:
        super().__init__()
        self.gate, self.experts = gate, experts


class MoE(torch.nn.Module):
    """A Mixture-of-Experts layer; ``forward(x)`` returns ``(output, l_aux, exp_counts)``, as DeepSpeed's.

    Args:
        hidden_size: the tokens' width (the last dimension of the input and output).
        expert: the module each expert is a copy of (``expert(x)`` keeps the width; a tuple's first item is used).
        num_experts: experts in the layer, over all ranks of the expert-parallel group.
        ep_size: ranks the experts are spread over (divides the world and ``num_experts``).
        k: 1 or 2 experts per token.
        capacity_factor, eval_capacity_factor: each expert's slots per token share, in training and eval.
        min_capacity: the fewest slots per expert.
        use_residual: add a dense ``expert`` beside the experts, mixed by a learned 2-way softmax (Residual MoE).
        noisy_gate_policy: None, "Jitter" (the gate's input times uniform noise) or "RSample" (top-1 only: Gumbel
            noise on the logits picks the expert).
        drop_tokens: False: no token is dropped (capacity = the busiest expert's count).
        use_rts: drop over-capacity tokens at random (top-1); False: by position.
        top2_2nd_expert_sampling: Gumbel noise on the second choice (top-2).
        group: the Manager (or a Group) the expert-parallel groups are cut from (keyword only).
    """

    def __init__(self, hidden_size: int, expert: torch.nn.Module, num_experts: int = 1, ep_size: int = 1, k: int = 1,
                 capacity_factor: float = 1.0, eval_capacity_factor: float = 1.0, min_capacity: int = 4,
                 use_residual: bool = False, noisy_gate_policy: str | None = None, drop_tokens: bool = True,
                 use_rts: bool = True, top2_2nd_expert_sampling: bool = True, *, group: Any) -> None:
        super().__init__()
        if not hasattr(group, "split") or not hasattr(group, "size"):
            raise InvalidArgumentError(f"MoE(group=...) takes the Manager (or a Group) the expert groups are cut "
                                       f"from, got {type(group).__name__}")
        if k not in (1, 2):
            raise InvalidArgumentError(f"MoE(k={k!r}): top-1 and top-2 gating only (DeepSpeed's tested ones); use k=1 "
                                       "or k=2")
        if noisy_gate_policy not in GATE_POLICIES:
            raise InvalidArgumentError(f"MoE(noisy_gate_policy={noisy_gate_policy!r}); use None, 'Jitter' or "
                                       "'RSample'")
        if noisy_gate_policy == "RSample" and k != 1:
            raise InvalidArgumentError("MoE(noisy_gate_policy='RSample') acts on top-1 gating only; with k=2 the "
                                       "second expert is sampled (top2_2nd_expert_sampling), or use 'Jitter'")
        if isinstance(num_experts, bool) or not isinstance(num_experts, int) or num_experts < 1:
            raise InvalidArgumentError(f"MoE(num_experts={num_experts!r}) takes a positive int")
        check_ep_size(ep_size, group.size)
        if num_experts % ep_size:
            raise InvalidArgumentError(f"MoE(num_experts={num_experts}, ep_size={ep_size}): the experts must divide "
                                       f"over the expert-parallel ranks; use num_experts a multiple of {ep_size}")
        if not isinstance(expert, torch.nn.Module):
            raise InvalidArgumentError(f"MoE(expert=...) takes a torch.nn.Module, got {type(expert).__name__}")
        self.hidden_size, self.num_experts, self.ep_size, self.k = hidden_size, num_experts, ep_size, k
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = f"ep_size_{ep_size}"
        experts = Experts(expert, self.num_local_experts, self.expert_group_name)
        gate = Gate(hidden_size, num_experts, k, capacity_factor, eval_capacity_factor, min_capacity,
                    noisy_gate_policy, drop_tokens, use_rts, top2_2nd_expert_sampling)
        self.deepspeed_moe = _Layer(gate, experts)
        self.use_residual = use_residual
        if use_residual:
            self.mlp = expert
            self.coefficient = torch.nn.Linear(hidden_size, 2)
        self.ep_group, self.expert_dp_group = expert_groups(group, ep_size)
        gate.ep_group = self.ep_group
        for p in experts.parameters():  # summed over the ranks holding the same experts, / the data-parallel size
            set_reduce_comm(p, self.expert_dp_group, group.size)
        for i, module in enumerate(experts.deepspeed_experts):  # checkpoints name each by its index in the layer
            slot = ExpertSlot("deepspeed_experts", i, self.ep_group.rank, ep_size, self.num_local_experts)
            for p in module.parameters():
                set_expert_slot(p, slot)
        self.l_aux: torch.Tensor | None = None
        self.exp_counts: torch.Tensor | None = None

    def forward(self, hidden_states: torch.Tensor, used_token: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(output of the input's shape, l_aux, exp_counts) for the tokens along the input's last dimension."""
        if used_token is not None:
            raise InvalidArgumentError("MoE(...)(hidden_states, used_token): used_token is not supported; mask the "
                                       "tokens before the layer")
        d = hidden_states.shape[-1]
        tokens = hidden_states.reshape(-1, d)
        l_aux, capacity, index, slot, weight, counts = self.deepspeed_moe.gate(tokens)
        experts, n = self.num_experts, tokens.shape[0]
        # each route's place in the [experts * capacity] buffer; dropped routes go to one spare slot past the end
        where = torch.where(index >= 0, index.long() * capacity + slot.long(), experts * capacity)
        source = torch.full((experts * capacity + 1,), n, dtype=torch.long, device=tokens.device)
        source.scatter_(0, where.reshape(-1), torch.arange(n, device=tokens.device).expand_as(where).reshape(-1))
        padded = torch.cat([tokens, tokens.new_zeros(1, d)])
        dispatched = padded.index_select(0, source[:-1]).view(experts, capacity, d)
        if self.ep_size > 1:
            dispatched = _AllToAll.apply(dispatched, self.ep_group)  # type: ignore[no-untyped-call]
        dispatched = dispatched.reshape(self.ep_size, self.num_local_experts, -1, d)
        expert_out = self.deepspeed_moe.experts(dispatched).reshape(self.ep_size * self.num_local_experts, -1, d)
        if self.ep_size > 1:
            expert_out = _AllToAll.apply(expert_out, self.ep_group)  # type: ignore[no-untyped-call]
        flat = torch.cat([expert_out.reshape(experts * capacity, d), expert_out.new_zeros(1, d)])
        routed = flat.index_select(0, where.reshape(-1)).view(where.shape[0], n, d)
        output = (routed * weight.unsqueeze(-1)).sum(0).to(expert_out.dtype).reshape(hidden_states.shape)
        if self.use_residual:
            dense = self.mlp(hidden_states)
            dense = dense[0] if isinstance(dense, tuple) else dense
            coef = F.softmax(self.coefficient(hidden_states), dim=-1)
            output = output * coef[..., 0:1] + dense * coef[..., 1:]
        self.l_aux, self.exp_counts = l_aux, counts
        return output, l_aux, counts
