"""Lab 8, all-reduce algorithms: the emulated network and the side-by-side timing on real
ranks, and the exercises' checkers, which accept the notebook's worked solutions and reject
the common mistakes, one of which deadlocks the ranks and must come back as a timeout.
(The algorithms, their bytes and costs are tested in tests/test_comm.py.)"""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from notebook_solutions import solution
from test_lab07_collectives import checks

from labsupport import LaunchError, launch
from labsupport.comm import allreduce, p2p
from labsupport.comm.allreduce import ALGORITHMS
from labsupport.comm.cost import all_reduce_time
from labsupport.comm.p2p import Group, exchange
from labsupport.labs import lab08_allreduce
from labsupport.labs import lab08_exercises as exercises

LAB = "08-allreduce.ipynb"


def test_all_reduces_side_by_side_times_every_case_on_rank_zero_only():
    cases = {
        "ring, 3 ranks": ("ring", 64, None),
        "naive, 2 ranks": ("naive", 64, 2),
        "torch, 2 ranks": ("torch", 64, 2),
    }
    first, *others = launch(
        lab08_allreduce.all_reduces_side_by_side, 3, args=(cases,), kwargs={"rounds": 3}
    )
    assert others == [None, None]
    assert set(first) == {*cases, "ratio"} and set(first["ratio"]) == set(cases)
    assert all(first[label] > 0 for label in cases)
    assert first["ratio"]["ring, 3 ranks"] == 1.0  # the first case over itself


def test_emulated_network_replaces_the_exchange_inside_the_block_only():
    real = p2p.exchange_many
    emulated = lab08_allreduce.emulated_network(1e-3, 1e-9)
    with pytest.raises(RuntimeError, match="inside"), emulated as port:
        assert p2p.exchange_many is not real and allreduce.exchange_many is not real
        assert (port.steps, port.nbytes) == (0, 0)
        raise RuntimeError("inside")
    assert p2p.exchange_many is real and allreduce.exchange_many is real


@pytest.mark.parametrize("world", [3, 4])
def test_the_emulated_network_charges_rank_0_the_alpha_beta_formula(world):
    """Rank 0's steps and bytes make chapter 8's formula exactly, for every algorithm."""
    alpha, beta, nbytes = 1e-3, 1e-6, 4 * world * 16
    algorithms = [a for a in ALGORITHMS if a != "halving_doubling" or world == 4]
    charged = launch(lab08_allreduce.charged, world, args=(nbytes, alpha, beta, algorithms))
    assert charged[1:] == [None] * (world - 1)
    for algorithm, c in charged[0].items():
        assert math.isclose(
            c["seconds"], all_reduce_time(algorithm, world, nbytes, alpha, beta), rel_tol=1e-12
        ), algorithm
    steps = {a: c["steps"] for a, c in charged[0].items()}
    log_n = math.ceil(math.log2(world))
    assert steps["ring"] == steps["naive"] == steps["ps"] == 2 * (world - 1)
    assert steps["tree"] == 2 * log_n


def test_emulated_times_are_never_below_the_model():
    """Each rank sleeps until its messages would have arrived: a busy machine can only add."""
    alpha, beta, sizes = 1e-3, 1e-7, [64, 4096]
    times = launch(lab08_allreduce.emulated_times, 2, args=(sizes, alpha, beta, 2))[0]
    assert set(times) == set(sizes)
    for nbytes in sizes:
        assert times[nbytes]["ratio"]["ring"] == 1.0  # each size's ratios are over the ring's
        for algorithm in ALGORITHMS:
            assert times[nbytes][algorithm] >= all_reduce_time(algorithm, 2, nbytes, alpha, beta)


def test_torch_cannot_be_timed_on_the_emulated_network():
    cases = {"torch": ("torch", 64, None)}
    with pytest.raises(LaunchError, match="does not go through the emulated network"):
        launch(
            lab08_allreduce.all_reduces_side_by_side, 2, args=(cases,), kwargs={"network": (1, 1)}
        )


# --------------------------------------------------------------------------- exercises


def ring(tensor, all_gather=True, scale=1, gather_offset=0):
    """The worked solution's ring, with a switch for each mistake below."""
    g = Group()
    n, right, left = g.size, (g.me + 1) % g.size, (g.me - 1) % g.size
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        target = chunks[(g.me - 2 - step) % n]
        incoming = torch.empty_like(target)
        exchange(g, send=chunks[(g.me - 1 - step) % n], dst=right, recv=incoming, src=left)
        target += incoming
    for step in range(n - 1 if all_gather else 0):
        send = chunks[(g.me - step + gather_offset) % n]
        exchange(g, send=send, dst=right, recv=chunks[(g.me - 1 - step) % n], src=left)
    tensor /= scale


def averages(tensor):
    """The mean, as DDP wants its gradients, rather than the sum asked for."""
    ring(tensor, scale=dist.get_world_size())


def skips_the_all_gather(tensor):
    """Stops after the reduce-scatter: each rank has only its own chunk summed."""
    ring(tensor, all_gather=False)


def passes_on_the_wrong_chunk(tensor):
    """All-gather: sends the chunk it is about to receive, not the one it just got; with
    uneven chunks, a message lands in a buffer too small for it, and gloo aborts."""
    ring(tensor, gather_offset=-1)


