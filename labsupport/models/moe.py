"""A mixture-of-experts FFN for the course GPT: a router sends each token to ``k`` of ``E``
expert FFNs and adds their outputs, weighted by its gates.

* :class:`Router`: a linear layer to ``E`` logits and their softmax ``p`` (Shazeer et al.
  2017); each token goes to its ``k`` highest-scoring experts (top-k gating), weighted by
  their ``p`` (Switch, ``k = 1``: Fedus et al. 2022), renormalized over the ``k`` when
  ``k > 1`` (GShard's top-2, Lepikhin et al. 2021; Mixtral's ``softmax(TopK(x·W_g))``);
* an optional **capacity**: each expert takes at most ``ceil(capacity_factor · T·k / E)``
  of a batch's ``T`` tokens (Switch's expert capacity, counting ``k`` assignments per
  token as Megatron-Core's ``get_capacity`` does); the rest are **dropped**, first
  choices before second choices, then in token order (GShard, Algorithm 1). With
  ``capacity_factor=None`` nothing is dropped (dropless, as MegaBlocks);
* Switch's **auxiliary loss** ``α · E · Σ_i f_i · P_i``, ``f_i`` the share of the batch's
  ``T·k`` choices that went to expert ``i`` (before dropping) and ``P_i`` its mean
  probability; ``α = 0.01`` (Switch, section 2.2);
* DeepSeek-V3's **auxiliary-loss-free balancing**: a per-expert bias added to the scores
  that choose the experts, not to the gates; :func:`update_expert_bias` moves it by
  ``γ`` against each expert's load after a step (DeepSeek-AI 2024, section 2.1.2);
* an optional **shared expert** that every token goes through (DeepSeek-V3).

:class:`MoE` runs every expert in this process, and is the reference that
:class:`labsupport.parallel.expert_parallel.ExpertParallelMoE` equals: both route with
the same :class:`Router` and group the assignments by expert with the same
:func:`dispatch_plan`.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MoEConfig:
    """How an MoE layer routes: ``n_expert`` experts, ``top_k`` per token, a capacity
    factor (``None``: dropless), the auxiliary loss's ``aux_loss_coef`` (α), DeepSeek-V3's
    bias update speed (γ, used by :func:`update_expert_bias`) and a shared expert."""

    n_expert: int = 8
    top_k: int = 2
    capacity_factor: float | None = None
    aux_loss_coef: float = 0.01
    bias_update_speed: float = 0.0
    shared_expert: bool = False

    def __post_init__(self):
        if self.n_expert < 1:
            raise ValueError(f"n_expert must be at least 1, got {self.n_expert}")
        if not 1 <= self.top_k <= self.n_expert:
            raise ValueError(
                f"top_k={self.top_k} with n_expert={self.n_expert}: a token goes to top_k "
                "different experts, so choose 1 <= top_k <= n_expert"
            )
        if self.capacity_factor is not None and self.capacity_factor <= 0:
            raise ValueError(
                f"capacity_factor must be positive (or None for dropless), "
                f"got {self.capacity_factor}"
            )


@dataclass
class Routing:
    """Where a batch of ``T`` tokens goes: ``experts[t, j]`` is token ``t``'s ``j``-th
    choice, ``gates[t, j]`` its weight, ``kept[t, j]`` false where that expert was full;
    ``probs`` is the softmax over all ``E`` experts, ``scores`` what chose them."""

    probs: torch.Tensor  # (T, E)
    scores: torch.Tensor  # (T, E): probs + the balancing bias
    experts: torch.Tensor  # (T, k), int64
    gates: torch.Tensor  # (T, k)
    kept: torch.Tensor  # (T, k), bool

    @property
    def load(self) -> torch.Tensor:
        """Choices per expert, before dropping: what balancing looks at."""
        return torch.bincount(self.experts.flatten(), minlength=self.probs.shape[1])

    @property
    def tokens_per_expert(self) -> torch.Tensor:
        """Assignments each expert computes, after dropping."""
        return torch.bincount(self.experts[self.kept], minlength=self.probs.shape[1])

    @property
    def margin(self) -> float:
        """The smallest gap between a token's ``k``-th and ``(k+1)``-th score: below the
        float rounding of a forward pass, another machine could route differently."""
        k, n = self.experts.shape[1], self.scores.shape[1]
        if k == n:
            return math.inf
        top = self.scores.detach().topk(k + 1, dim=1).values
        return float((top[:, k - 1] - top[:, k]).min()) if len(top) else math.inf


def capacity(tokens: int, config: MoEConfig) -> int | None:
    """Assignments each expert may take from a batch of ``tokens`` tokens:
    ``ceil(capacity_factor · tokens · k / E)``; ``None`` when dropless."""
    if config.capacity_factor is None:
        return None
    return math.ceil(config.capacity_factor * tokens * config.top_k / config.n_expert)


def keep_within_capacity(experts: torch.Tensor, n_expert: int, limit: int | None):
    """``(T, k)`` bool: which assignments an expert takes before it is full. Each expert
    takes its first choices in token order, then its second choices, and so on (GShard)."""
    if limit is None:
        return torch.ones_like(experts, dtype=torch.bool)
    by_choice = F.one_hot(experts.t().reshape(-1), n_expert)  # (k·T, E), choice-major
    position = (by_choice.cumsum(0) * by_choice).sum(1)  # 1-based place in its queue
    return (position <= limit).view(experts.shape[1], -1).t()


def switch_aux_loss(probs: torch.Tensor, experts: torch.Tensor, coef: float) -> torch.Tensor:
    """Switch's load-balancing loss ``α · E · Σ_i f_i · P_i`` (Fedus et al. 2022, eq. 4),
    ``f_i`` the share of the ``T·k`` choices that went to expert ``i`` (``f`` carries no
    gradient) and ``P_i`` its mean router probability; ``α`` when perfectly balanced."""
    n_expert = probs.shape[1]
    f = torch.bincount(experts.flatten(), minlength=n_expert).to(probs.dtype) / experts.numel()
    return coef * n_expert * (f * probs.mean(0)).sum()


class Router(nn.Module):
    """Top-k gating: ``p = softmax(x · W_g)``; each token's ``k`` experts are the largest
    ``p + b`` (``b`` DeepSeek-V3's balancing bias, a buffer, zero unless updated), and
    their gates are their ``p``, renormalized over the ``k`` when ``k > 1``."""

    def __init__(self, n_embd: int, config: MoEConfig):
        super().__init__()
        self.config = config
        self.gate = nn.Linear(n_embd, config.n_expert, bias=False)
        self.register_buffer("expert_bias", torch.zeros(config.n_expert))

    def forward(self, x: torch.Tensor) -> Routing:
        c = self.config
        probs = F.softmax(self.gate(x).float(), dim=-1)
        scores = probs + self.expert_bias
        experts = scores.detach().topk(c.top_k, dim=-1).indices
        gates = probs.gather(1, experts)
        if c.top_k > 1:
            gates = gates / gates.sum(-1, keepdim=True)
        kept = keep_within_capacity(experts, c.n_expert, capacity(len(x), c))
        return Routing(probs, scores, experts, gates.to(x.dtype), kept)


def dispatch_plan(experts: torch.Tensor, n_expert: int, ep_size: int):
    """Group assignments by expert, hence by the rank that holds it (rank ``r`` holds
    experts ``r·E/ep`` to ``(r+1)·E/ep - 1``): ``(input_splits, order, inverse)``, the
    rows sent to each rank, the permutation that sorts ``experts`` by expert (stable) and
    its inverse, ``sorted[inverse]`` being the original order."""
    order = torch.argsort(experts, stable=True)
    per_rank = torch.bincount(experts, minlength=n_expert).view(ep_size, -1).sum(1)
    return per_rank.tolist(), order, inverse_permutation(order)


def inverse_permutation(order: torch.Tensor) -> torch.Tensor:
    """``inverse`` with ``inverse[order[i]] = i``: it puts permuted rows back."""
    inverse = torch.empty_like(order)
    inverse[order] = torch.arange(len(order), device=order.device)
    return inverse


def ffn(n_embd: int) -> nn.Module:
    """An expert when none is given: the transformer's 4x-wide GELU FFN."""
    return nn.Sequential(nn.Linear(n_embd, 4 * n_embd), nn.GELU(), nn.Linear(4 * n_embd, n_embd))


class MoE(nn.Module):
    """``y = Σ_j gate_j · expert_{e_j}(x)`` over each token's kept choices (plus the
    shared expert), every expert in this process. ``expert`` builds one expert (the
    course GPT passes its MLP). After a forward pass, :attr:`routing` and
    :attr:`aux_loss` hold the batch's routing and auxiliary loss."""

    def __init__(
        self, n_embd: int, config: MoEConfig, expert: Callable[[], nn.Module] | None = None
    ):
        super().__init__()
        self.config = config
        make = expert or (lambda: ffn(n_embd))
        self.router = Router(n_embd, config)
        self.experts = nn.ModuleList(make() for _ in range(config.n_expert))
        self.shared_expert = make() if config.shared_expert else None
        self.routing: Routing | None = None
        self.aux_loss: torch.Tensor | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        tokens = x.reshape(-1, x.shape[-1])
        routing = self.router(tokens)
        self.routing = routing
        self.aux_loss = switch_aux_loss(routing.probs, routing.experts, self.config.aux_loss_coef)
        chosen = routing.kept.flatten().nonzero().squeeze(1)  # kept assignments t·k + j
        token_of = chosen // self.config.top_k
        experts = routing.experts.flatten()[chosen]
        splits, order, inverse = self.plan(experts)
        rows = self.run_experts(tokens[token_of[order]], experts[order], splits)[inverse]
        weighted = rows * routing.gates.flatten()[chosen].unsqueeze(1)
        y = torch.zeros_like(tokens).index_add(0, token_of, weighted)
        if self.shared_expert is not None:
            y = y + self.shared_expert(tokens)
        return y.view(x.shape)

    def plan(self, experts: torch.Tensor):
        return dispatch_plan(experts, self.config.n_expert, 1)

    def run_experts(self, rows, experts, splits):
        """The experts on ``rows``, grouped by expert (``experts`` sorted)."""
        counts = torch.bincount(experts, minlength=len(self.experts)).tolist()
        chunks = rows.split(counts)
        return torch.cat([e(c) for e, c in zip(self.experts, chunks, strict=True)])


def moe_layers(model: nn.Module) -> list[MoE]:
    """The MoE layers of ``model``, in order."""
    return [m for m in model.modules() if isinstance(m, MoE)]


def aux_loss(model: nn.Module) -> torch.Tensor | float:
    """The sum of the MoE layers' auxiliary losses from the last forward pass (0 without)."""
    return sum((m.aux_loss for m in moe_layers(model) if m.aux_loss is not None), 0.0)


@torch.no_grad()
def update_expert_bias(model: nn.Module, loads: list | None = None) -> None:
    """DeepSeek-V3's balancing step, after an optimizer step: each layer's bias ``b_i``
    rises by ``γ`` for an expert that got fewer choices than the mean and falls by ``γ``
    for one that got more; ``loads`` are the step's choices per expert and layer (by
    default the last forward pass's; sum them over data-parallel ranks first)."""
    layers = moe_layers(model)
    loads = loads if loads is not None else [m.routing.load for m in layers]
    for m, load in zip(layers, loads, strict=True):
        load = load.to(m.router.expert_bias.dtype)
        m.router.expert_bias += m.config.bias_update_speed * torch.sign(load.mean() - load)
