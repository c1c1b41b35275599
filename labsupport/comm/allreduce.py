"""All-reduce, five ways, from point-to-point messages; and the bytes each rank sends.

:func:`all_reduce` has the semantics of ``torch.distributed.all_reduce`` (in place,
``op=``, ``group=``) and an ``algorithm=``:

* ``"ring"``: reduce-scatter then all-gather around a ring, as Baidu's ring all-reduce
  and NCCL do; bandwidth-optimal, each rank sends 2(N-1)/N of the data (Patarasuk and
  Yuan 2009);
* ``"naive"``: everything to rank 0, combined there, sent back;
* ``"ps"``: a sharded parameter server, rank ``j`` owning shard ``j`` (Li et al. 2014);
* ``"tree"``: a binomial-tree reduce, then a binomial-tree broadcast;
* ``"halving_doubling"``: Rabenseifner's recursive halving, then recursive doubling
  (Thakur, Rabenseifner and Gropp 2005), for a power-of-two number of ranks.

:func:`bytes_sent` counts, exactly, what each rank sends in each of them, for the
tests and lab 8 to hold against :func:`~labsupport.comm.p2p.count_traffic`.
"""

from __future__ import annotations

import torch
from torch.distributed import ReduceOp

from labsupport.comm.collectives import (
    binomial_children,
    broadcast,
    combiner,
    contiguous,
    reduce,
    ring_all_gather,
    ring_reduce_scatter,
)
from labsupport.comm.flat import even_spans as _split_slices  # bytes_sent's name (lab 8 shows it)
from labsupport.comm.flat import spans
from labsupport.comm.p2p import Group, exchange, exchange_many

