"""Lab 8, all-reduce algorithms: an emulated network and timing side by side (the
exercises' checkers are in :mod:`labsupport.labs.lab08_exercises`).

The algorithms are in :mod:`labsupport.comm.allreduce` (with :func:`bytes_sent`, the
exact count), their alpha-beta costs in :mod:`labsupport.comm.cost`, the timing in
:mod:`labsupport.comm.measure`, the ring's drawing in :mod:`labsupport.viz.collectives`.

On a laptop, the ranks' "network" is the loopback of one machine whose few cores also
run the ranks: a message costs CPU time that the other ranks need too, so the measured
times depend on how the ranks share the cores, not on the alpha-beta model's busiest
port. :func:`emulated_network` gives every message the cost the model says, so that
the algorithms' real messages, in their real order, take the time they would take on a
network with that alpha and beta.
"""

from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from labsupport.comm import allreduce, p2p
from labsupport.comm.allreduce import ALGORITHMS, all_reduce
from labsupport.launch.runtime import device
from labsupport.measure.timing import side_by_side


@dataclass(eq=False)
class Port:
    """What the emulated network charged this rank: ``steps`` messages, one after
    another, of ``nbytes`` bytes in all (the busier direction of each exchange)."""

    steps: int = 0
    nbytes: int = 0


@contextlib.contextmanager
def emulated_network(alpha: float, beta: float):
    """Inside the block, every exchange of :mod:`labsupport.comm` takes at least the time
    the alpha-beta model gives it; yields this rank's :class:`Port`.

    The model's rank has one port: its messages out leave one after another, its
    messages in arrive one after another, both directions at once, and a message of
    ``n`` bytes takes ``alpha + beta * n``. So an exchange of a few sends and receives
    takes the longer of its two directions, each the sum of its messages' costs. The
    rank sleeps until then, counted from the moment it posted the exchange, or, for a
    receive with nothing to send, from the moment the message arrived (a rank waiting
    for a message is not receiving it yet). The real transfer happens in that time, so
    this machine's own costs only show where they exceed the model's.

    Every algorithm of :mod:`labsupport.comm` sends through
    :func:`labsupport.comm.p2p.exchange_many` (:func:`~labsupport.comm.p2p.exchange`
    calls it too), which the block replaces, here and where it was imported by name.
    """
    real = p2p.exchange_many
    port = Port()

    def direction(messages):
        count, nbytes = len(messages), sum(t.numel() * t.element_size() for t, _ in messages)
        return alpha * count + beta * nbytes, count, nbytes

    def exchange_many(g, sends=(), recvs=()):
        start = time.perf_counter()
        real(g, sends, recvs)
        if not sends:
            start = time.perf_counter()  # the message has just arrived
        seconds, count, nbytes = max(direction(sends), direction(recvs))
        port.steps += count
        port.nbytes += nbytes
        time.sleep(max(0.0, start + seconds - time.perf_counter()))

    modules = (p2p, allreduce)  # allreduce imported exchange_many by name
    for module in modules:
        module.exchange_many = exchange_many
    try:
        yield port
    finally:
        for module in modules:
            module.exchange_many = real


def charged(nbytes: int, alpha: float, beta: float, algorithms=ALGORITHMS) -> dict | None:
    """Run each all-reduce of ``nbytes`` once on the emulated network (on every rank).

    Returns, on rank 0, what the network charged rank 0 for each algorithm: ``steps``,
    ``bytes`` and the time they make, ``seconds = alpha * steps + beta * bytes``;
    ``None`` on the other ranks.
    """
    result = {}
    for algorithm in algorithms:
        with emulated_network(alpha, beta) as port:
            all_reduce(torch.zeros(nbytes // 4, device=device()), algorithm=algorithm)
        seconds = alpha * port.steps + beta * port.nbytes
        result[algorithm] = {"steps": port.steps, "bytes": port.nbytes, "seconds": seconds}
    return result if dist.get_rank() == 0 else None


def all_reduces_side_by_side(cases: dict, rounds: int = 7, network=None) -> dict | None:
    """Time several all-reduces in turns, round by round (run on every rank).

    ``cases`` maps a label to ``(algorithm, nbytes, ranks)``: ``algorithm`` is one of
    :data:`~labsupport.comm.allreduce.ALGORITHMS` or ``"torch"``, and the all-reduce of
    ``nbytes`` runs on the first ``ranks`` ranks (a process group of its own; ``None``:
    every rank). :func:`~labsupport.measure.timing.side_by_side` takes one sample of
    each case per round, so a burst of load lands on all of them alike, and one call per
    sample, so that every rank makes the same calls in the same order. Only rank 0 is
    timed; over loopback each sample ends with a barrier, so that it counts until every
    rank has finished and the next case cannot start while others still run this one.
    With ``network`` ``= (alpha, beta)``, the messages go through
    :func:`emulated_network` (``"torch"``, whose messages do not go through
    :mod:`labsupport.comm`, cannot be timed there).
    Returns rank 0's result (median seconds per label, and under ``"ratio"`` each
    label's median ratio to the first label's time in the same round); ``None`` on the
    other ranks.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    if network is not None and any(case[0] == "torch" for case in cases.values()):
        raise ValueError("torch's all-reduce does not go through the emulated network")
    groups = {}
    for _, _, ranks in cases.values():
        if ranks is not None and ranks < world and ranks not in groups:
            groups[ranks] = dist.new_group(list(range(ranks)))  # every rank must call it

    def one(algorithm, nbytes, ranks):
        group = groups.get(ranks)
        member = ranks is None or rank < ranks
        tensor = torch.zeros(max(1, nbytes // 4), device=device())  # zeros stay finite

        def run():
            if member and algorithm == "torch":
                dist.all_reduce(tensor, group=group)
            elif member:
                all_reduce(tensor, group=group, algorithm=algorithm)
            if network is None:  # a sample ends when every rank is done, not rank 0 alone
                dist.barrier()

        return run

    fns = {label: one(*case) for label, case in cases.items()}
    context = emulated_network(*network) if network else contextlib.nullcontext()
    with context:
        result = side_by_side(fns, rounds=rounds, device=device(), min_sample_s=0)
    return result if rank == 0 else None


def emulated_times(sizes, alpha: float, beta: float, rounds: int = 7) -> dict | None:
    """Every algorithm at each size in ``sizes`` (bytes), timed in turns on the emulated
    network (run on every rank): on rank 0, ``{nbytes: result}`` with ``result`` as
    :func:`all_reduces_side_by_side` returns it, its ratios over the ring's time in the
    same round; ``None`` on the other ranks."""
    times = {
        nbytes: all_reduces_side_by_side(
            {name: (name, nbytes, None) for name in ALGORITHMS}, rounds, network=(alpha, beta)
        )
        for nbytes in sizes
    }
    return times if dist.get_rank() == 0 else None
