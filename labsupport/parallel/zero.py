"""ZeRO from scratch: data parallelism with the model states sharded over the ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models". With ``N`` data-parallel ranks, **stage 1** shards the optimizer states: at the
step the gradients are reduce-scattered (each rank gets the average of its shard), each
rank steps its shard, and the new shards are all-gathered: ``2Ψ`` elements through each
rank's link, as DDP's all-reduce. **Stage 2** also shards the gradients: once the
backward pass has finished a unit (a transformer block, or the rest of the model, the
root), the unit's gradients are reduce-scattered and freed. **Stage 3** also shards the
parameters (as FSDP): a unit is all-gathered before its forward, freed after, gathered
again for its backward and freed once its gradients are reduce-scattered: ``3Ψ``. What a
stage shards is decided once, as a :class:`Sharding` (torchtitan's ``simple_fsdp`` turns
its mode into a placement the same way), and one code path follows it.

Parameters live in one flat buffer per unit (stage 1: one for the whole model), padded to
a multiple of ``N`` and split evenly; the model's parameters are views into it, and the
collectives move whole buffers. The optimizer steps one *piece* per parameter, the part
of it in this rank's shard (a view, empty where none of it is), as FSDP2 steps each
parameter's shard: so each piece has its own ``.grad`` and its own state (Adam's step
count too), and torch's optimizer does what it does in one process. A parameter that no
rank used gets ``.grad = None`` and is skipped; one some ranks used gets the average over
all ranks, the others counting zeros, as DDP gives. The ranks agree which parameters got
a gradient with one all-reduce of a byte per parameter, as DDP all-reduces its
``local_used_map_`` (``torch/csrc/distributed/c10d/reducer.hpp``). This is exact for the
optimizers that update each element from its own gradient and state (:data:`ELEMENTWISE`).

Every rank calls the same collectives in the same order: stages 2 and 3 reduce a unit
when autograd has finished its backward (:class:`~labsupport.parallel.backward_hooks.
AfterBackward`), the same point of the graph on every rank whichever parameters each
used; the root at the end of the backward pass. Stage 3 needs every rank to run every
unit's forward, as FSDP does; with ``prefetch=k`` it starts gathering the next ``k``
units while one runs, as FSDP2 prefetches, in the units' order, the same on every rank.
Collectives go through :mod:`labsupport.comm.traced`, so the labs can count them.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.optim import ASGD, SGD, Adadelta, Adagrad, Adam, Adamax, NAdam, RAdam, RMSprop, Rprop

from labsupport.comm import traced
from labsupport.parallel.backward_hooks import AfterBackward, on_first_grad


@dataclass(frozen=True)
class Sharding:
    """What a stage shards besides the optimizer states, which every stage shards."""

    gradients: bool  # each unit reduce-scattered as its backward ends, only the shard kept
    parameters: bool  # each unit's weights freed after use and all-gathered before


STAGES = {1: Sharding(False, False), 2: Sharding(True, False), 3: Sharding(True, True)}

#: torch's optimizers that update every element from its own gradient and state alone, so
#: stepping a piece of a parameter gives the same numbers as stepping all of it.
ELEMENTWISE = (SGD, Adam, Adamax, NAdam, RAdam, Adagrad, Adadelta, RMSprop, ASGD, Rprop)


class FlatUnit:
    """The parameters of one module in one flat buffer, padded to a multiple of the ranks
    and split evenly: this rank's shard of it, and each parameter's piece of that shard."""

    def __init__(self, named: list, group, own_shard: bool):
        self.names, self.params = [n for n, _ in named], [p for _, p in named]
        self.group, self.world = group, dist.get_world_size(group)
        self.numel = sum(p.numel() for p in self.params)
        self.padded = math.ceil(self.numel / self.world) * self.world
        first = self.params[0]
        self.full = torch.zeros(self.padded, dtype=first.dtype, device=first.device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in self.params], out=self.full[: self.numel])
        ends = itertools.accumulate(p.numel() for p in self.params)
        self.offsets = [(b - p.numel(), b) for p, b in zip(self.params, ends, strict=True)]
        n = self.padded // self.world
        start = dist.get_rank(group) * n
        mine = self.full[start : start + n]
        # stages 1-2: the shard is a slice of the full buffer, which stays; stage 3: a
        # tensor of its own, and the full buffer is freed between uses
        self.shard = mine.clone() if own_shard else mine
        self.slices = [tuple(min(max(x - start, 0), n) for x in ab) for ab in self.offsets]
        self.pieces = [nn.Parameter(self.shard[lo:hi]) for lo, hi in self.slices]
        self.grad = None  # this rank's shard of the average gradient
        self.used = [False] * len(self.params)  # which parameters got a gradient here
        self.views(self.full)

    def views(self, source: torch.Tensor) -> None:
        """Make every parameter a view into ``source``, a full-size flat tensor."""
        for p, (a, b) in zip(self.params, self.offsets, strict=True):
            p.data = source[a:b].view_as(p)

    def gather(self) -> None:
        """All-gather every rank's shard into the full buffer, reallocated if freed."""
        self.finish(self.start())

    def start(self):
        """Start :meth:`gather`'s all-gather and return it (stage 3 prefetches with it)."""
        return traced.all_gather(self.shard.detach().clone(), 0, self.group, async_op=True)

    def finish(self, started) -> None:
        """Wait for the all-gather :meth:`start` began and copy it into the full buffer,
        reallocated if freed (the same storage: autograd saved views of it)."""
        out, work = started
        work.wait()
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        self.full.copy_(out)
        self.views(self.full)

    def gathered_bytes(self) -> int:
        return self.full.untyped_storage().nbytes()

    def free(self) -> None:
        """Give back the full buffer's memory; the parameters' views point at nothing."""
        self.full.untyped_storage().resize_(0)

    def reduce_scatter_grads(self) -> None:
        """Add this rank's shard of the average gradient to ``self.grad`` (a parameter
        without a gradient here counts zeros); note which had one; the full ones go."""
        flat = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        for i, (p, (a, b)) in enumerate(zip(self.params, self.offsets, strict=True)):
            if p.grad is not None:
                flat[a:b] = p.grad.reshape(-1)
                self.used[i], p.grad = True, None
        grad = traced.reduce_scatter(flat, 0, self.group) / self.world
        self.grad = grad if self.grad is None else self.grad + grad

    def set_piece_grads(self, used: list) -> None:
        """Each piece's gradient: its part of ``self.grad``, or None where no rank used it."""
        for piece, (lo, hi), u in zip(self.pieces, self.slices, used, strict=True):
            piece.grad = self.grad[lo:hi] if u else None


