"""PyTorch's own collectives, each call recorded: what the parallel layers send, counted.

The parallel strategies call these rather than ``torch.distributed`` directly, so that
:func:`trace_collectives` can list every collective a layer runs, with its size and its
group, and the labs can hold the count against the chapter's formula. The calls are
``torch.distributed``'s, unchanged (fast, on gloo or NCCL); only the record is added.

Bytes on the wire follow from the record with the ring's costs (each rank sends):
all-reduce ``2 (N-1)/N · S``, all-gather and reduce-scatter ``(N-1)/N · S``, with ``S``
the size of the full (gathered) tensor, and a broadcast sent down a chain ``(N-1)/N · S``
on average (every rank but the last sends it once); :func:`bytes_per_rank`.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.distributed as dist


@dataclass(eq=False)
class Trace:
    """The collectives called while tracing: ``(name, full tensor bytes, group size)``,
    and beside each call the global ranks of its group (``groups``), so that calls on
    different groups of the same size (a mesh's axes) can be told apart."""

    calls: list = field(default_factory=list)
    groups: list = field(default_factory=list)

    def count(self, name: str) -> int:
        return sum(1 for n, _, _ in self.calls if n == name)

    def on(self, ranks) -> Trace:
        """The calls made on the group of these global ranks (in any order)."""
        keep = [i for i, g in enumerate(self.groups) if g == tuple(sorted(ranks))]
        return Trace([self.calls[i] for i in keep], [self.groups[i] for i in keep])


_traces: list[Trace] = []


@contextlib.contextmanager
def trace_collectives():
    """Record every collective of this module called inside the ``with`` block."""
    trace = Trace()
    _traces.append(trace)
    try:
        yield trace
    finally:
        _traces.remove(trace)


def _record(name: str, nbytes: int, group) -> None:
    if not _traces:
        return
    ranks = tuple(sorted(dist.get_process_group_ranks(group or dist.group.WORLD)))
    for trace in _traces:
        trace.calls.append((name, nbytes, len(ranks)))
        trace.groups.append(ranks)


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


def all_reduce(tensor: torch.Tensor, group=None, op=dist.ReduceOp.SUM, async_op: bool = False):
    """Combine ``tensor`` over the group (a sum by default), in place; returns it, or with
    ``async_op=True`` the work to ``wait()`` for, as ``dist.all_reduce`` does."""
    _record("all_reduce", _nbytes(tensor), group)
    work = dist.all_reduce(tensor, op=op, group=group, async_op=async_op)
    return work if async_op else tensor


def broadcast(tensor: torch.Tensor, src: int, group=None) -> torch.Tensor:
    """Copy global rank ``src``'s ``tensor`` into every rank's, in place; returns it."""
    _record("broadcast", _nbytes(tensor), group)
    dist.broadcast(tensor, src=src, group=group)
    return tensor


def all_gather(tensor: torch.Tensor, dim: int, group=None, async_op: bool = False):
    """Concatenate every rank's ``tensor`` along ``dim``, in rank order; with
    ``async_op=True``, the result and the work to ``wait()`` for before reading it."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    out = torch.empty(
        (world * moved.shape[0], *moved.shape[1:]), dtype=moved.dtype, device=moved.device
    )
    _record("all_gather", _nbytes(out), group)
    work = dist.all_gather_single(out, moved, group=group, async_op=async_op)
    return (out.movedim(0, dim), work) if async_op else out.movedim(0, dim)


def reduce_scatter(tensor: torch.Tensor, dim: int, group=None) -> torch.Tensor:
    """Sum ``tensor`` over the group and keep this rank's slice of it along ``dim``."""
    world = dist.get_world_size(group)
    moved = tensor.movedim(dim, 0).contiguous()
    if moved.shape[0] % world:
        raise ValueError(
            f"reduce-scatter along dim {dim} of size {moved.shape[0]} over {world} ranks: "
            "the size must be a multiple of the number of ranks"
        )
    out = torch.empty(
        (moved.shape[0] // world, *moved.shape[1:]), dtype=moved.dtype, device=moved.device
    )
    _record("reduce_scatter", _nbytes(moved), group)
    dist.reduce_scatter_single(out, moved, group=group)
    return out.movedim(0, dim)


def bytes_per_rank(trace: Trace) -> float:
    """Bytes each rank sends for the traced collectives, run as rings; an all-to-all is
    recorded with the bytes this rank sends to the others, counted as they are."""
    factor = {"all_reduce": 2, "all_gather": 1, "reduce_scatter": 1, "broadcast": 1}
    return sum(
        size if name == "all_to_all" else factor[name] * (n - 1) / n * size
        for name, size, n in trace.calls
    )
