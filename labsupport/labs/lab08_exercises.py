"""Lab 8's exercises: the chunked ring all-reduce, built from point-to-point messages and
checked on real ranks against ``torch.distributed.all_reduce`` and the library's ring, its
bytes counted; then the ring's bytes and its alpha-beta time as formulas.

The learner's ring only ever runs on the ranks, under a timeout: a ring that deadlocks
(every rank sending before it receives, a receive that no rank sends to) is reported as
such rather than hanging the notebook.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from labsupport.comm import allreduce
from labsupport.comm.cost import all_reduce_time
from labsupport.comm.p2p import count_traffic
from labsupport.labs.cells import exercise, expect_close, launch_answer, number
from labsupport.launch.errors import LaunchError
from labsupport.launch.runtime import device

# --------------------------------------------------------------------------- the ring

#: Ranks, and the lengths each tries: one that does not divide by the number of ranks,
#: one shorter than it (some chunks empty). Rank ``r`` starts with ``[1, 2, ...] x 10^r``,
#: lab 7's running example: every sum is exact in float32 and says which ranks it has seen.
LENGTHS = {3: (7, 2), 4: (9, 3)}


def ring_case(fn) -> list[dict]:
    """On this rank, for each of the world size's lengths: the learner's ``fn(tensor)``
    on the labelled values, with the bytes it sent through :mod:`labsupport.comm.p2p`
    counted; ``dist.all_reduce``'s result and the library's ring's, on the same input,
    with the bytes the library's ring sent."""
    rank = dist.get_rank()
    found = []
    for numel in LENGTHS[dist.get_world_size()]:
        before = torch.arange(1.0, numel + 1, device=device()) * 10.0**rank
        theirs, library, ours = before.clone(), before.clone(), before.clone()
        with count_traffic() as traffic:
            fn(ours)
        dist.all_reduce(theirs)
        with count_traffic() as ring:
            allreduce.all_reduce(library, algorithm="ring")
        found.append(
            {
                "before": before.cpu(),
                "got": ours.cpu(),
                "torch": theirs.cpu(),
                "library": library.cpu(),
                "bytes": traffic.bytes_sent,
                "library bytes": ring.bytes_sent,
            }
        )
    return found