class ZeRO:
    """Train ``model`` data-parallel with ZeRO ``stage`` (1, 2 or 3).

    Use as ``loss.backward(); zero.step(); zero.zero_grad()``. Every rank must build the
    same model (same seed). The optimizer is given as torch's ``ZeroRedundancyOptimizer``
    takes it, a class and its keyword arguments, ``ZeRO(model, 2,
    optimizer_class=torch.optim.AdamW, lr=1e-3, weight_decay=0.1)``; Adam by default. Every
    parameter gets the same options (one parameter group).
    """

    def __init__(
        self, model: nn.Module, stage: int, group=None, optimizer_class=Adam, prefetch=0, **defaults
    ):
        if stage not in STAGES:
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        if prefetch and stage != 3:
            raise ValueError(f"only stage 3 gathers units to prefetch; got prefetch={prefetch}")
        optimizer_class = _elementwise(optimizer_class)
        self.model, self.stage, self.group = model, stage, group
        self.sharding = shard = STAGES[stage]
        self.units, names = [], {id(p): n for n, p in model.named_parameters()}
        # stages 2 and 3's units: every transformer block, then the root, which owns what
        # remains (embeddings, final LayerNorm, head); a tied weight goes to the first
        for module in [*getattr(model, "h", []), model] if shard.gradients else [model]:
            owned = [(names.pop(id(p)), p) for p in module.parameters() if id(p) in names]
            owned = [(n, p) for n, p in owned if p.requires_grad]
            if owned:
                self.units.append((module, FlatUnit(owned, group, shard.parameters)))
        pieces = [piece for _, unit in self.units for piece in unit.pieces]
        self.optimizer = optimizer_class(pieces, **defaults)
        self._reduced, self._queued = set(), False  # this backward pass's reductions
        self.prefetch, self._started, self.gathered_peak = prefetch, {}, 0
        units = [u for _, u in self.units]  # the root runs first and its backward first
        self._next = {True: [units[-1], *units[:-1]], False: [units[-1], *units[-2::-1]]}
        for module, unit in self.units:
            if shard.parameters:
                module.register_forward_pre_hook(lambda *_, u=unit: self._gather(u, True))
                module.register_forward_hook(lambda _m, _i, out, u=unit: self._used(u, out))
                unit.free()  # each rank keeps its shard
            if shard.gradients and module is not model:
                module.register_forward_pre_hook(
                    lambda _m, args, u=unit: AfterBackward.wrap(args, lambda: self._reduce(u))
                )
        if shard.gradients:
            model.register_forward_hook(lambda _m, _i, out: on_first_grad(out, self._begin))

    def _used(self, unit: FlatUnit, output) -> None:
        """Stage 3, after a unit's forward: free it, and gather it again as soon as the
        backward pass reaches its outputs, before autograd runs its backward."""
        unit.free()
        on_first_grad(output, lambda: self._gather(unit, False))

    def _gather(self, unit: FlatUnit, forward: bool) -> None:
        """Stage 3: make ``unit`` whole (its prefetched all-gather waited for, or one now),
        then start gathering the next ``prefetch`` units of this pass, as FSDP2 does: in
        the order the units run, the same on every rank, so the collectives match."""
        started = self._started.pop(id(unit), None)
        if started is not None:
            unit.finish(started)
        elif unit.gathered_bytes() == 0:
            unit.gather()
        order = self._next[forward]
        for later in order[order.index(unit) + 1 :][: self.prefetch]:
            if id(later) not in self._started and later.gathered_bytes() == 0:
                self._started[id(later)] = later.start()
        held = sum(u.gathered_bytes() for u in order)
        held += sum(out.untyped_storage().nbytes() for out, _ in self._started.values())
        self.gathered_peak = max(self.gathered_peak, held)

    def _begin(self) -> None:
        """The backward pass reached the model's outputs: reduce what is left at its end."""
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _reduce(self, unit: FlatUnit) -> None:
        """Once a unit's backward is over (stage 1: at the step), nothing later needs its
        full gradients (stage 3: nor its weights)."""
        self._reduced.add(id(unit))
        if id(unit) in self._started:  # prefetched, and no gradient reached it here
            unit.finish(self._started.pop(id(unit)))
        unit.reduce_scatter_grads()
        if self.sharding.parameters:
            unit.free()

    def _end_of_backward(self) -> None:
        """Reduce the units not reduced yet (the root at least), in the same order on every
        rank; refuse a gradient that came after its unit had been reduced."""
        units = [unit for _, unit in self.units]
        for unit in units:
            if id(unit) not in self._reduced:
                self._reduce(unit)
        self._reduced, self._queued = set(), False
        late = [u.names[i] for u in units for i, p in enumerate(u.params) if p.grad is not None]
        if late:
            raise RuntimeError(
                f"ZeRO: {late} got a gradient after their unit's backward had ended: a "
                "parameter used outside the module that owns it (tied across two blocks?). "
                "Use stage 1, or keep a shared parameter in the model's root."
            )

    def step(self) -> None:
        """The optimizer on this rank's pieces, then (stages 1 and 2) all-gather the new
        parameters."""
        if not self.sharding.gradients:  # stage 1 reduce-scatters the whole model here
            for _, unit in self.units:
                self._reduce(unit)
        units = [unit for _, unit in self.units]
        flags = [used for unit in units for used in unit.used]
        flags = torch.tensor(flags, dtype=torch.uint8, device=units[0].full.device)
        agreed = iter(traced.all_reduce(flags, self.group, op=dist.ReduceOp.MAX).tolist())
        for unit in units:
            unit.set_piece_grads([next(agreed) for _ in unit.pieces])
        self.optimizer.step()
        if not self.sharding.parameters:
            for unit in units:
                unit.gather()

    def zero_grad(self) -> None:
        self._reduced = set()
        for _, unit in self.units:
            unit.grad, unit.used = None, [False] * len(unit.params)
            for p in (*unit.params, *unit.pieces):
                p.grad = None

    def state_bytes(self) -> dict:
        """Bytes this rank holds now, measured from the tensors: parameters, gradients and
        optimizer states (their step counts apart)."""
        units = [unit for _, unit in self.units]
        # a stage-1 or stage-2 shard is part of the full buffer: each storage once
        storages = {t.untyped_storage().data_ptr(): t for u in units for t in (u.full, u.shard)}
        grads = sum(p.grad.nbytes for u in units for p in u.params if p.grad is not None)
        grads += sum(u.grad.nbytes for u in units if u.grad is not None)
        states = [self.optimizer.state.get(piece, {}) for u in units for piece in u.pieces]
        return {
            "parameters": sum(t.untyped_storage().nbytes() for t in storages.values()),
            "gradients": grads,
            "optimizer states": sum(
                t.nbytes for s in states for t in s.values() if torch.is_tensor(t) and t.dim()
            ),
        }


def _elementwise(optimizer_class):
    if not (isinstance(optimizer_class, type) and issubclass(optimizer_class, ELEMENTWISE)):
        names = ", ".join(c.__name__ for c in ELEMENTWISE)
        raise TypeError(
            f"ZeRO takes an optimizer class and its options, e.g. optimizer_class="
            f"torch.optim.AdamW, lr=1e-3; got {optimizer_class!r}. Each rank steps flat "
            "pieces of the parameters, which gives the whole parameter's result only for an "
            f"optimizer that updates every element from that element alone: {names}. One "
            "that reads a whole tensor (its norm, as LAMB; its rows and columns, as "
            "Adafactor; its matrix, as Muon) would compute something else."
        )
    return optimizer_class
