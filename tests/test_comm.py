"""labsupport.comm: point-to-point exchange, the collectives and the all-reduce algorithms
on real ranks against torch.distributed, the bytes they send, the alpha-beta cost
models against numbers worked out by hand, and the measurements (ping-pong, all-reduce
times) with a fake clock where the timing itself is what is checked.

Each distributed test launches once and runs every case on every rank; a rank returns
the list of cases where ours and torch's disagree, so one launch checks dozens of calls.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.distributed as dist
from fake_clock import FakeClock
from torch.distributed import ReduceOp

from labsupport import LaunchError, comm, launch
from labsupport.comm import collectives as C
from labsupport.comm import cost, flat, measure, traced
from labsupport.comm.allreduce import ALGORITHMS, bytes_sent
from labsupport.comm.p2p import Group, exchange, exchange_many
from labsupport.estimate import datasheets

OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
DTYPES = (torch.float32, torch.float64, torch.int64)
WORLD_SIZES = (1, 2, 3, 4, 5)

# --------------------------------------------------------------------------- point to point


def ring_and_subgroups():
    """On 4 ranks: a 2-rank ring in the subgroup {1, 3} (its right and left neighbour are
    the same rank), then each member of {0, 2, 3} sends a different message to each
    other member at once; an outer counter around both sees every byte."""
    rank = dist.get_rank()
    pair, trio = dist.new_group([1, 3]), dist.new_group([0, 2, 3])
    out = {"pair": None, "trio": None}
    with comm.count_traffic() as outer:
        if rank in (1, 3):
            g = Group(pair)
            incoming = torch.empty(4)
            with comm.count_traffic() as traffic:
                right, left = (g.me + 1) % g.size, (g.me - 1) % g.size
                exchange(g, send=torch.full((4,), float(rank)), dst=right, recv=incoming, src=left)
            out["pair"] = (incoming.tolist(), traffic.messages)
        if rank in (0, 2, 3):
            g = Group(trio)
            others = [j for j in range(g.size) if j != g.me]
            received = {i: torch.empty(g.me + 1) for i in others}
            with comm.count_traffic() as traffic:
                exchange_many(
                    g,  # to group rank j: j + 1 values of 10 x (global rank) + j
                    sends=[(torch.full((j + 1,), 10.0 * rank + j), j) for j in others],
                    recvs=[(received[i], i) for i in others],
                )
            out["trio"] = ({i: t.tolist() for i, t in received.items()}, traffic.messages)
    out["outer"] = outer.bytes_sent
    return out


def test_exchange_on_a_two_rank_ring_and_on_subgroups_counts_every_byte():
    results = launch(ring_and_subgroups, 4, timeout=120)
    # the pair: group ranks 0 and 1 are global ranks 1 and 3; 4 float32 values each way
    assert results[1]["pair"] == ([3.0] * 4, [(1, 16)])
    assert results[3]["pair"] == ([1.0] * 4, [(0, 16)])
    assert results[0]["pair"] is None and results[2]["pair"] is None
    # the trio: group ranks 0, 1, 2 are global ranks 0, 2, 3; messages name group ranks
    assert results[0]["trio"] == ({1: [20.0], 2: [30.0]}, [(1, 8), (2, 12)])
    assert results[2]["trio"] == ({0: [1.0, 1.0], 2: [31.0, 31.0]}, [(0, 4), (2, 12)])
    assert results[3]["trio"] == ({0: [2.0] * 3, 1: [22.0] * 3}, [(0, 4), (1, 8)])
    assert results[1]["trio"] is None
    # counters nest: the outer one saw both exchanges of rank 3
    assert [r["outer"] for r in results] == [20, 16, 16, 16 + 12]


# --------------------------------------------------------------------------- collectives


def sample(rank: int, shape, dtype, salt: int = 0, transpose: bool = False) -> torch.Tensor:
    """Small integer values (exact in every dtype and op), optionally non-contiguous."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    t = torch.randint(1, 4, shape, generator=g).to(dtype)
    if transpose and t.dim() == 2:
        t = t.t()  # a non-contiguous view
        assert not t.is_contiguous()
    return t


CASES = [((7,), False), ((10,), False), ((3, 4), True), ((1,), False)]