ALGORITHMS = ("ring", "naive", "ps", "tree", "halving_doubling")


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, algorithm: str = "ring"):
    """Combine every rank's ``tensor`` with ``op``; every rank gets the result, in place."""
    g, combine = Group(group), combiner(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    if g.size == 1:
        return
    with contiguous(tensor) as buf:
        flat = buf.view(-1)
        if algorithm == "ring":
            chunks = list(flat.tensor_split(g.size))
            ring_reduce_scatter(g, chunks, combine)
            ring_all_gather(g, chunks)
        elif algorithm == "naive":
            _naive(g, flat, combine)
        elif algorithm == "ps":
            _sharded_parameter_server(g, flat, combine)
        elif algorithm == "tree":
            reduce(flat, g.to_global(0), op, group)
            broadcast(flat, g.to_global(0), group)
        else:
            _halving_doubling(g, flat, combine)


def _naive(g: Group, flat: torch.Tensor, combine) -> None:
    """Every rank sends its whole tensor to rank 0, which combines and sends the result back."""
    if g.me != 0:
        exchange(g, send=flat, dst=0)
        exchange(g, recv=flat, src=0)
        return
    incoming = torch.empty_like(flat)
    for src in range(1, g.size):
        exchange(g, recv=incoming, src=src)
        flat.copy_(combine(flat, incoming))
    for dst in range(1, g.size):
        exchange(g, send=flat, dst=dst)


def _sharded_parameter_server(g: Group, flat: torch.Tensor, combine) -> None:
    """Rank j is the server of shard j: everyone pushes shard j to it, it combines them
    and everyone pulls the result back (the parameter server of Li et al., 2014, with
    the parameters spread over all ranks)."""
    shards = list(flat.tensor_split(g.size))
    mine = shards[g.me]
    others = [j for j in range(g.size) if j != g.me]
    incoming = [torch.empty_like(mine) for _ in others]
    pushes = [(shards[j], j) for j in others]
    exchange_many(g, sends=pushes, recvs=list(zip(incoming, others, strict=True)))
    for buf in incoming:  # combine in rank order, the same on every run
        mine.copy_(combine(mine, buf))
    pulls = [(shards[j], j) for j in others]
    exchange_many(g, sends=[(mine, j) for j in others], recvs=pulls)


def _halving_doubling(g: Group, flat: torch.Tensor, combine) -> None:
    """Recursive halving (a reduce-scatter in log2 N steps, halving the data each time)
    then recursive doubling (the matching all-gather). Needs a power-of-two world."""
    if g.size & (g.size - 1):
        raise ValueError(
            f"halving_doubling needs a power-of-two number of ranks, got {g.size}; "
            "use algorithm='ring' or 'tree'"
        )
    chunks = list(flat.tensor_split(g.size))
    lo, hi = 0, g.size  # the chunks this rank is still responsible for
    distance = g.size // 2
    while distance >= 1:
        partner = g.me ^ distance
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if g.me & distance == 0 else ((mid, hi), (lo, mid))
        send = torch.cat(chunks[give[0] : give[1]])
        kept = torch.cat(chunks[keep[0] : keep[1]])
        incoming = torch.empty_like(kept)
        exchange(g, send=send, dst=partner, recv=incoming, src=partner)
        _unpack(combine(kept, incoming), chunks, *keep)
        lo, hi = keep
        distance //= 2
    distance = 1
    while distance < g.size:
        partner = g.me ^ distance
        width = hi - lo
        other = (lo + width, hi + width) if g.me & distance == 0 else (lo - width, lo)
        incoming = torch.empty_like(torch.cat(chunks[other[0] : other[1]]))
        exchange(g, send=torch.cat(chunks[lo:hi]), dst=partner, recv=incoming, src=partner)
        _unpack(incoming, chunks, *other)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        distance *= 2


def _unpack(values: torch.Tensor, chunks: list[torch.Tensor], lo: int, hi: int) -> None:
    for chunk, part in zip(chunks[lo:hi], spans(c.numel() for c in chunks[lo:hi]), strict=True):
        chunk.copy_(values[part])


# --------------------------------------------------------------------------- theory


def bytes_sent(algorithm: str, numel: int, element_size: int, world_size: int, rank: int) -> int:
    """Bytes rank ``rank`` sends in ``all_reduce(algorithm=...)`` of ``numel`` elements.

    Exact, including the uneven chunks of a size that does not divide by the world
    size. With S = numel * element_size and N ranks: ring, ps and halving_doubling send
    2 (N-1)/N S per rank (the bandwidth-optimal amount); naive sends (N-1) S from rank
    0 and S from the others; tree sends S per edge of its two binomial trees.
    """
    n = world_size
    if n == 1:
        return 0
    sizes = [part.stop - part.start for part in _split_slices(numel, n)]
    if algorithm in ("ring", "halving_doubling"):
        if algorithm == "halving_doubling" and n & (n - 1):
            raise ValueError("halving_doubling needs a power-of-two world size")
        if algorithm == "ring":
            # reduce-scatter sends every chunk but its own; all-gather every chunk but its right
            # neighbour's
            count = 2 * numel - sizes[rank] - sizes[(rank + 1) % n]
        else:
            count = _halving_doubling_elements(sizes, rank)
    elif algorithm == "ps":
        count = (numel - sizes[rank]) + (n - 1) * sizes[rank]
    elif algorithm == "naive":
        count = (n - 1) * numel if rank == 0 else numel
    elif algorithm == "tree":
        edges = len(binomial_children(rank, n)) + (rank != 0)
        count = edges * numel
    else:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    return count * element_size


def _halving_doubling_elements(sizes: list[int], rank: int) -> int:
    """Elements ``rank`` sends in halving-doubling: the same walk as the algorithm."""
    n, lo, hi, sent, distance = len(sizes), 0, len(sizes), 0, len(sizes) // 2
    while distance >= 1:
        mid = (lo + hi) // 2
        keep, give = ((lo, mid), (mid, hi)) if rank & distance == 0 else ((mid, hi), (lo, mid))
        sent += sum(sizes[give[0] : give[1]])
        lo, hi = keep
        distance //= 2
    distance = 1
    while distance < n:
        sent += sum(sizes[lo:hi])
        width = hi - lo
        lo, hi = (lo, hi + width) if rank & distance == 0 else (lo - width, hi)
        distance *= 2
    return sent
