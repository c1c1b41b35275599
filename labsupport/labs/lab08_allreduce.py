"""Lab 8, all-reduce algorithms: the exercises' checkers.

The algorithms are in :mod:`labsupport.comm.allreduce` (with :func:`bytes_sent`, the
exact count), their alpha-beta costs in :mod:`labsupport.comm.cost`, the timing in
:mod:`labsupport.comm.measure`, the ring's drawing in :mod:`labsupport.viz.collectives`.
"""

from __future__ import annotations

from labsupport.comm.cost import all_reduce_time


def check_ring_bytes(fn) -> None:
    """Exercise (lab 8): ``fn(nbytes, world_size)`` must give the bytes each rank sends
    in a ring all-reduce of ``nbytes``, for sizes that divide by the world size."""
    for world in (2, 3, 4, 8, 64):
        for nbytes in (world * 4, world * 4096, world * 10**6):
            got, want = fn(nbytes, world), 2 * (world - 1) * nbytes // world
            assert got == want, f"nbytes={nbytes}, world_size={world}: got {got}, expected {want}"
    print("Correct: 2 (N-1)/N x S, whatever the number of ranks.")


def check_ring_time(fn) -> None:
    """Exercise (lab 8): ``fn(nbytes, world_size, alpha, beta)`` must give the alpha-beta
    time of a ring all-reduce."""
    for world in (2, 8, 1024):
        for nbytes in (4, 2**20, 2**30):
            got = fn(nbytes, world, 1e-5, 1e-10)
            want = float(all_reduce_time("ring", world, nbytes, 1e-5, 1e-10))
            assert abs(got - want) <= 1e-9 * want, (
                f"nbytes={nbytes}, world_size={world}: got {got:.6g} s, expected {want:.6g} s"
            )
    print("Correct: 2 (N-1) alpha + 2 (N-1)/N S beta.")
