"""The eight collectives of ``torch.distributed``, built only from point-to-point messages.

Each function has the signature and semantics of its ``torch.distributed`` namesake
(``src``/``dst`` are global ranks, ``group=`` selects a process group, results land in
place where torch's do) and moves data only with ``isend``/``irecv``, through two
helpers, :func:`_send_recv` and :func:`_send`, which is where :func:`count_traffic`
counts every byte. The unit tests check each against ``torch.distributed``.

The algorithms are the classic ones:

* broadcast and reduce: binomial trees, ``ceil(log2 N)`` rounds;
* scatter and gather: the root talks to each rank in turn;
* all-gather and reduce-scatter: a ring, ``N - 1`` rounds of one block each;
* all-to-all: ``N - 1`` rounds, rank ``r`` sending to ``r + k`` in round ``k``;
* all-reduce, five ways (``algorithm=``): ``"ring"`` (reduce-scatter then all-gather on
  a ring, as Baidu's ring all-reduce and NCCL; Patarasuk and Yuan 2009), ``"naive"``
  (everything to rank 0, summed, sent back), ``"ps"`` (a sharded parameter server:
  rank ``j`` owns shard ``j``), ``"tree"`` (binomial reduce then broadcast) and
  ``"halving_doubling"`` (Rabenseifner's recursive halving and doubling; Thakur,
  Rabenseifner and Gropp 2005).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

ALGORITHMS = ("ring", "naive", "ps", "tree", "halving_doubling")

_COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}

# --------------------------------------------------------------------------- traffic


@dataclass
class Traffic:
    """What this rank sent while counting: bytes and one ``(dst, bytes)`` per message."""

    bytes_sent: int = 0
    messages: list = field(default_factory=list)


_counters: list[Traffic] = []


@contextlib.contextmanager
def count_traffic():
    """Count the bytes this rank sends through the functions of this module."""
    counter = Traffic()
    _counters.append(counter)
    try:
        yield counter
    finally:
        _counters.remove(counter)


def _record(tensor: torch.Tensor, dst: int) -> None:
    size = tensor.numel() * tensor.element_size()
    for counter in _counters:
        counter.bytes_sent += size
        counter.messages.append((dst, size))


# --------------------------------------------------------------------------- p2p


class _Group:
    """Ranks of a process group: ``me`` and ``size`` in the group, ``to_global`` for p2p."""

    def __init__(self, group):
        self.group = group
        self.me = dist.get_rank(group)
        self.size = dist.get_world_size(group)
        if self.me < 0:
            raise ValueError("this rank is not a member of the process group it was given")

    def to_global(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_global_rank(self.group, rank)

    def from_global(self, rank: int) -> int:
        if self.group is None or self.group is dist.group.WORLD:
            return rank
        return dist.get_group_rank(self.group, rank)


def _send(g: _Group, tensor: torch.Tensor, dst: int):
    """Start sending ``tensor`` to group rank ``dst``; returns the request."""
    _record(tensor, dst)
    return dist.isend(tensor, dst=g.to_global(dst), group=g.group)


def _recv(g: _Group, tensor: torch.Tensor, src: int):
    return dist.irecv(tensor, src=g.to_global(src), group=g.group)


def _send_recv(g: _Group, send=None, dst=None, recv=None, src=None) -> None:
    """Send and receive at the same time, and wait for both (deadlock-free in rings)."""
    requests = []
    if recv is not None:
        requests.append(_recv(g, recv, src))
    if send is not None:
        requests.append(_send(g, send, dst))
    for request in requests:
        request.wait()


@contextlib.contextmanager
def _contiguous(tensor: torch.Tensor):
    """A contiguous buffer for ``tensor``, copied back if it had to be a copy."""
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    yield buffer
    if buffer is not tensor:
        tensor.copy_(buffer)


def _combine(op):
    try:
        return _COMBINE[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be ReduceOp.SUM, PRODUCT, MIN or MAX, got {op!r}") from None


# --------------------------------------------------------------------------- rooted


def _binomial_children(rel: int, size: int) -> list[int]:
    """Children of ``rel`` in a binomial tree rooted at 0, in the order they are served."""
    children, mask = [], 1
    while mask < size:
        if rel < mask and rel + mask < size:
            children.append(rel + mask)
        mask <<= 1
    return children


def _binomial_parent(rel: int) -> int | None:
    return None if rel == 0 else rel - (1 << (rel.bit_length() - 1))


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank (binomial tree)."""
    g = _Group(group)
    root = g.from_global(src)
    rel = (g.me - root) % g.size
    with _contiguous(tensor) as buf:
        parent = _binomial_parent(rel)
        if parent is not None:
            _send_recv(g, recv=buf, src=(parent + root) % g.size)
        for child in _binomial_children(rel, g.size):
            _send_recv(g, send=buf, dst=(child + root) % g.size)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None) -> None:
    """Combine every rank's ``tensor`` with ``op`` into ``tensor`` of rank ``dst`` (tree)."""
    g, combine = _Group(group), _combine(op)
    root = g.from_global(dst)
    rel = (g.me - root) % g.size
    acc = tensor.detach().clone().contiguous()
    incoming = torch.empty_like(acc)
    for child in reversed(_binomial_children(rel, g.size)):
        _send_recv(g, recv=incoming, src=(child + root) % g.size)
        acc = combine(acc, incoming)
    parent = _binomial_parent(rel)
    if parent is None:
        tensor.copy_(acc)
    else:
        _send_recv(g, send=acc, dst=(parent + root) % g.size)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None) -> None:
    """Rank ``src`` sends ``scatter_list[i]`` to rank ``i``, which receives it in ``tensor``."""
    g = _Group(group)
    root = g.from_global(src)
    with _contiguous(tensor) as buf:
        if g.me != root:
            _send_recv(g, recv=buf, src=root)
            return
        if scatter_list is None or len(scatter_list) != g.size:
            raise ValueError(f"scatter on the source rank needs a scatter_list of {g.size} tensors")
        requests = [_send(g, scatter_list[i].contiguous(), i) for i in range(g.size) if i != root]
        buf.copy_(scatter_list[root])
        for request in requests:
            request.wait()


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None) -> None:
    """Every rank sends ``tensor`` to rank ``dst``, which stores rank i's in ``gather_list[i]``."""
    g = _Group(group)
    root = g.from_global(dst)
    if g.me != root:
        _send_recv(g, send=tensor.contiguous(), dst=root)
        return
    if gather_list is None or len(gather_list) != g.size:
        raise ValueError(f"gather on the destination rank needs a gather_list of {g.size} tensors")
    for i in range(g.size):
        if i == root:
            gather_list[i].copy_(tensor)
        else:
            with _contiguous(gather_list[i]) as buf:
                _send_recv(g, recv=buf, src=i)


