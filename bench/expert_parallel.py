"""An MoE layer under expert parallelism on 4 ranks against the same ranks' compute with no
all-to-all and against the same layer in one process, and the bytes each rank sends
against the formula (issue 22's target: exact).

The layer: width 256, 8 experts (4x-wide GELU FFNs), top-2, dropless; each of the 4 ranks
routes its own 512 tokens. One training step is its forward and backward pass, timed after
a warm-up from a barrier to the slowest rank's end. In one launch of 4 ranks, in turns,
REPEATS steps each: the step, and its floor, :class:`LocalExperts`, each rank's share of
the compute with the all-to-alls taken away (its routing, its local experts on as many
rows as the real routing sends them, the gates and the combine, what would arrive made of
its own rows). Load on the machine lands on both alike, so the step over its floor, the
median of the pairs, is at least 1 but for noise at any load, and what it has above 1 is
the all-to-alls and the waiting for them. That launch alternates, ROUNDS rounds, with a
launch of one process (under the same settings) that runs the 2,048 tokens of all four
ranks, rank by rank, through the whole layer, REPEATS times; the ratio to it is the median
of the pairs of the two launches' median times. Every process computes with one thread
(``LABSUPPORT_THREADS=1``): on a busy 2-core machine, two threads per process made the
single process's small matrix products 20 times slower. The 4 ranks share the cores and
every token crosses loopback; the ratios are reported, with no target. The bytes are
counted by ``comm.traced`` in one step and held against their floor,
``estimate.moe.all_to_all_bytes`` of the step's routing plus the count exchange.
"""

from __future__ import annotations

import statistics
import sys

import torch
import torch.distributed as dist

from bench import report
from labsupport.models.moe import MoE, dispatch_plan, inverse_permutation

WIDTH, EXPERTS, TOP_K, TOKENS, WORLD = 256, 8, 2, 512, 4
REPEATS, ROUNDS = 6, 5


