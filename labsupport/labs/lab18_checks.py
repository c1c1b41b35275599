"""Lab 18's exercise checkers: the dispatch plan of expert parallelism, run inside the
all-to-all on real ranks, and which assignments an expert with a capacity keeps."""

from __future__ import annotations

import copy
import math

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise, launch_answer
from labsupport.labs.lab18_moe import CONFIGS, TOL, lab_moe, tokens
from labsupport.launch.runtime import device
from labsupport.models.moe import MoEConfig, capacity, dispatch_plan, keep_within_capacity
from labsupport.parallel.expert_parallel import ExpertParallelMoE

#: Kept assignments' experts (8 experts) for the local checks: rank 0 of 4 gets rows for
#: experts 0 and 1, rank 1 for 2 and 3, ...; one routing with nothing for a rank, one empty.
PLAN_CASES = [
    (torch.tensor([5, 0, 3, 0, 7, 2, 5, 1, 6, 3, 4, 0]), 8, 4),
    (torch.tensor([5, 0, 3, 0, 7, 2, 5, 1, 6, 3, 4, 0]), 8, 2),
    (torch.tensor([7, 6, 6, 2, 3, 7]), 8, 4),
    (torch.tensor([], dtype=torch.long), 8, 4),
]


def _plan_problem(fn, experts, n_expert, ep) -> str | None:
    """What is wrong with ``fn``'s plan for one routing, or ``None``."""
    where = f"experts {experts.tolist()}, {n_expert} experts on {ep} ranks: "
    out = fn(experts.clone(), n_expert, ep)
    if not isinstance(out, tuple | list) or len(out) != 3:
        return where + "return three things: (input_splits, order, inverse)"
    splits, order, inverse = out
    splits = [int(n) for n in splits]
    want, _, _ = dispatch_plan(experts, n_expert, ep)
    n = len(experts)
    if len(splits) != ep:
        return where + (
            f"input_splits has {len(splits)} numbers: give one per rank ({ep}), the rows for "
            "all of that rank's experts"
            + (" (you counted per expert)" if len(splits) == n_expert else "")
        )
    if splits != want:
        by_modulo = torch.bincount(experts % ep, minlength=ep).tolist() if n else [0] * ep
        hint = (
            "rank r holds the consecutive experts r*E/ep to (r+1)*E/ep - 1, not every ep-th one"
            if splits == by_modulo and splits != want
            else "count the rows each rank's experts get"
        )
        return where + f"input_splits is {splits}, should be {want}: {hint}"
    order, inverse = torch.as_tensor(order).long(), torch.as_tensor(inverse).long()
    if sorted(order.tolist()) != list(range(n)):
        return where + f"order {order.tolist()} is not a permutation of the {n} rows"
    ranks = experts[order] // (n_expert // ep)
    if not bool((experts[order].diff() >= 0).all()):
        if bool((ranks.diff() >= 0).all()):
            return where + (
                "order groups the rows by rank but not by expert within a rank: the rank "
                "that receives them splits them among its experts by the counts, in expert order"
            )
        return where + f"experts[order] is {experts[order].tolist()}: sort the rows by expert"
    if sorted(inverse.tolist()) != list(range(n)) or not torch.equal(
        order[inverse], torch.arange(n)
    ):
        hint = "that is order itself; " if torch.equal(inverse, order) else ""
        return where + hint + "inverse must put each sorted row back: inverse[order[i]] == i"
    return None


def _on_ranks(fn) -> dict:
    """The lab's top-2 layer split over the ranks with ``fn`` as its plan, against one
    process: whether the output and the gradients agree (run on every rank)."""
    ep, rank = dist.get_world_size(), dist.get_rank()
    moe = lab_moe(CONFIGS["top-2, dropless"])
    reference, layer = copy.deepcopy(moe), ExpertParallelMoE(moe.to(device()), plan=fn)
    total = sum(reference(tokens(r)).square().sum() for r in range(ep))
    total.backward()
    y = layer(tokens(rank).to(device()))
    y.square().sum().backward()
    first = layer.first_expert
    local = reference.experts[first : first + len(layer.experts)]
    return {
        "output": bool(torch.allclose(y.cpu(), reference(tokens(rank)), **TOL)),
        "gradients": all(
            torch.allclose(p.grad.cpu(), q.grad, **TOL)
            for p, q in zip(layer.experts.parameters(), local.parameters(), strict=True)
        ),
    }