def overwrites(tensor):
    """Reduce-scatter: receives into the chunk instead of adding to it."""
    g = Group()
    n, right, left = g.size, (g.me + 1) % g.size, (g.me - 1) % g.size
    chunks = tensor.view(-1).tensor_split(n)
    for step in range(n - 1):
        send, target = chunks[(g.me - 1 - step) % n], chunks[(g.me - 2 - step) % n]
        exchange(g, send=send, dst=right, recv=target, src=left)
    for step in range(n - 1):
        send, target = chunks[(g.me - step) % n], chunks[(g.me - 1 - step) % n]
        exchange(g, send=send, dst=right, recv=target, src=left)


def whole_tensor_each_step(tensor):
    """Passes every rank's whole tensor around the ring and adds: the right sums, but each
    rank sends (N - 1) S bytes rather than 2(N - 1)/N S."""
    g = Group()
    passing, total = tensor.clone(), tensor.clone()
    for _ in range(g.size - 1):
        incoming = torch.empty_like(passing)
        exchange(g, send=passing, dst=(g.me + 1) % g.size, recv=incoming, src=(g.me - 1) % g.size)
        total += incoming
        passing = incoming
    tensor.copy_(total)


def torch_all_reduce(tensor):
    """Right, but torch's own collective: nothing goes through labsupport.comm.p2p."""
    dist.all_reduce(tensor)


def sends_before_receiving(tensor):
    """Blocking sends first: every rank waits for its right neighbour to receive, and the
    neighbour is sending too. The ranks deadlock."""
    rank, world = dist.get_rank(), dist.get_world_size()
    chunks = tensor.view(-1).tensor_split(world)
    for step in range(world - 1):
        dist.send(chunks[(rank - 1 - step) % world], (rank + 1) % world)
        incoming = torch.empty_like(chunks[(rank - 2 - step) % world])
        dist.recv(incoming, (rank - 1) % world)
        chunks[(rank - 2 - step) % world].add_(incoming)


def test_check_ring_all_reduce(capsys):
    mistakes = [
        (
            averages,
            r"rank 0: the tensor \(7 values, 3 ranks\) differs at \[0\] .*: expected "
            r"111, got 37 \(that is the mean",
        ),
        (
            skips_the_all_gather,
            r"rank 0: .* differs at \[3\] .*: expected 444, got 404 \(only elements 0 to 2 hold",
        ),
        (
            passes_on_the_wrong_chunk,
            r"on 3 ranks, rank \d crashed \(killed by signal SIGABRT\).*chunk indices",
        ),
        (
            whole_tensor_each_step,
            r"rank 0 sent 56 bytes, .* 32 to 48 bytes .*"
            r"\(labsupport.comm's ring: 36\): as if each step sent the whole tensor",
        ),
        (torch_all_reduce, r"rank 0 sent 0 bytes, .*nothing went through labsupport.comm.p2p"),
    ]
    verified = "your ring gives dist.all_reduce's sums"
    check = exercises.check_ring_all_reduce
    checks(capsys, check, LAB, "ring_all_reduce", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s") as info:
        check(sends_before_receiving, timeout=10)
    assert "post each step's send and receive together" in str(info.value)


def test_check_ring_bytes(capsys):
    mistakes = [
        # forgets that a step sends one chunk
        (lambda s, n: 2 * (n - 1) * s, "world_size=2: got 16 bytes per rank, as if every"),
        (lambda s, n: (n - 1) * s // n, "one phase of the ring"),
        # the many-rank limit, not the count
        (lambda s, n: 2 * s, "world_size=2: got 16 bytes per rank, as if every"),
        # one step too many, or a chunk too small
        (lambda s, n: (2 * n - 1) * s // n, "world_size=2: got 12 bytes per rank, more than"),
        (lambda s, n: 2 * (n - 1) * s // (n + 1), "fewer than a ring all-reduce sends"),
        (lambda s, n: None, "should return a number of bytes"),
    ]
    verified = "the bytes each rank sends"
    checks(capsys, exercises.check_ring_bytes, LAB, "ring_bytes", verified, mistakes)


def test_check_ring_time(capsys):
    mistakes = [
        # one phase only
        (lambda s, n, a, b: (n - 1) * (a + s / n * b), "less than the ring takes; the latency"),
        # the whole tensor per phase
        (lambda s, n, a, b: 2 * (n - 1) * a + 2 * s * b, "more than the ring takes; the bandwidth"),
        # two steps too many
        (lambda s, n, a, b: 2 * n * (a + s / n * b), "world_size=2: .* latency part .beta = 0. is"),
        # the larger part instead of the sum
        (
            lambda s, n, a, b: max(2 * (n - 1) * a, 2 * (n - 1) / n * s * b),
            "latency part plus the bandwidth part",
        ),
    ]
    verified = "the alpha-beta time of a ring"
    checks(capsys, exercises.check_ring_time, LAB, "ring_time", verified, mistakes)


@pytest.mark.parametrize("world", [4, 8, 1024])
def test_ring_beats_tree_above_the_size_where_their_times_meet(world):
    alpha, beta = 5e-5, 1 / 4e9
    size = solution(LAB, "ring_beats_tree_above")(world, alpha, beta)
    ring, tree = (float(all_reduce_time(a, world, size, alpha, beta)) for a in ("ring", "tree"))
    assert math.isclose(ring, tree, rel_tol=1e-12)
    assert all_reduce_time("ring", world, 2 * size, alpha, beta) < all_reduce_time(
        "tree", world, 2 * size, alpha, beta
    )
    assert solution(LAB, "ring_beats_tree_above")(4, 1.0, 1.0) == pytest.approx(0.8)