def _values_hint(before, got, want, world: int) -> str:
    """The usual mistake behind a rank's wrong values."""
    if got.equal(before):
        return (
            "the tensor did not change: add into it in place (the chunks of "
            "tensor.view(-1).tensor_split(N) are views of it; a tensor you return is not read)"
        )
    if got.allclose(want / world):
        return "that is the mean: the exercise asks for the sum"
    right = (got == want).nonzero().flatten().tolist()
    if (
        right
        and len(right) <= -(-len(want) // world)
        and right == list(range(right[0], right[-1] + 1))
    ):
        return (
            f"only elements {right[0]} to {right[-1]} hold the sum: after the reduce-scatter "
            "each rank holds one summed chunk, and the all-gather must pass those around the "
            "ring, N - 1 more steps"
        )
    return (
        "a chunk was overwritten rather than added to, added into the wrong place, or came "
        "from the wrong neighbour: at each reduce-scatter step a rank sends one chunk to its "
        "right and adds, into its own copy of the same chunk, the one its left neighbour sent"
    )


def _bytes_hint(sent: int, numel: int, world: int) -> str:
    """What a rank's count of bytes says about its messages."""
    nbytes = 4 * numel
    if sent == 0:
        return (
            "nothing went through labsupport.comm.p2p, where the bytes are counted: build "
            "the ring from p2p.exchange (or isend and irecv), not torch.distributed's calls"
        )
    if sent == (world - 1) * nbytes or sent == 2 * (world - 1) * nbytes:
        return "as if each step sent the whole tensor: a step of the ring sends one chunk, S/N"
    side = "more" if sent > 4 * 2 * (world - 1) * math.ceil(numel / world) else "fewer"
    return f"{side} than the ring's 2(N - 1) steps of one chunk each"


@exercise
def check_ring_all_reduce(fn, timeout: float = 60) -> str:
    """Exercise 1: ``fn(tensor)``, run on every rank, sums ``tensor`` over the ranks in
    place with a ring reduce-scatter then a ring all-gather, from :mod:`labsupport.comm.p2p`
    messages; checked on 3 and 4 ranks, on lengths that do not divide by them."""
    hint = (
        "A rank that sends with a blocking call (dist.send) before it receives waits for "
        "its neighbour, who is sending too: post each step's send and receive together, "
        "with p2p.exchange. And every receive needs a rank that sends to it: right is "
        "(rank + 1) % N, left (rank - 1) % N."
    )
    for world, lengths in LENGTHS.items():
        try:
            results = launch_answer(ring_case, world, hint, timeout, args=(fn,))
        except LaunchError as exc:
            crash = exc.failures.get(exc.root_rank)
            if crash is None or crash.kind != "signal":
                raise  # an exception on a rank: its traceback says why
            raise AssertionError(
                f"on {world} ranks, rank {crash.rank} crashed ({crash.summary}); its output "
                "says why. In a ring that is usually a message larger than the buffer posted "
                'for it (gloo: "Received data size doesn\'t match expected size"): with '
                "uneven chunks, each step's receive must be the size of the chunk the left "
                "neighbour sends at that step. Check the chunk indices of both"
            ) from None
        for i, numel in enumerate(lengths):
            for rank, found in enumerate(results):
                r = found[i]
                assert r["library"].equal(r["torch"]), "labsupport's ring disagrees with torch"
                what = f"the tensor ({numel} values, {world} ranks)"
                tips = _values_hint(r["before"], r["got"], r["torch"], world)
                expect_close(r["got"], r["torch"], what, rank, tips, rtol=0, atol=0)
            for rank, found in enumerate(results):
                sent, library = found[i]["bytes"], found[i]["library bytes"]
                low, high = (8 * (world - 1) * f(numel / world) for f in (math.floor, math.ceil))
                if low <= sent <= high:
                    continue
                raise AssertionError(
                    f"the sums are right, but with {numel} float32 values ({4 * numel} bytes) "
                    f"on {world} ranks rank {rank} sent {sent} bytes, where a ring all-reduce "
                    f"sends 2(N - 1)/N of them, {low} to {high} bytes with uneven chunks "
                    f"(labsupport.comm's ring: {library}): {_bytes_hint(sent, numel, world)}"
                )
    return (
        "your ring gives dist.all_reduce's sums, as labsupport.comm's ring does, on 3 and 4 "
        "ranks with 7, 2, 9 and 3 values, and each rank sends 2(N - 1)/N of the tensor's bytes"
    )


# --------------------------------------------------------------------------- formulas


@exercise
def check_ring_bytes(fn) -> str:
    """Exercise 2: ``fn(nbytes, world_size)`` must give the bytes each rank sends in a
    ring all-reduce of ``nbytes``, for sizes that divide by the world size."""
    for world in (2, 3, 4, 8, 64):
        for nbytes in (world * 4, world * 4096, world * 10**6):
            got = number(fn(nbytes, world), "a number of bytes")
            want = 2 * (world - 1) * nbytes // world
            if got == want:
                continue
            where = f"nbytes={nbytes:,}, world_size={world}: got {got:,.15g} bytes per rank, "
            if got == want // 2:
                hint = "which is one phase of the ring: it has two"
            elif got == want * world:
                hint = "as if every step sent the whole tensor: a step of the ring sends one chunk"
            else:
                side = "more" if got > want else "fewer"
                hint = f"{side} than a ring all-reduce sends: count its steps and the bytes of one"
            raise AssertionError(where + hint)
    return "the bytes each rank sends in a ring all-reduce, on 2 to 64 ranks, 3 sizes each"


@exercise
def check_ring_time(fn) -> str:
    """Exercise 3: ``fn(nbytes, world_size, alpha, beta)`` must give the alpha-beta time
    of a ring all-reduce."""
    alpha, beta = 1e-5, 1e-10
    for world in (2, 8, 1024):
        for nbytes in (4, 2**20, 2**30):
            got = number(fn(nbytes, world, alpha, beta), "a time in seconds")
            want = float(all_reduce_time("ring", world, nbytes, alpha, beta))
            if _close(got, want):
                continue
            where = f"nbytes={nbytes:,}, world_size={world}: got {got:.6g} s, "
            side = "more" if got > want else "less"
            # A time linear in alpha and beta splits into its latency part (beta = 0)
            # and its bandwidth part (alpha = 0): say which one is off.
            latency = number(fn(nbytes, world, alpha, 0.0), "a time in seconds")
            if not _close(latency, float(all_reduce_time("ring", world, nbytes, alpha, 0.0))):
                hint = "the latency part (beta = 0) is off: how many messages, one after another?"
            elif not _close(
                number(fn(nbytes, world, 0.0, beta), "a time in seconds"),
                float(all_reduce_time("ring", world, nbytes, 0.0, beta)),
            ):
                hint = "the bandwidth part (alpha = 0) is off: how many bytes does a rank send?"
            else:
                hint = "the time should be the latency part plus the bandwidth part"
            raise AssertionError(f"{where}{side} than the ring takes; {hint}")
    return "the alpha-beta time of a ring all-reduce, on 2 to 1,024 ranks, from 4 B to 1 GiB"


def _close(got: float, want: float) -> bool:
    """Equal up to the rounding of a formula evaluated in another order.

    The same formula computed in another order differs by a few float64 roundings
    (unit roundoff 2^-53 = 1.1e-16 each, about ten operations): a relative 1e-12 leaves
    a margin of 1000 over that, and is far below the smallest slip in the formula (one
    step more or less on 1,024 ranks changes the time by 1/2046, 5e-4).
    """
    return math.isclose(got, want, rel_tol=1e-12, abs_tol=0.0)