def compare_all():
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []

    def check(name, ours, theirs):
        if not torch.equal(ours, theirs):
            bad.append(f"rank {rank}: {name}: {ours.tolist()} != {theirs.tolist()}")

    for dtype in DTYPES:
        for case, (shape, transpose) in enumerate(CASES):
            label = f"{dtype} {shape}{' transposed' if transpose else ''}"
            for src in {0, world - 1}:
                ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                C.broadcast(ours, src=src)
                dist.broadcast(theirs, src=src)
                check(f"broadcast src={src} {label}", ours, theirs)
            for op in OPS:
                for algorithm in ALGORITHMS:
                    if algorithm == "halving_doubling" and world & (world - 1):
                        continue
                    ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                    comm.all_reduce(ours, op=op, algorithm=algorithm)
                    dist.all_reduce(theirs, op=op)
                    check(f"all_reduce {algorithm} {op} {label}", ours, theirs)
                dst = world // 2
                ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                C.reduce(ours, dst=dst, op=op)
                dist.reduce(theirs, dst=dst, op=op)
                if rank == dst:
                    check(f"reduce dst={dst} {op} {label}", ours, theirs)
                inputs = [sample(rank, shape, dtype, case + 10 * i) for i in range(world)]
                ours, theirs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
                C.reduce_scatter(ours, inputs, op=op)
                dist.reduce_scatter(theirs, [t.clone() for t in inputs], op=op)
                check(f"reduce_scatter {op} {label}", ours, theirs)
            mine = sample(rank, shape, dtype, case, transpose)
            ours = [torch.zeros_like(mine) for _ in range(world)]
            theirs = [torch.zeros_like(mine) for _ in range(world)]
            C.all_gather(ours, mine)
            dist.all_gather(theirs, mine.contiguous())
            check(f"all_gather {label}", torch.stack(ours), torch.stack(theirs))
            root = world - 1
            pieces = [sample(rank, shape, dtype, case + 10 * i) for i in range(world)]
            ours, theirs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            C.scatter(ours, pieces if rank == root else None, src=root)
            dist.scatter(theirs, pieces if rank == root else None, src=root)
            check(f"scatter {label}", ours, theirs)
            ours = [torch.zeros_like(mine) for _ in range(world)] if rank == 0 else None
            theirs = [torch.zeros_like(mine) for _ in range(world)] if rank == 0 else None
            C.gather(mine, ours, dst=0)
            dist.gather(mine.contiguous(), theirs, dst=0)
            if rank == 0:
                check(f"gather {label}", torch.stack(ours), torch.stack(theirs))
            ours = [torch.zeros(shape, dtype=dtype) for _ in range(world)]
            theirs = [torch.zeros(shape, dtype=dtype) for _ in range(world)]
            C.all_to_all(ours, pieces)
            dist.all_to_all(theirs, [p.clone() for p in pieces])
            check(f"all_to_all {label}", torch.stack(ours), torch.stack(theirs))
    return bad


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_collective_matches_torch_distributed(world_size):
    results = launch(compare_all, world_size, timeout=240)
    mismatches = [line for rank_bad in results for line in rank_bad]
    assert mismatches == [], "\n".join(mismatches[:20])


def float_all_reduce(algorithm):
    g = torch.Generator().manual_seed(dist.get_rank())
    ours = torch.randn(1000, generator=g)
    theirs = ours.clone()
    comm.all_reduce(ours, algorithm=algorithm)
    dist.all_reduce(theirs)
    return torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", ALGORITHMS)
def test_float_all_reduce_agrees_up_to_rounding(algorithm):
    assert launch(float_all_reduce, 4, args=(algorithm,), timeout=120) == [True] * 4


def on_a_subgroup():
    members = [1, 2, 3]
    group = dist.new_group(members)
    rank = dist.get_rank()
    if rank not in members:
        return None
    ours = torch.tensor([float(rank), 10.0 * rank])
    theirs = ours.clone()
    comm.all_reduce(ours, group=group)
    dist.all_reduce(theirs, group=group)
    bcast_ours = torch.tensor([float(rank)])
    bcast_theirs = bcast_ours.clone()
    C.broadcast(bcast_ours, src=3, group=group)  # src is a global rank, as in torch
    dist.broadcast(bcast_theirs, src=3, group=group)
    gathered = [torch.zeros(1) for _ in members]
    C.all_gather(gathered, torch.tensor([float(rank)]), group=group)
    return (
        torch.equal(ours, theirs),
        torch.equal(bcast_ours, bcast_theirs),
        [t.item() for t in gathered],
    )


def test_collectives_work_on_a_subgroup_with_global_src():
    results = launch(on_a_subgroup, 4, timeout=120)
    assert results[0] is None
    assert results[1:] == [(True, True, [1.0, 2.0, 3.0])] * 3