# --------------------------------------------------------------------------- ring


def ring_chunk(phase: str, rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` sends to its right neighbour at ``step`` of a ring phase.

    Reduce-scatter: chunk ``rank - 1 - step``, so that chunk ``j`` starts at rank
    ``j + 1`` and has visited every rank when it reaches rank ``j`` after N - 1 steps.
    All-gather: chunk ``rank - step``, passing on the chunk received the step before.
    """
    offset = 1 if phase == "reduce-scatter" else 0
    return (rank - offset - step) % world_size


def _ring_reduce_scatter(g: _Group, chunks: list[torch.Tensor], combine) -> None:
    """In place: afterwards ``chunks[me]`` holds the combination of every rank's chunk."""
    right, left = (g.me + 1) % g.size, (g.me - 1) % g.size
    scratch = torch.empty(
        max(c.numel() for c in chunks), dtype=chunks[0].dtype, device=chunks[0].device
    )
    for step in range(g.size - 1):
        send_index = ring_chunk("reduce-scatter", g.me, step, g.size)
        recv_index = ring_chunk("reduce-scatter", left, step, g.size)
        target = chunks[recv_index]
        incoming = scratch[: target.numel()].view_as(target)
        _send_recv(g, send=chunks[send_index], dst=right, recv=incoming, src=left)
        combine(target, incoming, out=target)


def _ring_all_gather(g: _Group, chunks: list[torch.Tensor]) -> None:
    """In place: ``chunks[i]`` of rank ``i`` is copied into ``chunks[i]`` of every rank."""
    right, left = (g.me + 1) % g.size, (g.me - 1) % g.size
    for step in range(g.size - 1):
        send_index = ring_chunk("all-gather", g.me, step, g.size)
        recv_index = ring_chunk("all-gather", left, step, g.size)
        _send_recv(g, send=chunks[send_index], dst=right, recv=chunks[recv_index], src=left)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Every rank gets every rank's ``tensor``: rank i's lands in ``tensor_list[i]`` (ring)."""
    g = _Group(group)
    if len(tensor_list) != g.size:
        raise ValueError(f"all_gather needs a tensor_list of {g.size} tensors")
    blocks = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in tensor_list]
    blocks[g.me].copy_(tensor)
    _ring_all_gather(g, blocks)
    for out, block in zip(tensor_list, blocks, strict=True):
        out.copy_(block)


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None
):
    """Rank i gets the combination over ranks of ``input_list[i]``, in ``output`` (ring)."""
    g, combine = _Group(group), _combine(op)
    if len(input_list) != g.size:
        raise ValueError(f"reduce_scatter needs an input_list of {g.size} tensors")
    chunks = [t.detach().clone().contiguous() for t in input_list]
    _ring_reduce_scatter(g, chunks, combine)
    output.copy_(chunks[g.me])


def all_to_all(
    output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group=None
):
    """Rank r sends ``input_tensor_list[i]`` to rank i, which stores it in its
    ``output_tensor_list[r]``: a transpose of who-holds-what."""
    g = _Group(group)
    if len(input_tensor_list) != g.size or len(output_tensor_list) != g.size:
        raise ValueError(f"all_to_all needs lists of {g.size} tensors")
    output_tensor_list[g.me].copy_(input_tensor_list[g.me])
    for step in range(1, g.size):
        dst, src = (g.me + step) % g.size, (g.me - step) % g.size
        with _contiguous(output_tensor_list[src]) as buf:
            _send_recv(g, send=input_tensor_list[dst].contiguous(), dst=dst, recv=buf, src=src)


# --------------------------------------------------------------------------- all-reduce


def all_reduce(tensor: torch.Tensor, op=ReduceOp.SUM, group=None, algorithm: str = "ring"):
    """Combine every rank's ``tensor`` with ``op``; every rank gets the result, in place."""
    g, combine = _Group(group), _combine(op)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    if g.size == 1:
        return
    with _contiguous(tensor) as buf:
        flat = buf.view(-1)
        if algorithm == "ring":
            chunks = list(flat.tensor_split(g.size))
            _ring_reduce_scatter(g, chunks, combine)
            _ring_all_gather(g, chunks)
        elif algorithm == "naive":
            _naive(g, flat, combine)
        elif algorithm == "ps":
            _sharded_parameter_server(g, flat, combine)
        elif algorithm == "tree":
            reduce(flat, g.to_global(0), op, group)
            broadcast(flat, g.to_global(0), group)
        else:
            _halving_doubling(g, flat, combine)


def _naive(g: _Group, flat: torch.Tensor, combine) -> None:
    """Every rank sends its whole tensor to rank 0, which combines and sends the result back."""
    if g.me != 0:
        _send_recv(g, send=flat, dst=0)
        _send_recv(g, recv=flat, src=0)
        return
    incoming = torch.empty_like(flat)
    for src in range(1, g.size):
        _send_recv(g, recv=incoming, src=src)
        flat.copy_(combine(flat, incoming))
    for dst in range(1, g.size):
        _send_recv(g, send=flat, dst=dst)


def _sharded_parameter_server(g: _Group, flat: torch.Tensor, combine) -> None:
    """Rank j is the server of shard j: everyone pushes shard j to it, it combines them
    and everyone pulls the result back (the parameter server of Li et al., 2014, with
    the parameters spread over all ranks)."""
    shards = list(flat.tensor_split(g.size))
    mine = shards[g.me]
    pushes = [_send(g, shards[j], j) for j in range(g.size) if j != g.me]
    incoming = [(src, torch.empty_like(mine)) for src in range(g.size) if src != g.me]
    for src, buf in incoming:
        _recv(g, buf, src).wait()
    for _, buf in incoming:  # combine in rank order, the same on every run
        mine.copy_(combine(mine, buf))
    for request in pushes:
        request.wait()
    pulls = [_recv(g, shards[j], j) for j in range(g.size) if j != g.me]
    sends = [_send(g, mine, dst) for dst in range(g.size) if dst != g.me]
    for request in pulls + sends:
        request.wait()


def _halving_doubling(g: _Group, flat: torch.Tensor, combine) -> None:
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
        _send_recv(g, send=send, dst=partner, recv=incoming, src=partner)
        _unpack(combine(kept, incoming), chunks, *keep)
        lo, hi = keep
        distance //= 2
    distance = 1
    while distance < g.size:
        partner = g.me ^ distance
        width = hi - lo
        other = (lo + width, hi + width) if g.me & distance == 0 else (lo - width, lo)
        incoming = torch.empty_like(torch.cat(chunks[other[0] : other[1]]))
        _send_recv(g, send=torch.cat(chunks[lo:hi]), dst=partner, recv=incoming, src=partner)
        _unpack(incoming, chunks, *other)
        lo, hi = min(lo, other[0]), max(hi, other[1])
        distance *= 2


def _unpack(values: torch.Tensor, chunks: list[torch.Tensor], lo: int, hi: int) -> None:
    offset = 0
    for chunk in chunks[lo:hi]:
        chunk.copy_(values[offset : offset + chunk.numel()])
        offset += chunk.numel()


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
        edges = len(_binomial_children(rank, n)) + (rank != 0)
        count = edges * numel
    else:
        raise ValueError(f"algorithm must be one of {', '.join(ALGORITHMS)}; got {algorithm!r}")
    return count * element_size


def _split_slices(numel: int, parts: int) -> list[slice]:
    """The slices ``tensor_split`` makes: the first ``numel % parts`` get one extra."""
    base, extra = divmod(numel, parts)
    slices, start = [], 0
    for i in range(parts):
        size = base + (i < extra)
        slices.append(slice(start, start + size))
        start += size
    return slices


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