def tokens(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens; they need a gradient, as a layer's input in a model does
    (else autograd skips the dispatch's twin in the backward pass)."""
    x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(rank))
    return x.requires_grad_(True)


def layer():
    from labsupport.models import MoEConfig

    torch.manual_seed(0)
    return MoE(WIDTH, MoEConfig(EXPERTS, TOP_K))


def step(model, batches) -> None:
    for x in batches:
        model(x).square().mean().backward()


def arrivals(router, batches: list, rank: int) -> torch.Tensor:
    """``(ep, E/ep)``: the rows each local expert of rank ``rank`` gets from each rank of
    ``len(batches)``, rank ``s`` routing ``batches[s]`` with ``router`` (what
    :func:`labsupport.parallel.expert_parallel.exchange_counts` tells rank ``rank``)."""
    with torch.no_grad():
        counts = torch.stack([router(x).tokens_per_expert for x in batches])
    local = counts.shape[1] // len(batches)
    return counts[:, rank * local : (rank + 1) * local]


def arrive(rows: torch.Tensor, n: int) -> torch.Tensor:
    """An all-to-all's stand-in: ``n`` rows made of ``rows``, cycled (rows like those the
    other ranks would send), differentiable; a gather forward and its scatter backward
    stand for the bytes that would land in memory."""
    return rows[torch.arange(n, device=rows.device) % len(rows)]


class LocalExperts(MoE):
    """Rank ``rank``'s share of an expert-parallel step of ``moe`` with no all-to-all: the
    routing of its own tokens, :class:`~labsupport.parallel.expert_parallel.
    ExpertParallelMoE`'s plan and regrouping, its ``E/ep`` experts each on as many rows
    as ``received`` (``(ep, E/ep)``, :func:`arrivals`) says the ranks send it, the gates
    and the combine; where rows would arrive, :func:`arrive` makes them."""

    def __init__(self, moe: MoE, rank: int, received: torch.Tensor):
        torch.nn.Module.__init__(self)
        ep, local = received.shape
        self.config, self.received, self.ep = moe.config, received, ep
        self.router, self.shared_expert = moe.router, moe.shared_expert
        self.experts = torch.nn.ModuleList(list(moe.experts)[rank * local : (rank + 1) * local])
        self.routing = self.aux_loss = None

    def plan(self, experts: torch.Tensor):
        return dispatch_plan(experts, self.config.n_expert, self.ep)

    def run_experts(self, rows, experts, splits):
        from labsupport.parallel.expert_parallel import expert_major

        order = expert_major(self.received)
        x = arrive(rows, int(self.received.sum()))[order]
        chunks = x.split(self.received.sum(0).tolist())
        y = torch.cat([e(c) for e, c in zip(self.experts, chunks, strict=True)])
        return arrive(y[inverse_permutation(order)], len(rows))


def timed(kind: str) -> dict:
    """REPEATS steps' seconds (``"step"``; for expert parallelism also its floor's,
    ``"floor"``, in turns), and for expert parallelism the bytes this rank sent in one
    step and what the formula gives for that step's routing."""
    from labsupport.comm import traced
    from labsupport.estimate.moe import all_to_all_bytes
    from labsupport.launch.runtime import device
    from labsupport.parallel import expert_parallel as xp

    rank = dist.get_rank()
    if kind == "ep":
        model = xp.ExpertParallelMoE(layer().to(device()))
        batches = [tokens(rank).detach().to(device()).requires_grad_(True)]
    else:
        model, batches = layer(), [tokens(r) for r in range(WORLD)]
    with traced.trace_collectives() as trace:
        step(model, batches)  # warm-up, and the bytes of one step
    models, out = {"step": model}, {}
    if kind == "ep":
        everyone = [tokens(r).to(device()) for r in range(WORLD)]
        local = LocalExperts(layer().to(device()), rank, arrivals(model.router, everyone, rank))
        if not torch.equal(local.received, model.received):
            raise RuntimeError("the floor's rows per expert are not the routing's")
        step(local, batches)  # its warm-up
        models["floor"] = local
        sent = torch.bincount(model.routing.experts.flatten(), minlength=EXPERTS)
        rows_to = [None] * WORLD
        dist.all_gather_object(rows_to, sent.view(WORLD, -1).sum(1).tolist())
        counts = (WORLD - 1) * EXPERTS // WORLD * 8
        out = {
            "bytes": xp.all_to_all_bytes(trace),
            "formula": all_to_all_bytes(rows_to, WIDTH)[rank] + counts,
        }
    runs = {name: report.slowest(lambda m=m: step(m, batches)) for name, m in models.items()}
    return out | report.in_turns(runs, REPEATS)


def summarise(ep: list, single: list, bytes_rows: list) -> list[dict]:
    """The bench's lines from the rounds' launches' results and one round's bytes per rank."""
    names = ("one process, every expert", f"EP {WORLD}, {EXPERTS // WORLD} experts per rank")
    floor = (
        "each rank's share of the compute with no all-to-all (its routing, its experts on "
        "as many rows as the routing sends them, the combine), timed in turns with the step"
    )
    return [
        *report.against_floor(names, ep, [r["step"] for r in single], floor),
        report.line(
            "EP, bytes each rank sent in one step (all-to-alls)",
            statistics.median(r["bytes"] for r in bytes_rows),
            "B",
            of_floor=report.paired(
                [r["bytes"] for r in bytes_rows], [r["formula"] for r in bytes_rows], "ranks"
            ),  # fmt: skip
            floor="estimate.moe.all_to_all_bytes of the step's routing, plus the counts",
        ),
    ]


def main() -> int:
    import os

    from labsupport import launch

    os.environ["LABSUPPORT_THREADS"] = "1"  # every process one thread (see above)
    bytes_rows = []

    def ep():
        results = launch(timed, WORLD, args=("ep",), timeout=900)
        bytes_rows[:] = results
        return results[0]

    runs = {"ep": ep, "single": lambda: launch(timed, 1, args=("single",), timeout=900)[0]}
    rounds = report.in_turns(runs, ROUNDS)
    print(
        f"\nan MoE layer (width {WIDTH}, {EXPERTS} experts, top-{TOP_K}, dropless), "
        f"{WORLD} x {TOKENS} tokens, forward and backward; {ROUNDS} rounds of a launch of "
        f"{WORLD} ranks (the step and its floor in turns, {REPEATS} steps each) and one of one "
        f"process ({REPEATS} steps)"
    )
    lines = summarise(rounds["ep"], rounds["single"], bytes_rows)
    report.print_lines(lines, "x one process")
    print(f"(time reported, no target: {WORLD} ranks share this machine's cores)")
    print(f"{'rank':>4s} {'bytes sent':>12s} {'formula':>12s}")
    for rank, r in enumerate(bytes_rows):
        print(f"{rank:4d} {r['bytes']:12,d} {r['formula']:12,d}")
    exact = all(r["bytes"] == r["formula"] for r in bytes_rows)
    targets = [report.target("bytes per rank exactly the formula", f"{exact}", exact)]
    config = {"width": WIDTH, "experts": EXPERTS, "top_k": TOP_K, "tokens": TOKENS,
              "world": WORLD, "repeats": REPEATS, "rounds": ROUNDS}  # fmt: skip
    return report.record("expert_parallel", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())