def bad_calls():
    errors = []
    for call in (
        lambda: comm.all_reduce(torch.ones(3), algorithm="carrier-pigeon"),
        lambda: comm.all_reduce(torch.ones(3), op="sum"),
        lambda: comm.all_reduce(torch.ones(3), algorithm="halving_doubling"),
        lambda: C.all_gather([torch.ones(1)], torch.ones(1)),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_arguments_are_clear_errors():
    errors = launch(bad_calls, 3, timeout=60)[0]
    assert "algorithm must be one of ring" in errors[0]
    assert "op must be ReduceOp.SUM" in errors[1]
    assert "power-of-two number of ranks, got 3" in errors[2]
    assert "tensor_list of 3 tensors" in errors[3]


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_ring_sends_each_chunk_on_from_the_rank_that_completes_it(world):
    """ring_chunk: in reduce-scatter chunk j starts at rank j + 1 and, after N - 1 steps,
    arrives complete at rank j; in all-gather rank r first sends its own chunk r."""
    for step in range(world - 1):
        sent = [C.ring_chunk("reduce-scatter", r, step, world) for r in range(world)]
        assert sorted(sent) == list(range(world)), "each chunk moves once per step"
    last = world - 2  # the last reduce-scatter step: rank j - 1 hands chunk j to rank j
    assert [C.ring_chunk("reduce-scatter", (j - 1) % world, last, world) for j in range(world)] == (
        list(range(world))
    )
    assert [C.ring_chunk("all-gather", r, 0, world) for r in range(world)] == list(range(world))


# --------------------------------------------------------------------------- bytes sent


def counted_bytes(algorithm, numel):
    t = torch.ones(numel)
    with comm.count_traffic() as traffic:
        comm.all_reduce(t, algorithm=algorithm)
    return traffic.bytes_sent


@pytest.mark.parametrize("algorithm", ALGORITHMS)
@pytest.mark.parametrize("numel", [1024, 1001])
def test_bytes_on_the_wire_match_the_formula_exactly(algorithm, numel):
    world = 4
    counted = launch(counted_bytes, world, args=(algorithm, numel), timeout=120)
    expected = [bytes_sent(algorithm, numel, 4, world, r) for r in range(world)]
    assert counted == expected


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_bandwidth_optimal_algorithms_send_two_n_minus_one_over_n(world):
    size = 4 * 8 * 105  # divisible by every world size here
    optimal = 2 * (world - 1) * size // world
    for algorithm in ("ring", "ps") + (("halving_doubling",) if world & (world - 1) == 0 else ()):
        for rank in range(world):
            assert bytes_sent(algorithm, size // 4, 4, world, rank) == optimal
    assert bytes_sent("naive", size // 4, 4, world, 0) == (world - 1) * size
    total_tree = sum(bytes_sent("tree", size // 4, 4, world, r) for r in range(world))
    assert total_tree == 2 * (world - 1) * size  # every edge of two trees carries S
    # the cost model's count is the same, for a size that divides
    assert float(cost.ring_all_reduce_bytes(size, world)) == optimal


def test_one_rank_sends_nothing_and_the_ring_count_is_exact_for_uneven_chunks():
    assert bytes_sent("ring", 1000, 4, 1, 0) == 0
    assert float(cost.all_reduce_time("ring", 1, 10**9, 1e-5, 1e-9)) == 0.0
    # 1001 elements on 4 ranks: chunks of 251, 250, 250, 250; rank 0 sends every chunk but
    # its own in reduce-scatter, every chunk but its right neighbour's in all-gather
    assert bytes_sent("ring", 1001, 4, 4, 0) == 4 * (750 + 751)
    assert bytes_sent("ring", 1001, 4, 4, 3) == 4 * (751 + 750)  # right neighbour: rank 0
    assert bytes_sent("ring", 1001, 4, 4, 1) == 4 * (751 + 751)
    with pytest.raises(ValueError, match="power-of-two"):
        bytes_sent("halving_doubling", 1000, 4, 3, 0)


@pytest.mark.parametrize(("n", "parts"), [(12, 4), (1001, 4), (7, 3), (2, 5), (0, 3)])
def test_even_spans_cut_as_tensor_split_does_and_spans_lie_end_to_end(n, parts):
    got = flat.even_spans(n, parts)
    assert [s.stop - s.start for s in got] == [len(t) for t in torch.arange(n).tensor_split(parts)]
    assert [s.start for s in got] == [0] + [s.stop for s in got[:-1]] and got[-1].stop == n
    assert flat.spans([3, 0, 2]) == [slice(0, 3), slice(3, 3), slice(3, 5)]
    assert flat.spans([]) == []


# --------------------------------------------------------------------------- cost models


def test_fit_alpha_beta_recovers_known_alpha_and_beta_exactly():
    alpha, beta = 25e-6, 1 / 12.5e9  # 25 µs, 12.5 GB/s
    sizes = [4**k for k in range(1, 13)]
    seconds = [alpha + beta * n for n in sizes]
    got_alpha, got_beta = cost.fit_alpha_beta(sizes, seconds)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(beta, rel=1e-9)
    # two points determine the line
    assert cost.fit_alpha_beta([0, 1000], [1e-3, 2e-3]) == pytest.approx((1e-3, 1e-6), rel=1e-9)


def test_fit_alpha_beta_weighs_relative_errors():
    """One 10x outlier among small messages must not drag alpha far (weights 1/t)."""
    alpha, beta = 50e-6, 1 / 3e9
    sizes = [4**k for k in range(1, 13)]
    seconds = [alpha + beta * n for n in sizes]
    seconds[1] *= 10
    got_alpha, got_beta = cost.fit_alpha_beta(sizes, seconds)
    assert 0.5 * alpha < got_alpha < 2 * alpha
    assert 0.5 * beta < got_beta < 2 * beta


@pytest.mark.parametrize(
    ("nbytes", "seconds", "message"),
    [
        ([4, 8], [1e-5], "equally long"),
        ([4], [1e-5], "at least 2 points"),
        ([[4, 8]], [[1e-5, 2e-5]], "equally long"),
        ([4, 8], [1e-5, 0.0], "positive"),
        ([4, 8], [1e-5, -1e-5], "positive"),
        ([-4, 8], [1e-5, 2e-5], "positive"),
        ([8, 8], [1e-5, 2e-5], "2 distinct sizes"),
    ],
)
def test_fit_alpha_beta_rejects_bad_input_clearly(nbytes, seconds, message):
    with pytest.raises(ValueError, match=message):
        cost.fit_alpha_beta(nbytes, seconds)


def test_half_bandwidth_size_is_where_effective_bandwidth_is_half_the_peak():
    alpha, beta = 5e-6, 1 / 50e9
    n = cost.half_bandwidth_size(alpha, beta)
    assert n == pytest.approx(250e3)
    assert n / float(cost.p2p_time(n, alpha, beta)) == pytest.approx(0.5 / beta)


def test_the_all_reduce_cost_models_follow_their_formulas():
    a, b, s = 1e-5, 1e-9, 1e6
    assert cost.all_reduce_time("ring", 4, s, a, b) == pytest.approx(6 * a + 1.5 * s * b)
    assert cost.all_reduce_time("ps", 4, s, a, b) == pytest.approx(6 * a + 1.5 * s * b)
    assert cost.all_reduce_time("naive", 4, s, a, b) == pytest.approx(6 * (a + s * b))
    assert cost.all_reduce_time("tree", 5, s, a, b) == pytest.approx(6 * (a + s * b))
    assert cost.all_reduce_time("halving_doubling", 8, s, a, b) == pytest.approx(
        6 * a + 1.75 * s * b
    )
    assert cost.bus_bandwidth(1e9, 1.0, 8) == pytest.approx(1.75e9)
    with pytest.raises(ValueError, match="unknown algorithm"):
        cost.all_reduce_time("carrier-pigeon", 4, s, a, b)


def test_hierarchical_all_reduce_is_a_ring_inside_plus_a_ring_per_rail():
    a, nvlink, ndr = datasheets.ASSUMED_ALPHA, datasheets.beta("NVLink 4 (H100)"), 1 / 50e9
    got = cost.hierarchical_all_reduce_time(10**9, 64, 8, a, nvlink, ndr)
    inside = 2 * 7 * a + 2 * 7 / 8 * 1e9 / 450e9
    across = 2 * 63 * a + 2 * 63 / 64 * (1e9 / 8) / 50e9
    assert float(got) == pytest.approx(inside + across, rel=1e-12)
    # one node: only the ring inside; one GPU per node: only the ring across
    assert float(cost.hierarchical_all_reduce_time(10**9, 1, 8, a, nvlink, ndr)) == (
        pytest.approx(inside)
    )
    assert float(cost.hierarchical_all_reduce_time(10**9, 16, 1, a, nvlink, ndr)) == (
        pytest.approx(float(cost.all_reduce_time("ring", 16, 10**9, a, ndr)))
    )
    flat = cost.all_reduce_time("ring", 512, 10**9, a, ndr)
    assert flat > 4 * got, "the rails should beat a flat ring through one NIC per node"


# --------------------------------------------------------------------------- measurements

SIZES = (4, 1024, 16 * 2**20)


@pytest.mark.parametrize("world_size", [2, 3])
def test_measure_p2p_returns_sizes_in_order_on_rank_zero_only(world_size):
    results = launch(
        measure.measure_p2p,
        world_size,
        kwargs={"sizes": SIZES, "rounds": 5, "warmup": 5},
        timeout=120,
    )
    first, *others = results
    assert others == [None] * (world_size - 1)
    assert [r["bytes"] for r in first] == list(SIZES)
    # Which time belongs to which size is checked exactly with a fake clock below; here
    # only that a 16 MiB message takes longer than 4 bytes (about 100x on loopback).
    # Sizes alternate within each round, so a burst of load slows both alike.
    assert first[-1]["seconds"] > first[0]["seconds"]


def test_measure_p2p_rejects_one_rank_and_odd_sizes():
    with pytest.raises(LaunchError, match="at least 2 ranks"):
        launch(measure.measure_p2p, 1, timeout=60)
    with pytest.raises(LaunchError, match="multiples of 4 bytes"):
        launch(measure.measure_p2p, 2, kwargs={"sizes": (4, 6)}, timeout=60)


def p2p_on_a_modelled_link(alpha, beta):
    """measure_p2p with real messages, on a clock that each message moves by exactly
    ``alpha + beta * n`` (a rank's clock moves when it sends and when it receives)."""
    clock = FakeClock()

    def send(tensor, dst):
        dist.send(tensor, dst=dst)
        clock.advance(alpha + beta * tensor.nbytes)

    def recv(tensor, src):
        dist.recv(tensor, src=src)
        clock.advance(alpha + beta * tensor.nbytes)

    measure.time = clock
    measure.dist = types.SimpleNamespace(
        get_rank=dist.get_rank, get_world_size=dist.get_world_size, send=send, recv=recv
    )
    return measure.measure_p2p(sizes=(4, 64, 4096, 2**20), rounds=3, warmup=1)


def test_measure_p2p_reports_half_the_round_trip_of_each_size():
    alpha, beta = 20e-6, 1 / 5e9
    results = launch(p2p_on_a_modelled_link, 2, args=(alpha, beta), timeout=60)[0]
    # the sizes are visited in a new order every round; each time stays with its size
    for r in results:
        assert r["seconds"] == pytest.approx(alpha + beta * r["bytes"], rel=1e-9), r
    fitted = cost.fit_alpha_beta([r["bytes"] for r in results], [r["seconds"] for r in results])
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


def test_time_all_reduce_reports_on_rank_zero_only():
    for algorithm in ("ring", "torch"):
        results = launch(measure.time_all_reduce, 3, args=([64, 4096], algorithm, 2), timeout=60)
        assert results[1] is None and results[2] is None
        assert [r["bytes"] for r in results[0]] == [64, 4096]


def all_reduce_on_a_fake_clock():
    """time_all_reduce where an all-reduce takes (rank + 1) x 100, 1, 3, 2 seconds in
    turn: a warm-up and three timed repetitions."""
    clock, rank = FakeClock(), dist.get_rank()
    durations = iter([100.0, 1.0, 3.0, 2.0])

    def all_reduce(tensor, algorithm):
        clock.advance((rank + 1) * next(durations))

    measure.time = clock
    measure.allreduce = types.SimpleNamespace(all_reduce=all_reduce)
    return measure.time_all_reduce([64], "ring", repeats=3)


def test_time_all_reduce_takes_the_median_of_the_slowest_rank_after_a_warm_up():
    results = launch(all_reduce_on_a_fake_clock, 3, timeout=60)
    # rank 2 is the slowest (3 x 1, 3 x 3, 3 x 2 s); the warm-up (300 s) is left out
    assert results == [[{"bytes": 64, "seconds": 6.0}], None, None]


def test_traced_bytes_per_rank_counts_rings_and_an_all_to_all_as_sent():
    trace = traced.Trace(
        [("all_reduce", 400, 4), ("all_gather", 400, 4), ("broadcast", 400, 4),
         ("all_to_all", 123, 4)],
        [(0, 1, 2, 3)] * 4,
    )  # fmt: skip
    assert traced.bytes_per_rank(trace) == 600 + 300 + 300 + 123
    assert traced.bytes_per_rank(trace.on([3, 2, 1, 0])) == 1323
    assert trace.on([0, 1]).calls == []
