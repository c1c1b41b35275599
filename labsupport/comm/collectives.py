"""Seven collectives of ``torch.distributed``, built only from point-to-point messages.

Each function has the signature and semantics of its ``torch.distributed`` namesake
(``src``/``dst`` are global ranks, ``group=`` selects a process group, results land in
place where torch's do) and moves data only through :mod:`labsupport.comm.p2p`, where
:func:`~labsupport.comm.p2p.count_traffic` counts every byte. The unit tests check
each against ``torch.distributed``. The eighth, all-reduce, has a module of its own
(:mod:`labsupport.comm.allreduce`), with five algorithms.

The algorithms are the classic ones (Thakur, Rabenseifner and Gropp 2005):

* broadcast and reduce: binomial trees, ``ceil(log2 N)`` rounds;
* scatter and gather: the root talks to each rank in turn;
* all-gather and reduce-scatter: a ring, ``N - 1`` rounds of one block each;
* all-to-all: ``N - 1`` rounds, rank ``r`` sending to ``r + k`` in round ``k``.
"""

from __future__ import annotations

import contextlib

import torch
from torch.distributed import ReduceOp

from labsupport.comm.p2p import Group, exchange, isend

_COMBINE = {
    ReduceOp.SUM: torch.add,
    ReduceOp.PRODUCT: torch.mul,
    ReduceOp.MIN: torch.minimum,
    ReduceOp.MAX: torch.maximum,
}


@contextlib.contextmanager
def contiguous(tensor: torch.Tensor):
    """A contiguous buffer for ``tensor``, copied back if it had to be a copy."""
    buffer = tensor if tensor.is_contiguous() else tensor.contiguous()
    yield buffer
    if buffer is not tensor:
        tensor.copy_(buffer)


def combiner(op):
    """The elementwise function that combines two tensors for reduce op ``op``."""
    try:
        return _COMBINE[op]
    except (KeyError, TypeError):
        raise ValueError(f"op must be ReduceOp.SUM, PRODUCT, MIN or MAX, got {op!r}") from None


# --------------------------------------------------------------------------- rooted


def binomial_children(rel: int, size: int) -> list[int]:
    """Children of ``rel`` in a binomial tree rooted at 0, in the order they are served."""
    children, mask = [], 1
    while mask < size:
        if rel < mask and rel + mask < size:
            children.append(rel + mask)
        mask <<= 1
    return children


def binomial_parent(rel: int) -> int | None:
    return None if rel == 0 else rel - (1 << (rel.bit_length() - 1))


def broadcast(tensor: torch.Tensor, src: int, group=None) -> None:
    """Copy ``tensor`` of rank ``src`` into ``tensor`` of every rank (binomial tree)."""
    g = Group(group)
    root = g.from_global(src)
    rel = (g.me - root) % g.size
    with contiguous(tensor) as buf:
        parent = binomial_parent(rel)
        if parent is not None:
            exchange(g, recv=buf, src=(parent + root) % g.size)
        for child in binomial_children(rel, g.size):
            exchange(g, send=buf, dst=(child + root) % g.size)


def reduce(tensor: torch.Tensor, dst: int, op=ReduceOp.SUM, group=None) -> None:
    """Combine every rank's ``tensor`` with ``op`` into ``tensor`` of rank ``dst`` (tree)."""
    g, combine = Group(group), combiner(op)
    root = g.from_global(dst)
    rel = (g.me - root) % g.size
    acc = tensor.detach().clone().contiguous()
    incoming = torch.empty_like(acc)
    for child in reversed(binomial_children(rel, g.size)):
        exchange(g, recv=incoming, src=(child + root) % g.size)
        acc = combine(acc, incoming)
    parent = binomial_parent(rel)
    if parent is None:
        tensor.copy_(acc)
    else:
        exchange(g, send=acc, dst=(parent + root) % g.size)


def scatter(tensor: torch.Tensor, scatter_list=None, src: int = 0, group=None) -> None:
    """Rank ``src`` sends ``scatter_list[i]`` to rank ``i``, which receives it in ``tensor``."""
    g = Group(group)
    root = g.from_global(src)
    with contiguous(tensor) as buf:
        if g.me != root:
            exchange(g, recv=buf, src=root)
            return
        if scatter_list is None or len(scatter_list) != g.size:
            raise ValueError(f"scatter on the source rank needs a scatter_list of {g.size} tensors")
        requests = [isend(g, scatter_list[i].contiguous(), i) for i in range(g.size) if i != root]
        buf.copy_(scatter_list[root])
        for request in requests:
            request.wait()


