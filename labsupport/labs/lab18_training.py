"""Lab 18, training the course GPT with MoE blocks: load balancing over steps (none, Switch's
auxiliary loss, DeepSeek-V3's bias), and EP × DP on 4 ranks against one process.

The model is :data:`LAB_GPT` with every MLP an MoE of :data:`MOE`; the data are random
tokens (:func:`batch`). Each rank of EP × DP trains on its own share of the step's batch;
one process gets the same gradients by running the shares one after another (gradient
accumulation) with each share's loss (language model + auxiliary) weighted ``1/N``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsupport.launch.runtime import device
from labsupport.models import GPT, MoEConfig, batch_share, random_tokens, tiny_gpt
from labsupport.models import moe as moe_model
from labsupport.parallel import expert_parallel as xp

LAB_GPT = {"vocab_size": 64, "block_size": 16, "n_layer": 2, "n_head": 2, "n_embd": 32}
MOE = MoEConfig(n_expert=4, top_k=2)
SHARE, RANKS, LR = 2, 4, 3e-3  # sequences per rank, ranks, AdamW's learning rate
#: The balancing runs: Switch's α = 0.01; a bias speed γ 3x DeepSeek-V3's 0.001, for a run
#: of 80 steps instead of hundreds of thousands.
BALANCING = {
    "none": MoEConfig(8, 2, aux_loss_coef=0.0),
    "auxiliary loss": MoEConfig(8, 2, aux_loss_coef=0.01),
    "bias": MoEConfig(8, 2, aux_loss_coef=0.0, bias_update_speed=3e-3),
}
BALANCE_SEQUENCES = 8


def build(moe: MoEConfig = MOE, seed: int = 0) -> GPT:
    """The lab's MoE GPT, the same weights for a ``seed`` on every rank."""
    return tiny_gpt(seed, **LAB_GPT, moe=moe)


def batch(step: int, share: int, ranks: int = RANKS):
    """Rank ``share``'s sequences of the step's batch (``ranks`` shares): ``(idx, targets)``."""
    idx, targets = random_tokens(SHARE * ranks, LAB_GPT["block_size"], LAB_GPT["vocab_size"], step)
    mine = batch_share(SHARE * ranks, share, ranks)
    return idx[mine], targets[mine]


def train_single(steps: int, ranks: int = RANKS) -> list[float]:
    """One process: each step runs the ``ranks`` shares one after another, each share's
    loss (plus its auxiliary loss) divided by ``ranks``; returns the mean LM loss."""
    model = build()
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        total = 0.0
        for share in range(ranks):
            loss = model(*batch(step, share, ranks))[1]
            ((loss + moe_model.aux_loss(model)) / ranks).backward()
            total += loss.item() / ranks
        opt.step()
        opt.zero_grad()
        losses.append(total)
    return losses


def train_ep_dp(steps: int, groups: dict, reduce=xp.all_reduce_gradients) -> list[float]:
    """EP × DP on every rank: the experts split over ``groups["ep"]``, each rank its own
    share of the batch, then ``reduce(model, groups["dp"], groups["expert_dp"])`` makes
    every gradient the mean over the ranks. Returns the mean LM loss of each step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    model = xp.parallelize(build().to(device()), groups["ep"])
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    losses = []
    for step in range(steps):
        idx, targets = (t.to(device()) for t in batch(step, rank, world))
        loss = model(idx, targets)[1]
        (loss + moe_model.aux_loss(model)).backward()
        reduce(model, groups["dp"], groups["expert_dp"])
        opt.step()
        opt.zero_grad()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / world)
    return losses


def experts_over_all(model, dp_group, expert_dp_group) -> None:
    """Wrong: the experts' gradients all-reduced over every rank, like the rest."""
    xp.all_reduce_gradients(model, dp_group, dp_group)


def rest_over_expert_dp(model, dp_group, expert_dp_group) -> None:
    """Wrong: the non-expert gradients all-reduced over the expert-data-parallel group only
    (divided by all the ranks, as the others)."""
    n = dist.get_world_size(dp_group)
    xp.all_reduce_gradients(model, expert_dp_group, expert_dp_group)
    for p in model.parameters():
        if p.grad is not None:
            p.grad *= dist.get_world_size(expert_dp_group) / n


def ep_dp_runs(steps: int, ep: int = 2) -> dict:
    """:func:`train_ep_dp` with the right groups and with each wrong one (run on every
    rank): the losses of each, and this rank's groups."""
    groups = xp.expert_parallel_groups(ep)
    ep_groups, expert_dp_groups = xp.expert_parallel_ranks(dist.get_world_size(), ep)
    rank = dist.get_rank()
    return {
        "rank": rank,
        "ep group": next(g for g in ep_groups if rank in g),
        "expert-dp group": next(g for g in expert_dp_groups if rank in g),
        "right": train_ep_dp(steps, groups),
        "experts over all ranks": train_ep_dp(steps, groups, experts_over_all),
        "rest over expert-dp": train_ep_dp(steps, groups, rest_over_expert_dp),
    }


def balancing(steps: int, mode: str, seed: int = 0) -> list[float]:
    """One process trains the MoE GPT (8 experts, top-2, :data:`BALANCE_SEQUENCES` per
    step, learning rate 1e-3) with ``mode`` in :data:`BALANCING`; returns each step's
    imbalance: the busiest expert's load over the mean load, averaged over the layers
    (1 is perfect, 4 is every token's two choices on the same two experts)."""
    model = build(BALANCING[mode], seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    imbalance = []
    for step in range(steps):
        c = LAB_GPT
        idx, targets = random_tokens(BALANCE_SEQUENCES, c["block_size"], c["vocab_size"], step)
        loss = model(idx, targets)[1] + moe_model.aux_loss(model)
        loss.backward()
        opt.step()
        opt.zero_grad()
        loads = [m.routing.load.float() for m in moe_model.moe_layers(model)]
        imbalance.append(sum(float(x.max() / x.mean()) for x in loads) / len(loads))
        moe_model.update_expert_bias(model)
    return imbalance
