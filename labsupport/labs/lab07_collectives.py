"""Lab 7: each collective run on small, labelled data, ours next to torch's; the bytes
each one sends, against chapter 7's cost table.

Rank ``r`` starts with chapter 7's running example, ``x_r = [1, 2, 3, 4] x 10^r`` (one
value for each of the 4 ranks), so every number says where it came from (``300`` is
rank 2's third value) and a sum says which ranks it has seen (``3303``: ranks 0, 2 and
3). :func:`run_primitive` runs on every rank under :func:`labsupport.launch` and returns
what the rank held before and after, computed by :mod:`labsupport.comm` and by
``torch.distributed``; :func:`bytes_per_collective` counts what each rank sends, and
:func:`table_bytes` is the chapter's formula for it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from labsupport import comm
from labsupport.comm.collectives import binomial_children
from labsupport.labs.cells import exercise
from labsupport.launch.launcher import launch
from labsupport.launch.runtime import device

PRIMITIVES = (
    "broadcast",
    "scatter",
    "gather",
    "reduce",
    "all_reduce",
    "all_gather",
    "reduce_scatter",
    "all_to_all",
)

#: Where each primitive appears in training (chapter 7).
USED_BY = {
    "broadcast": "initial weights from rank 0 (DDP's constructor)",
    "scatter": "handing out shards of data from one rank",
    "gather": "collecting metrics or outputs on one rank",
    "reduce": "summing a metric onto one rank for logging",
    "all_reduce": "DDP's gradient averaging; Megatron tensor parallelism",
    "all_gather": "ZeRO-3 / FSDP gathering sharded parameters",
    "reduce_scatter": "ZeRO-2/3 / FSDP reducing gradients into shards",
    "all_to_all": "mixture-of-experts token routing; Ulysses sequence parallelism",
}


def labelled(rank: int, count: int) -> torch.Tensor:
    """``[1, 2, ..., count] x 10^rank`` as float32, on this rank's device.

    Every value is a digit times a power of ten, so a sum of values from different ranks
    shows, digit by digit, which ranks it has seen (as long as ``count`` is at most 9).
    """
    digits = torch.arange(1, count + 1, dtype=torch.float32, device=device())
    return digits * 10.0**rank


def run_primitive(name: str, root: int = 0) -> dict:
    """Run collective ``name`` with :mod:`labsupport.comm` and with ``torch.distributed``
    on chapter 7's running example; return ``before``, ``ours``, ``torch`` (1-D CPU
    tensors; empty where a rank holds nothing of interest)."""
    if name not in PRIMITIVES:
        raise ValueError(f"name must be one of {', '.join(PRIMITIVES)}; got {name!r}")
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for impl, module in (("ours", comm), ("torch", dist)):
        before, after = _run(module, name, rank, world, root)
        results["before"], results[impl] = before.cpu(), after.cpu()
    return results


def _run(m, name, rank, world, root, piece=1):
    """Run ``m.<name>`` on ``x_r``: ``world`` pieces of ``piece`` values each. Broadcast,
    reduce and all-reduce take all of ``x_r``; scatter the root's ``x_r``, cut in pieces;
    gather and all-gather piece ``r`` of ``x_r``; reduce-scatter and all-to-all ``x_r``'s
    pieces. Returns what the rank held before and after."""

    def zeros(n):
        return torch.zeros(n, device=device())

    empty = zeros(0)
    x = labelled(rank, world * piece)
    pieces = list(x.split(piece))
    if name == "broadcast":
        before = x.clone()
        m.broadcast(x, src=root)
        return before, x
    if name == "scatter":
        out = zeros(piece)
        m.scatter(out, pieces if rank == root else None, src=root)
        return (x if rank == root else empty), out
    if name == "gather":
        bucket = [zeros(piece) for _ in range(world)] if rank == root else None
        m.gather(pieces[rank], bucket, dst=root)
        return pieces[rank], (torch.cat(bucket) if rank == root else empty)
    if name == "reduce":
        before = x.clone()
        m.reduce(x, dst=root)
        return before, (x if rank == root else empty)
    if name == "all_reduce":
        before = x.clone()
        m.all_reduce(x)
        return before, x
    if name == "all_gather":
        bucket = [zeros(piece) for _ in range(world)]
        m.all_gather(bucket, pieces[rank])
        return pieces[rank], torch.cat(bucket)
    if name == "reduce_scatter":
        out = zeros(piece)
        m.reduce_scatter(out, pieces)
        return x, out
    outputs = [zeros(piece) for _ in range(world)]  # all_to_all: piece i goes to rank i
    m.all_to_all(outputs, pieces)
    return x, torch.cat(outputs)


def bytes_per_collective(nbytes: int) -> dict:
    """What this rank sends in each collective of :mod:`labsupport.comm`, counted with
    :func:`~labsupport.comm.count_traffic`: ``{name: (bytes, messages)}``.

    ``nbytes`` is chapter 7's S: the whole tensor of broadcast, reduce and all-reduce,
    all ``N`` pieces together for the others (float32, a multiple of 4 N bytes)."""
    world = dist.get_world_size()
    piece = nbytes // 4 // world
    sent = {}
    for name in PRIMITIVES:
        with comm.count_traffic() as traffic:
            _run(comm, name, dist.get_rank(), world, root=0, piece=piece)
        sent[name] = (traffic.bytes_sent, len(traffic.messages))
    return sent


def table_bytes(name: str, rank: int, world: int, nbytes: int, root: int = 0) -> int:
    """Bytes ``rank`` sends in collective ``name`` of S = ``nbytes``: chapter 7's cost
    table, rank by rank (root ``root``)."""
    n, s = world, nbytes
    if name == "broadcast":  # S to each child in the binomial tree
        return s * len(binomial_children((rank - root) % n, n))
    if name == "reduce":  # S to the parent, from every rank but the root
        return 0 if rank == root else s
    if name == "scatter":  # the root sends N - 1 pieces of S/N
        return (n - 1) * s // n if rank == root else 0
    if name == "gather":  # every rank but the root sends its piece of S/N
        return 0 if rank == root else s // n
    if name == "all_reduce":  # the ring: reduce-scatter, then all-gather
        return 2 * (n - 1) * s // n
    if name in ("all_gather", "reduce_scatter", "all_to_all"):  # N - 1 pieces of S/N
        return (n - 1) * s // n
    raise ValueError(f"name must be one of {', '.join(PRIMITIVES)}; got {name!r}")


def agreement(results: list[dict], name: str) -> str:
    """One line saying whether ours matched torch's on every rank (raises if not)."""
    for rank, result in enumerate(results):
        ours, theirs = result["ours"].tolist(), result["torch"].tolist()
        assert ours == theirs, f"{name}, rank {rank}: ours {ours} != torch's {theirs}"
    return f"labsupport.comm.{name} == torch.distributed.{name} on {len(results)} ranks"


