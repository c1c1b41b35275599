"""An MoE layer under expert parallelism on 4 ranks against the same layer in one process,
and the bytes each rank sends against the formula (issue 22's target: exact).

The layer: width 256, 8 experts (4x-wide GELU FFNs), top-2, dropless; each of the 4 ranks
routes its own 512 tokens. One training step is its forward and backward pass; each rank
times STEPS steps after a warm-up, from a barrier to the slowest rank's end. The single
process (a launch of one rank, under the same settings) runs the 2,048 tokens of all four
ranks, rank by rank, through the whole layer. The two alternate, round after round; the
ratio is the median of the rounds' pairs. Every process computes with one thread
(``LABSUPPORT_THREADS=1``): on a busy 2-core machine, two threads per process made the
single process's small matrix products 20 times slower. The 4 ranks share the cores and
every token crosses loopback; the ratio is reported, with no target. The floor of the
step: the one process's work spread without loss over the cores the 4 ranks can use
(:func:`bench.floors.shared_cores_floor_seconds`; on a machine others load, the ranks,
being more processes, get a larger share of its cores and can pass it). The bytes are
counted by ``comm.traced`` in one step and held against their floor,
``estimate.moe.all_to_all_bytes`` of the step's routing plus the count exchange.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch
import torch.distributed as dist

from bench import floors, report

WIDTH, EXPERTS, TOP_K, TOKENS, WORLD = 256, 8, 2, 512, 4
STEPS, ROUNDS = 5, 5


def tokens(rank: int) -> torch.Tensor:
    """Rank ``rank``'s tokens; they need a gradient, as a layer's input in a model does
    (else autograd skips the dispatch's twin in the backward pass)."""
    x = torch.randn(TOKENS, WIDTH, generator=torch.Generator().manual_seed(rank))
    return x.requires_grad_(True)


def layer():
    from labsupport.models import MoE, MoEConfig

    torch.manual_seed(0)
    return MoE(WIDTH, MoEConfig(EXPERTS, TOP_K))


def step(model, batches) -> None:
    for x in batches:
        model(x).square().mean().backward()


def timed(kind: str) -> dict | None:
    """Seconds per step (rank 0), and for expert parallelism the bytes each rank sent in
    one step and what the formula gives for that step's routing."""
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
    out = {}
    if kind == "ep":
        sent = torch.bincount(model.routing.experts.flatten(), minlength=EXPERTS)
        rows_to = [None] * WORLD
        dist.all_gather_object(rows_to, sent.view(WORLD, -1).sum(1).tolist())
        counts = (WORLD - 1) * EXPERTS // WORLD * 8
        out = {
            "bytes": xp.all_to_all_bytes(trace),
            "formula": all_to_all_bytes(rows_to, WIDTH)[rank] + counts,
        }
    dist.barrier()
    start = time.perf_counter()
    for _ in range(STEPS):
        step(model, batches)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return out | {"step": elapsed.item() / STEPS, "threads": torch.get_num_threads()}


def summarise(ep: list, single: list, bytes_rows: list, cores: int) -> list[dict]:
    """The bench's lines from the rounds' results and one round's bytes per rank."""
    ep_s, single_s = [r["step"] for r in ep], [r["step"] for r in single]
    floor = [
        floors.shared_cores_floor_seconds(s["step"], s["threads"], WORLD, e["threads"], cores)
        for e, s in zip(ep, single, strict=True)
    ]
    return [
        report.line("one process, every expert", statistics.median(single_s), "s"),
        report.line(
            f"EP {WORLD}, {EXPERTS // WORLD} experts per rank",
            statistics.median(ep_s),
            "s",
            of_floor=report.paired(ep_s, floor),
            floor=f"the one process's time, its threads spread over the {cores} cores "
            f"{WORLD} ranks of {ep[0]['threads']} thread(s) can use; median "
            f"{statistics.median(floor) * 1e3:.1f} ms",
            vs=("one process", report.paired(ep_s, single_s)),
        ),
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
    from labsupport.measure.probe import usable_cores

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
        f"{WORLD} x {TOKENS} tokens, forward and backward, {ROUNDS} rounds in turns"
    )
    lines = summarise(rounds["ep"], rounds["single"], bytes_rows, usable_cores())
    report.print_lines(lines, "x one process")
    print(f"(time reported, no target: {WORLD} ranks share this machine's cores)")
    print(f"{'rank':>4s} {'bytes sent':>12s} {'formula':>12s}")
    for rank, r in enumerate(bytes_rows):
        print(f"{rank:4d} {r['bytes']:12,d} {r['formula']:12,d}")
    exact = all(r["bytes"] == r["formula"] for r in bytes_rows)
    targets = [report.target("bytes per rank exactly the formula", f"{exact}", exact)]
    config = {"width": WIDTH, "experts": EXPERTS, "top_k": TOP_K, "tokens": TOKENS,
              "world": WORLD, "steps": STEPS, "rounds": ROUNDS}  # fmt: skip
    return report.record("expert_parallel", config, lines, targets)


if __name__ == "__main__":
    sys.exit(main())
