"""Point-to-point messages, counted: the one place the course's algorithms send bytes.

Every collective and parallel strategy of the course moves data through these
functions, so :func:`count_traffic` sees every byte a rank sends:

* :func:`isend` and :func:`irecv`: one message, started; ``wait()`` on the request;
* :func:`exchange`: a send and a receive at the same time, waited for together;
  :func:`exchange_many`: the same with several peers; :func:`post_many` posts such a
  batch and leaves the waiting to the caller.

:func:`exchange` posts its send and its receive as one
``torch.distributed.batch_isend_irecv``. NCCL needs that: a rank that sends to a peer
and receives from the same peer must group the two calls, or both ranks can wait for
each other forever (a 2-rank ring, halving-doubling's pairs). Gloo accepts the group as
well, so the same code runs on both backends.

Ranks are *group* ranks: ``Group(group)`` translates them to the global ranks that
``torch.distributed`` addresses messages by.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


class Group:
    """Ranks of a process group: ``me`` and ``size`` in the group, ``to_global`` for p2p.

    ``group=None`` is the default (world) group.
    """

    def __init__(self, group=None):
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


# --------------------------------------------------------------------------- traffic


@dataclass(eq=False)  # compared by identity: two counters that saw the same are still two
class Traffic:
    """What this rank sent while counting: bytes and one ``(dst, bytes)`` per message.

    ``dst`` is a rank of the group the message was sent in."""

    bytes_sent: int = 0
    messages: list = field(default_factory=list)


_counters: list[Traffic] = []


@contextlib.contextmanager
def count_traffic():
    """Count the bytes this rank sends through :func:`isend` and :func:`exchange`.

    ``with count_traffic() as traffic: ...`` then ``traffic.bytes_sent``. Counters nest.
    """
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


# --------------------------------------------------------------------------- messages


def isend(g: Group, tensor: torch.Tensor, dst: int):
    """Start sending ``tensor`` to group rank ``dst``; returns the request (``wait()`` it)."""
    _record(tensor, dst)
    return dist.isend(tensor, dst=g.to_global(dst), group=g.group)


def irecv(g: Group, tensor: torch.Tensor, src: int):
    """Start receiving into ``tensor`` from group rank ``src``; returns the request."""
    return dist.irecv(tensor, src=g.to_global(src), group=g.group)


def exchange(g: Group, send=None, dst=None, recv=None, src=None) -> None:
    """Send ``send`` to ``dst`` and receive ``recv`` from ``src`` at once, and wait for both.

    Either side may be left out. The two are posted as one ``batch_isend_irecv``: a
    rank's receive is not queued behind its own send, so rings and pairs cannot
    deadlock, on gloo or on NCCL.
    """
    sends = [] if send is None else [(send, dst)]
    recvs = [] if recv is None else [(recv, src)]
    exchange_many(g, sends, recvs)


def exchange_many(g: Group, sends=(), recvs=()) -> None:
    """Post every ``(tensor, dst)`` send and ``(tensor, src)`` receive as one batch and
    wait for all of them: :func:`exchange` with any number of peers."""
    for request in post_many(g, sends, recvs):
        request.wait()


def post_many(g: Group, sends=(), recvs=()) -> list:
    """:func:`exchange_many`'s batch, posted and not waited for: its requests, one per
    message, the sends' first (NCCL coalesces a batch into one request for all of it)."""
    ops = []
    for tensor, dst in sends:
        _record(tensor, dst)
        ops.append(dist.P2POp(dist.isend, tensor, group=g.group, group_peer=dst))
    for tensor, src in recvs:
        ops.append(dist.P2POp(dist.irecv, tensor, group=g.group, group_peer=src))
    return dist.batch_isend_irecv(ops) if ops else []
