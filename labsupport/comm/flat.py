"""Flat buffers: where each of several pieces, laid end to end, lies in one buffer.

DDP's gradient buckets (``torch/csrc/distributed/c10d/reducer.cpp``), ZeRO's and FSDP's
flat parameters, a parameter server's shards and an all-reduce's chunks all keep their
pieces end to end and address each one by its offset: the sum of the sizes before it
(``torch._utils._unflatten_dense_tensors`` walks the same offsets).
"""

from __future__ import annotations

from collections.abc import Iterable


def spans(sizes: Iterable[int]) -> list[slice]:
    """Where pieces of ``sizes`` elements, laid end to end in that order, lie in their
    flat buffer: ``slice(start, start + size)`` each, ``start`` the running sum of the
    sizes before it; the last one stops at the buffer's length."""
    out, start = [], 0
    for size in sizes:
        out.append(slice(start, start + size))
        start += size
    return out


def even_spans(n: int, parts: int) -> list[slice]:
    """``n`` elements cut into ``parts`` pieces as ``torch.tensor_split`` cuts them: as
    even as can be, the first ``n % parts`` pieces one longer than the others."""
    base, extra = divmod(n, parts)
    return spans(base + (i < extra) for i in range(parts))
