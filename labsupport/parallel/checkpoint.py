"""Checkpoints of distributed training: everything needed to resume exactly, sharded,
and checked before it is loaded.

Written with ``torch.distributed.checkpoint`` (DCP): every rank writes its own part, in
parallel, and a checkpoint written by ``N`` ranks can be loaded by ``M``. DCP's rule for
what belongs to whom is the trap: a plain tensor saved under one key by every rank is
taken as *replicated*, and only one rank's copy is written. That is right for DDP's
parameters, which are the same everywhere, and silently wrong for anything that differs
between ranks. So:

* a ZeRO shard is saved as a ``DTensor`` (``Shard(0)`` of the flat, unpadded parameters
  over the data-parallel ranks): DCP stores every rank's piece and can cut the whole into
  different pieces on load (:func:`zero_state`, :func:`restore_zero`);
* what is truly per-rank (random-number generator states) goes under per-rank keys
  (:func:`rng_state`).

A checkpoint holds the model, the optimizer's state, the step (from which the
learning-rate schedule and the data position follow) and every rank's RNG states: resumed,
the run continues as if it had never stopped. :func:`save_async` writes one in the
background while training goes on. Every checkpoint carries the SHA-256 of each of its
files, and :func:`load` refuses one whose files do not match, before it changes anything
(:mod:`~labsupport.parallel.checkpoint_checksums`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map

from labsupport.launch.runtime import device
from labsupport.parallel.checkpoint_checksums import (
    MANIFEST,
    CheckpointError,
    ChecksummedWriter,
    VerifyingReader,
    manifest,
    verify,
)

__all__ = [
    "MANIFEST",
    "CheckpointError",
    "verify",
    "save",
    "save_async",
    "load",
    "rng_state",
    "set_rng_state",
    "zero_parameters",
    "zero_optimizer",
    "zero_state",
    "restore_zero",
]


def save(state: dict, path: str, group=None) -> None:
    """Write ``state`` (every rank calls it) to the folder ``path``, with the checksums
    of its files (:data:`MANIFEST`)."""
    dcp.save(state, storage_writer=ChecksummedWriter(path), process_group=group)


def save_async(state: dict, path: str, group=None):
    """Start writing ``state`` to the folder ``path`` in a background thread (every rank
    calls it) and return a future: ``.result()`` waits until the checkpoint is complete,
    the checksums of its files included (hashed in the background thread too).

    ``state`` is copied before this returns, so training may go on and change it. The
    writer agrees on a plan with the other ranks, with collectives run from its thread:
    give it a process group of its own (``dist.new_group(backend="gloo")``), so that they
    never interleave with the training's collectives on the same group. (DCP copies the
    state to host memory itself, but in torch 2.13 its copy fails on a DTensor whose local
    tensor is a view that starts partway into a larger buffer, as a ZeRO-1 or ZeRO-2
    parameter shard is on every rank but rank 0; so each tensor is first copied into
    storage of its own.) ``async_save`` also needs a group with a CPU backend: gloo, or
    ``"cpu:gloo,cuda:nccl"`` (the course's ``backend="auto"`` on GPUs).
    """
    state = tree_map(_own_copy, state)
    return dcp.async_save(state, storage_writer=ChecksummedWriter(path), process_group=group)


def _own_copy(value):
    if isinstance(value, DTensor):
        local = value.to_local().detach().clone()
        return DTensor.from_local(
            local, value.device_mesh, value.placements, shape=value.shape, stride=value.stride()
        )
    return value.detach().clone() if isinstance(value, torch.Tensor) else value


def load(state: dict, path: str, group=None) -> None:
    """Fill ``state``'s tensors in place from the checkpoint in ``path`` (every rank),
    once its files have matched their checksums; otherwise raise
    :class:`CheckpointError` on every rank, with ``state`` left as it was."""
    if not os.path.isdir(path):
        raise FileNotFoundError(f"no checkpoint at {path}: nothing was saved there")
    digests = manifest(path)  # .metadata checked before DCP reads it
    reader = VerifyingReader(path, digests, dist.get_rank(group), dist.get_world_size(group))
    try:
        dcp.load(state, storage_reader=reader, process_group=group)
    except (Exception, CheckpointException) as exc:  # CheckpointException: a BaseException
        rank, cause = first_failure(exc, dist.get_rank(group))
        if isinstance(cause, CheckpointError):  # a rank's files failed their checksums
            raise CheckpointError(str(cause)) from None
        raise CheckpointError(
            f"the checkpoint at {path} matches its checksums but cannot be loaded into this "
            f"state (rank {rank}, {describe(cause)}): check that the state has the keys and "
            "shapes that were saved"
        ) from None


def first_failure(exc: BaseException, rank: int) -> tuple[int, BaseException]:
    """The lowest failed rank and its exception. DCP raises a ``CheckpointException``
    whose ``failures`` map each failed rank to an ``(exception, traceback)`` pair; any
    other exception is ``rank``'s own."""
    failures = getattr(exc, "failures", None) or {rank: (exc, None)}
    return min(failures), failures[min(failures)][0]


def describe(exc: BaseException) -> str:
    """``Type: the first line of its message``, or the type alone (``EOFError()``)."""
    lines = str(exc).splitlines()
    return f"{type(exc).__name__}: {lines[0][:300]}" if lines else type(exc).__name__


def rng_state(group=None) -> dict:
    """This rank's random-number generators, under a key of its own: ``rank{r}``."""
    states = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and device().type == "cuda":
        states["cuda"] = torch.cuda.get_rng_state(device())
    return {f"rank{dist.get_rank(group)}": states}


def set_rng_state(state: dict, group=None) -> None:
    mine = state[f"rank{dist.get_rank(group)}"]
    torch.set_rng_state(mine["cpu"])
    if "cuda" in mine:
        torch.cuda.set_rng_state(mine["cuda"], device())


def _mesh(group) -> DeviceMesh:
    return DeviceMesh.from_group(group or dist.group.WORLD, device().type)


def _sharded(flat_shard: torch.Tensor, numel: int, mesh: DeviceMesh) -> DTensor:
    """This rank's shard of a flat buffer as a piece of the unpadded whole: the padding
    (at the end of the last ranks' shards) is not saved."""
    n, rank = flat_shard.numel(), mesh.get_local_rank()
    real = max(0, min(n, numel - rank * n))
    return DTensor.from_local(flat_shard[:real], mesh, [Shard(0)], shape=(numel,), stride=(1,))


def zero_parameters(zero, group=None) -> dict:
    """The ZeRO parameters, each unit's flat shard as a DTensor over the data-parallel
    ranks (``{"unit0": ..., ...}``): loading into them restores them in place."""
    mesh = _mesh(group)
    return {f"unit{i}": _sharded(u.shard, u.numel, mesh) for i, (_, u) in enumerate(zero.units)}


def zero_optimizer(zero, group=None) -> dict:
    """The Adam (or AdamW) states of the ZeRO shards, per unit, as DTensors over the
    data-parallel ranks: loading into them restores them in place.

    A unit's optimizer states are one tensor per parameter's piece
    (:mod:`labsupport.parallel.zero`), so they are first moved into one flat buffer per
    unit and state, and the pieces' states become views into it, which Adam goes on
    updating in place; a piece Adam has not stepped yet gets the state it would start
    from (zeros, step 0). The step counts, one per parameter, are the same on every rank:
    a plain tensor, which DCP keeps once."""
    if not isinstance(zero.optimizer, torch.optim.Adam):
        raise TypeError(
            f"zero_state saves Adam's and AdamW's states, not {type(zero.optimizer).__name__}'s;"
            " train with ZeRO(..., optimizer_class=torch.optim.Adam or torch.optim.AdamW)"
        )
    mesh, state, options = _mesh(group), {}, zero.optimizer.defaults
    keys = ["exp_avg", "exp_avg_sq"] + (["max_exp_avg_sq"] if options["amsgrad"] else [])
    on_device = options["capturable"] or options["fused"]  # Adam keeps its step there then
    for i, (_, unit) in enumerate(zero.units):
        flat = {key: torch.zeros_like(unit.shard) for key in keys}
        steps = torch.zeros(len(unit.pieces), device=unit.shard.device if on_device else "cpu")
        for j, (piece, (lo, hi)) in enumerate(zip(unit.pieces, unit.slices, strict=True)):
            adam = zero.optimizer.state[piece]
            if adam:
                steps[j] = adam["step"]
                for key in keys:
                    flat[key][lo:hi] = adam[key]
            adam.update({key: flat[key][lo:hi] for key in keys}, step=steps[j])
        state[f"unit{i}"] = {
            **{key: _sharded(flat[key], unit.numel, mesh) for key in keys},
            "steps": steps,
        }
    return state


def zero_state(zero, group=None) -> dict:
    """:func:`zero_parameters` and :func:`zero_optimizer` together, per unit:
    ``{"unit0": {"parameters": ..., "exp_avg": ..., "exp_avg_sq": ..., "steps": ...}}``."""
    parameters, optimizer = zero_parameters(zero, group), zero_optimizer(zero, group)
    return {unit: {"parameters": parameters[unit], **optimizer[unit]} for unit in parameters}


def restore_zero(zero) -> None:
    """After :func:`load` into :func:`zero_state`'s tensors: rebuild the full parameters
    where the stage keeps them (stages 1 and 2; stage 3 gathers before each use)."""
    if not zero.sharding.parameters:
        for _, unit in zero.units:
            unit.gather()