@exercise
def check_dispatch_plan(fn, world: int = 4, timeout: float = 60) -> str:
    """Exercise 1: ``fn(experts, n_expert, ep_size)`` returns ``(input_splits, order,
    inverse)``; checked on small routings, then as the plan of the lab's layer split over
    ``world`` real ranks, whose output and expert gradients must equal one process's."""
    for case in PLAN_CASES:
        problem = _plan_problem(fn, *case)
        if problem:
            raise AssertionError(problem)
    hint = (
        "Each rank must compute its plan from its own routing and nothing else: does your "
        "function call a collective, or wait for another rank?"
    )
    results = launch_answer(_on_ranks, world, hint, timeout, args=(fn,))
    bad = next((r for r in range(world) if not all(results[r].values())), None)
    if bad is not None:
        raise AssertionError(f"on {world} ranks, rank {bad}: {results[bad]} against one process")
    return f"your plan moves the lab's tokens on {world} ranks as one process computes them"


#: Routings ``(experts (T, k), n_expert, capacity_factor)`` for the capacity exercise.
KEEP_CASES = [
    (torch.tensor([[2, 0], [2, 1], [2, 0], [0, 2], [1, 2], [2, 3]]), 4, 1.0),
    (torch.tensor([[0, 1], [0, 2], [0, 1], [1, 0], [3, 0]]), 4, 1.0),
    (torch.tensor([[1, 0], [0, 1], [2, 3], [3, 2]]), 4, 0.5),
    (torch.randint(8, (40, 1), generator=torch.Generator().manual_seed(1)), 8, 1.25),
    (torch.randn(64, 8, generator=torch.Generator().manual_seed(2)).topk(2).indices, 8, 1.0),
]


def _keep_variants(experts, n_expert, factor) -> dict:
    """The masks of common mistakes, to name the one made."""
    t, k = experts.shape
    config = MoEConfig(n_expert, k, capacity_factor=factor)
    token_major = keep_within_capacity(experts.reshape(-1, 1), n_expert, capacity(t, config))
    return {
        "nothing is dropped: each expert takes at most ceil(capacity_factor * T * k / E)": (
            torch.ones_like(experts, dtype=torch.bool)
        ),
        "the capacity rounds up: ceil(capacity_factor * T * k / E)": keep_within_capacity(
            experts, n_expert, math.floor(factor * t * k / n_expert)
        ),
        "each token makes k choices: the capacity is ceil(capacity_factor * T * k / E)": (
            keep_within_capacity(experts, n_expert, math.ceil(factor * t / n_expert))
        ),
        "first choices come first: a token's second choice waits until every token's first "
        "choice has its place": token_major.view(t, k),
    }


@exercise
def check_keep(fn) -> str:
    """Exercise 2: ``fn(experts, n_expert, capacity_factor)`` returns the ``(T, k)`` mask
    of assignments kept: each expert takes at most ``ceil(capacity_factor · T·k / E)``,
    first choices in token order, then second choices (GShard)."""
    for experts, n_expert, factor in KEEP_CASES:
        t, k = experts.shape
        want = keep_within_capacity(experts, n_expert, capacity(t, MoEConfig(n_expert, k, factor)))
        got = torch.as_tensor(fn(experts.clone(), n_expert, factor))
        if got.shape == want.shape and torch.equal(got.bool(), want):
            continue
        shown = f"{experts.tolist()[:6]}{'...' if t > 6 else ''}"
        where = f"experts {shown}, E={n_expert}, capacity factor {factor}: "
        if got.shape != want.shape:
            raise AssertionError(
                where + f"return a mask of shape {tuple(want.shape)}, got {tuple(got.shape)}"
            )
        variants = _keep_variants(experts, n_expert, factor)
        hint = next((h for h, m in variants.items() if torch.equal(got.bool(), m)), None)
        raise AssertionError(
            where + (hint or f"kept {got.long().tolist()}, should be {want.long().tolist()}")
        )
    return "each expert keeps its first ceil(capacity_factor * T * k / E) choices, first ones first"