def gather(tensor: torch.Tensor, gather_list=None, dst: int = 0, group=None) -> None:
    """Every rank sends ``tensor`` to rank ``dst``, which stores rank i's in ``gather_list[i]``."""
    g = Group(group)
    root = g.from_global(dst)
    if g.me != root:
        exchange(g, send=tensor.contiguous(), dst=root)
        return
    if gather_list is None or len(gather_list) != g.size:
        raise ValueError(f"gather on the destination rank needs a gather_list of {g.size} tensors")
    for i in range(g.size):
        if i == root:
            gather_list[i].copy_(tensor)
        else:
            with contiguous(gather_list[i]) as buf:
                exchange(g, recv=buf, src=i)


# --------------------------------------------------------------------------- ring


def ring_chunk(phase: str, rank: int, step: int, world_size: int) -> int:
    """The chunk ``rank`` sends to its right neighbour at ``step`` of a ring phase.

    Reduce-scatter: chunk ``rank - 1 - step``, so that chunk ``j`` starts at rank
    ``j + 1`` and has visited every rank when it reaches rank ``j`` after N - 1 steps.
    All-gather: chunk ``rank - step``, passing on the chunk received the step before.
    """
    offset = 1 if phase == "reduce-scatter" else 0
    return (rank - offset - step) % world_size


def ring_reduce_scatter(g: Group, chunks: list[torch.Tensor], combine) -> None:
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
        exchange(g, send=chunks[send_index], dst=right, recv=incoming, src=left)
        combine(target, incoming, out=target)


def ring_all_gather(g: Group, chunks: list[torch.Tensor]) -> None:
    """In place: ``chunks[i]`` of rank ``i`` is copied into ``chunks[i]`` of every rank."""
    right, left = (g.me + 1) % g.size, (g.me - 1) % g.size
    for step in range(g.size - 1):
        send_index = ring_chunk("all-gather", g.me, step, g.size)
        recv_index = ring_chunk("all-gather", left, step, g.size)
        exchange(g, send=chunks[send_index], dst=right, recv=chunks[recv_index], src=left)


def all_gather(tensor_list: list[torch.Tensor], tensor: torch.Tensor, group=None) -> None:
    """Every rank gets every rank's ``tensor``: rank i's lands in ``tensor_list[i]`` (ring)."""
    g = Group(group)
    if len(tensor_list) != g.size:
        raise ValueError(f"all_gather needs a tensor_list of {g.size} tensors")
    blocks = [torch.empty_like(tensor, memory_format=torch.contiguous_format) for _ in tensor_list]
    blocks[g.me].copy_(tensor)
    ring_all_gather(g, blocks)
    for out, block in zip(tensor_list, blocks, strict=True):
        out.copy_(block)


def reduce_scatter(
    output: torch.Tensor, input_list: list[torch.Tensor], op=ReduceOp.SUM, group=None
):
    """Rank i gets the combination over ranks of ``input_list[i]``, in ``output`` (ring)."""
    g, combine = Group(group), combiner(op)
    if len(input_list) != g.size:
        raise ValueError(f"reduce_scatter needs an input_list of {g.size} tensors")
    chunks = [t.detach().clone().contiguous() for t in input_list]
    ring_reduce_scatter(g, chunks, combine)
    output.copy_(chunks[g.me])


def all_to_all(
    output_tensor_list: list[torch.Tensor], input_tensor_list: list[torch.Tensor], group=None
):
    """Rank r sends ``input_tensor_list[i]`` to rank i, which stores it in its
    ``output_tensor_list[r]``: a transpose of who-holds-what."""
    g = Group(group)
    if len(input_tensor_list) != g.size or len(output_tensor_list) != g.size:
        raise ValueError(f"all_to_all needs lists of {g.size} tensors")
    output_tensor_list[g.me].copy_(input_tensor_list[g.me])
    for step in range(1, g.size):
        dst, src = (g.me + step) % g.size, (g.me - step) % g.size
        with contiguous(output_tensor_list[src]) as buf:
            exchange(g, send=input_tensor_list[dst].contiguous(), dst=dst, recv=buf, src=src)
