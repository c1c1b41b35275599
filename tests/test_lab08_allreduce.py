"""Lab 8, all-reduce algorithms: the exercises' checkers accept the formulas and reject
the common mistakes. (The algorithms, their bytes and costs are tested in
tests/test_comm.py.)"""

from __future__ import annotations

import pytest

from labsupport.labs import lab08_allreduce


def test_check_ring_bytes(capsys):
    lab08_allreduce.check_ring_bytes(lambda s, n: 2 * (n - 1) * s // n)
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="expected"):
        lab08_allreduce.check_ring_bytes(lambda s, n: 2 * s)  # forgets the (N-1)/N
    with pytest.raises(AssertionError, match="expected"):
        lab08_allreduce.check_ring_bytes(lambda s, n: (n - 1) * s // n)  # reduce-scatter only


def test_check_ring_time(capsys):
    lab08_allreduce.check_ring_time(lambda s, n, a, b: 2 * (n - 1) * (a + s / n * b))
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="expected"):
        lab08_allreduce.check_ring_time(lambda s, n, a, b: (n - 1) * (a + s / n * b))
    with pytest.raises(AssertionError, match="expected"):
        lab08_allreduce.check_ring_time(lambda s, n, a, b: 2 * (n - 1) * a + 2 * s * b)
