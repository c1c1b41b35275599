"""Expert parallelism: the experts of an MoE layer split over the ranks of an expert-parallel
(EP) group, each token sent to the ranks that hold its experts and its results sent back.

Rank ``r`` of ``ep`` holds experts ``r·E/ep`` to ``(r+1)·E/ep - 1``; the router and every
other parameter are whole on every rank, and each rank routes its own tokens. An MoE
layer's forward pass, as torchtitan's ``ExpertParallel`` and Megatron-Core's
``MoEAlltoAllTokenDispatcher`` run it (Lepikhin et al. 2021, GShard, section 3):

1. **route** this rank's tokens and sort the kept assignments by expert, so by destination
   (:func:`labsupport.models.moe.dispatch_plan`);
2. **exchange counts**: an all-to-all of the number of rows for each expert, so that each
   rank knows how many rows it will receive from each rank (:func:`exchange_counts`);
3. **dispatch**: an all-to-all with those uneven split sizes (:func:`all_to_all`);
4. run the **local experts**, each on its rows from every rank (regrouped by expert);
5. **combine**: the reverse all-to-all brings each result home, where the gates weight it.

The backward pass runs the two all-to-alls again, reversed (:class:`_AllToAll`). Each rank
sends ``4 · h · bytes`` per row it sends to another rank, per layer and step.
With data parallelism beside it (EP × DP, :func:`expert_parallel_groups`), the experts'
gradients are summed over the ranks that hold the same experts and the rest over all
ranks (:func:`all_reduce_gradients`). Collectives go through ``comm.traced``.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

from labsupport.comm import traced
from labsupport.models.moe import MoE, dispatch_plan, inverse_permutation


def check_expert_parallel(n_expert: int, top_k: int, ep: int) -> None:
    """Refuse sizes expert parallelism cannot run, saying what to change."""
    if ep < 1 or n_expert % ep:
        raise ValueError(
            f"{n_expert} experts do not divide over an expert-parallel group of {ep} ranks: "
            f"each rank holds n_expert / ep experts, so choose n_expert a multiple of {ep}"
        )
    if not 1 <= top_k <= n_expert:
        raise ValueError(f"top_k={top_k} must be between 1 and n_expert={n_expert}")


def _sent_bytes(x: torch.Tensor, input_splits: list[int], group) -> int:
    """Bytes this rank sends to the other ranks (its own rows stay in place)."""
    me = dist.get_rank(group)
    row = x[0].numel() * x.element_size() if len(x) else 0
    return sum(n for r, n in enumerate(input_splits) if r != me) * row


class _AllToAll(torch.autograd.Function):
    """``all_to_all_single`` with uneven splits; its backward pass is the reverse
    all-to-all, the splits swapped (Megatron-LM ``tensor_parallel.mappings._AllToAll``)."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        x = x.contiguous()
        out = x.new_empty((sum(output_splits), *x.shape[1:]))
        traced._record("all_to_all", _sent_bytes(x, input_splits, group), group)
        dist.all_to_all_single(out, x, output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        output_splits, input_splits = ctx.splits
        return _AllToAll.apply(grad, input_splits, output_splits, ctx.group), None, None, None


def all_to_all(x: torch.Tensor, output_splits: list[int], input_splits: list[int], group=None):
    """Send ``input_splits[j]`` rows of ``x`` (in order) to rank ``j`` of ``group`` and
    receive ``output_splits[j]`` rows from it; differentiable, recorded as ``all_to_all``
    with the bytes this rank sends to the others."""
    return _AllToAll.apply(x, output_splits, input_splits, group)


def exchange_counts(tokens_per_expert: torch.Tensor, group=None) -> torch.Tensor:
    """Tell each rank how many rows it gets: rank ``j`` receives the counts of its own
    experts from every rank. Returns ``(ep, E/ep)``: rows for each local expert, by source."""
    ep = dist.get_world_size(group)
    counts = tokens_per_expert.contiguous()
    received = torch.empty_like(counts)
    traced._record("all_to_all", _sent_bytes(counts.view(ep, -1), [1] * ep, group), group)
    dist.all_to_all_single(received, counts, group=group)
    return received.view(ep, -1)


def expert_major(counts: torch.Tensor) -> torch.Tensor:
    """The permutation that regroups received rows, in (source, local expert) order with
    sizes ``counts[s, e]``, into (local expert, source) order, so each expert runs once."""
    ep, local = counts.shape
    chunks = torch.arange(int(counts.sum()), device=counts.device).split(counts.flatten().tolist())
    return torch.cat([chunks[s * local + e] for e in range(local) for s in range(ep)])


class ExpertParallelMoE(MoE):
    """An :class:`~labsupport.models.moe.MoE` with its experts split over ``group``: this
    rank keeps its ``E/ep`` experts of ``moe`` (the same modules) and shares its router and
    shared expert. ``plan`` turns the routing into ``(input_splits, order, inverse)``
    (:func:`~labsupport.models.moe.dispatch_plan`; lab 18's exercise passes its own).
    After a forward pass, :attr:`received` holds ``(ep, E/ep)``: rows for each local
    expert from each rank."""

    def __init__(self, moe: MoE, group=None, plan=dispatch_plan):
        nn.Module.__init__(self)
        ep, rank = dist.get_world_size(group), dist.get_rank(group)
        check_expert_parallel(moe.config.n_expert, moe.config.top_k, ep)
        local = moe.config.n_expert // ep
        self.config, self.group, self._plan = moe.config, group, plan
        self.router, self.shared_expert = moe.router, moe.shared_expert
        self.experts = nn.ModuleList(list(moe.experts)[rank * local : (rank + 1) * local])
        self.first_expert = rank * local
        self.routing = self.aux_loss = self.received = None

    def plan(self, experts: torch.Tensor):
        return self._plan(experts, self.config.n_expert, dist.get_world_size(self.group))

    def run_experts(self, rows, experts, splits):
        counts = torch.bincount(experts, minlength=self.config.n_expert)
        received = exchange_counts(counts, self.group)
        self.received = received
        from_each = received.sum(1).tolist()
        x = all_to_all(rows, from_each, splits, self.group)
        order = expert_major(received)
        chunks = x[order].split(received.sum(0).tolist())
        y = torch.cat([e(c) for e, c in zip(self.experts, chunks, strict=True)])
        return all_to_all(y[inverse_permutation(order)], splits, from_each, self.group)


def parallelize(model: nn.Module, group=None) -> nn.Module:
    """Replace every MoE layer of ``model`` by its :class:`ExpertParallelMoE` over
    ``group``, in place (torchtitan's ``parallelize_module`` with ``ExpertParallel``)."""
    for module in list(model.modules()):
        for name, child in module.named_children():
            if isinstance(child, MoE) and not isinstance(child, ExpertParallelMoE):
                setattr(module, name, ExpertParallelMoE(child, group))
    return model


def expert_parameters(model: nn.Module) -> list[nn.Parameter]:
    """The parameters of the experts this rank holds (Megatron marks them
    ``allreduce=False``): reduced over the expert-data-parallel group."""
    layers = [m for m in model.modules() if isinstance(m, ExpertParallelMoE)]
    return [p for m in layers for p in m.experts.parameters()]


def expert_parallel_ranks(world: int, ep: int) -> tuple[list[list[int]], list[list[int]]]:
    """The EP groups (``ep`` consecutive ranks, as Megatron places them inside a node) and
    the expert-data-parallel groups (the ranks holding the same experts, ``world / ep``
    each, one per EP rank): ``(ep_groups, expert_dp_groups)``."""
    if ep < 1 or world % ep:
        raise ValueError(
            f"an expert-parallel group of {ep} ranks does not divide a world of {world}: "
            f"choose ep dividing {world}"
        )
    ep_groups = [list(range(s, s + ep)) for s in range(0, world, ep)]
    return ep_groups, [list(range(r, world, ep)) for r in range(ep)]


def expert_parallel_groups(ep: int) -> dict:
    """Create the groups of EP × DP on every rank (all ranks call it, in the same order)
    and return this rank's: ``{"ep": ..., "expert_dp": ..., "dp": ...}``, ``dp`` being
    every rank (each rank has its own data; the non-expert parameters are replicated)."""
    world, me = dist.get_world_size(), dist.get_rank()
    ep_groups, expert_dp_groups = expert_parallel_ranks(world, ep)
    mine = {"dp": dist.group.WORLD}
    for kind, groups in (("ep", ep_groups), ("expert_dp", expert_dp_groups)):
        for ranks in groups:
            group = dist.new_group(ranks)
            if me in ranks:
                mine[kind] = group
    return mine


def all_reduce_gradients(model: nn.Module, dp_group=None, expert_dp_group=None) -> None:
    """The data-parallel step of EP × DP: every gradient becomes the mean over the ``N``
    ranks of ``dp_group``. A non-expert gradient is all-reduced over ``dp_group``; an
    expert's already holds the rows of its whole EP group, so it is summed over
    ``expert_dp_group`` (the ranks with the same experts) and divided by the same ``N``
    (Megatron-Core's ``expert_gradient_scaling_factor = 1 / data_parallel_size``)."""
    n = dist.get_world_size(dp_group)
    experts = {id(p) for p in expert_parameters(model)}
    for p in model.parameters():
        if p.grad is None:
            continue
        traced.all_reduce(p.grad, expert_dp_group if id(p) in experts else dp_group)
        p.grad /= n


def all_to_all_bytes(trace: traced.Trace) -> int:
    """Bytes this rank sent to other ranks in the all-to-alls of ``trace``."""
    return sum(size for name, size, _ in trace.calls if name == "all_to_all")
