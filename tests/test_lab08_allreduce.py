"""Lab 8, all-reduce algorithms: the emulated network and the side-by-side timing on real
ranks, and the exercises' checkers, which accept the notebook's worked solutions and reject
the common mistakes. (The algorithms, their bytes and costs are tested in
tests/test_comm.py.)"""

from __future__ import annotations

import math

import pytest
from notebook_solutions import solution
from test_lab07_collectives import checks

from labsupport import LaunchError, launch
from labsupport.comm import allreduce, p2p
from labsupport.comm.allreduce import ALGORITHMS
from labsupport.comm.cost import all_reduce_time
from labsupport.labs import lab08_allreduce

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
    checks(capsys, lab08_allreduce.check_ring_bytes, LAB, "ring_bytes", verified, mistakes)


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
    checks(capsys, lab08_allreduce.check_ring_time, LAB, "ring_time", verified, mistakes)


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