# --------------------------------------------------------------------------- exercises


def _mismatch(world: int, rank: int, ours, theirs, builtin: str) -> str:
    return (
        f"with {world} ranks, rank {rank} ended with {ours}, "
        f"but torch.distributed.{builtin} gives {theirs} on the same input"
    )


def _gather_trial(fn):
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = labelled(rank, 3)
    ours = [torch.zeros(3, device=device()) for _ in range(world)]
    theirs = [torch.zeros(3, device=device()) for _ in range(world)]
    fn(ours, mine)
    dist.all_gather(theirs, mine)
    return [t.tolist() for t in ours], [t.tolist() for t in theirs], mine.tolist()


@exercise
def check_ring_all_gather(fn, world_sizes=(2, 3, 4)) -> str:
    """Exercise 1: ``fn(tensor_list, tensor)``, run on every rank, must fill
    ``tensor_list`` as ``dist.all_gather`` does."""
    for world in world_sizes:
        results = launch(_gather_trial, world, args=(fn,), timeout=60)
        for rank, (ours, theirs, mine) in enumerate(results):
            if ours == theirs:
                continue
            hint = ""
            if ours[rank] != mine:
                hint = f"; tensor_list[{rank}] on rank {rank} should hold the rank's own tensor"
            elif any(block == [0.0] * len(mine) for block in ours):
                hint = "; some blocks never arrived: does every block go all the way around?"
            raise AssertionError(_mismatch(world, rank, ours, theirs, "all_gather") + hint)
    return (
        "every rank holds every rank's block, in rank order, as torch.distributed.all_gather "
        f"gives, on {_sizes(world_sizes)} ranks"
    )


def _all_reduce_trial(fn):
    rank = dist.get_rank()
    ours = labelled(rank, 7)  # 7 does not divide by every world size
    before = ours.tolist()
    theirs = ours.clone()
    returned = fn(ours)
    dist.all_reduce(theirs)
    return ours.tolist(), theirs.tolist(), before, isinstance(returned, torch.Tensor)


@exercise
def check_all_reduce_from_rs_ag(fn, world_sizes=(2, 3, 4)) -> str:
    """Exercise 2: ``fn(tensor)``, run on every rank, must sum ``tensor`` over the ranks
    in place, as ``dist.all_reduce`` does."""
    for world in world_sizes:
        results = launch(_all_reduce_trial, world, args=(fn,), timeout=60)
        for rank, (ours, theirs, before, returned) in enumerate(results):
            if ours == theirs:
                continue
            hint = ""
            if ours == before:
                hint = "; the tensor did not change: write the sum into it, in place"
                if returned:
                    hint += " (a tensor you return is not looked at)"
            elif ours == [t / world for t in theirs]:
                hint = "; that is the mean: the exercise asks for the sum"
            raise AssertionError(_mismatch(world, rank, ours, theirs, "all_reduce") + hint)
    return (
        "every rank's 7 values became their sum over the ranks, in place, as "
        f"torch.distributed.all_reduce gives, on {_sizes(world_sizes)} ranks"
    )


def _sizes(world_sizes) -> str:
    *rest, last = map(str, world_sizes)
    return f"{', '.join(rest)} and {last}" if rest else last
