"""Lab 8, all-reduce algorithms: the side-by-side timing on real ranks, and the exercises'
checkers, which accept the notebook's worked solutions and reject the common mistakes.
(The algorithms, their bytes and costs are tested in tests/test_comm.py.)"""

from __future__ import annotations

import math

import pytest
from notebook_solutions import solution
from test_lab07_collectives import checks

from labsupport import launch
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
