"""ZeRO from scratch: data parallelism with the model states sharded over the ranks.

Rajbhandari et al. 2020, "ZeRO: Memory Optimizations Toward Training Trillion Parameter
Models". With ``N`` data-parallel ranks and Adam:

* **stage 1** shards the optimizer states: each rank's Adam keeps momentum and variance
  for ``1/N`` of the parameters. After backward the gradients are reduce-scattered (each
  rank gets the average of its shard), each rank steps its shard, and the updated
  shards are all-gathered: ``2Ψ`` elements through each rank's link, as DDP's all-reduce.
* **stage 2** also shards the gradients: as soon as the backward pass has produced
  every gradient of a unit (a transformer block, or the rest of the model), the unit's
  gradients are reduce-scattered and freed, so a rank never holds all of them at once
  and keeps ``1/N`` between steps (DeepSpeed does the same with buckets of
  ``reduce_bucket_size`` elements).
* **stage 3** also shards the parameters (as FSDP): each unit (a transformer block; the
  rest of the model, embeddings and head, as the root) is all-gathered before its
  forward, freed after, all-gathered again before its backward, and, once its
  gradients are complete, reduce-scattered and freed: ``3Ψ`` elements.

Parameters live in one flat fp32 buffer per unit (stage 1: one for the whole model),
padded to a multiple of ``N`` and split evenly; the model's parameters are views into
it, and this rank's shard of it is the parameter torch's ``Adam`` updates (the same
arithmetic as single-process Adam).
Collectives go through :mod:`labsupport.comm.traced`, so the labs can count them.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_flatten

from labsupport.comm import traced


class FlatUnit:
    """The parameters of one module as one flat buffer, padded and split over ranks."""

    def __init__(self, params: list[nn.Parameter], names: list[str], group, sharded: bool):
        self.params, self.names, self.group = params, names, group
        self.world, self.rank = dist.get_world_size(group), dist.get_rank(group)
        numel = sum(p.numel() for p in params)
        self.padded = math.ceil(numel / self.world) * self.world
        self.full = torch.zeros(self.padded, dtype=params[0].dtype, device=params[0].device)
        with torch.no_grad():
            torch.cat([p.detach().reshape(-1) for p in params], out=self.full[:numel])
        self.offsets, start = [], 0
        for p in params:
            self.offsets.append((start, start + p.numel()))
            start += p.numel()
        n = self.padded // self.world
        mine = self.full[self.rank * n : (self.rank + 1) * n]
        # stages 1-2: the shard is a slice of the full buffer, which stays; stage 3: a
        # tensor of its own, and the full buffer is freed between uses
        self.shard = nn.Parameter(mine.clone() if sharded else mine)

    def views(self, source: torch.Tensor) -> None:
        """Make every parameter a view into ``source``, a full-size flat tensor."""
        for p, (a, b) in zip(self.params, self.offsets, strict=True):
            p.data = source[a:b].view_as(p)

    def gather(self) -> None:
        """All-gather every rank's shard into the full buffer, reallocated if freed."""
        storage = self.full.untyped_storage()
        if storage.nbytes() == 0:
            storage.resize_(self.padded * self.full.element_size())
        self.full.copy_(traced.all_gather(self.shard.detach().clone(), 0, self.group))
        self.views(self.full)

    def flat_grad(self) -> torch.Tensor:
        grad = torch.zeros(self.padded, dtype=self.full.dtype, device=self.full.device)
        for p, (a, b) in zip(self.params, self.offsets, strict=True):
            if p.grad is not None:
                grad[a:b] = p.grad.reshape(-1)
        return grad

    def reduce_scatter_grads(self) -> None:
        """This rank's shard of the average gradient, in ``shard.grad``; the full ones go."""
        grad = traced.reduce_scatter(self.flat_grad(), 0, self.group) / self.world
        self.shard.grad = grad if self.shard.grad is None else self.shard.grad + grad
        for p in self.params:
            p.grad = None


class ZeRO:
    """Train ``model`` data-parallel with ZeRO ``stage`` (1, 2 or 3) and Adam.

    Use as ``loss.backward(); zero.step(); zero.zero_grad()``. Every rank must build
    the same model (same seed). ``adam`` holds keyword arguments for ``torch.optim.Adam``.
    """

    def __init__(self, model: nn.Module, stage: int, group=None, **adam):
        if stage not in (1, 2, 3):
            raise ValueError(f"ZeRO stage must be 1, 2 or 3, got {stage!r}")
        self.model, self.stage, self.group = model, stage, group
        modules = _units(model) if stage >= 2 else [model]
        self.units = []
        for module in modules:
            owned = [(n, p) for n, p in _direct_params(module, model, stage) if p.requires_grad]
            if owned:
                unit = FlatUnit([p for _, p in owned], [n for n, _ in owned], group, stage == 3)
                unit.views(unit.full)
                self.units.append((module, unit))
        self.optimizer = torch.optim.Adam([u.shard for _, u in self.units], **adam)
        if stage >= 2:
            for _, unit in self.units:
                for p in unit.params:
                    p.register_post_accumulate_grad_hook(lambda _p, u=unit: self._grad_ready(u))
            self._waiting = {}  # unit -> parameters whose gradient has not arrived yet
        if stage == 3:
            for module, unit in self.units:
                self._hook(module, unit)
            for _, unit in self.units:
                unit.full.untyped_storage().resize_(0)  # free: each rank keeps its shard

    # ---------------------------------------------------------------- stage 3: units

    def _hook(self, module: nn.Module, unit: FlatUnit) -> None:
        """Gather a unit before its forward, free it after, gather it before its backward;
        its last gradient frees it again (:meth:`_grad_ready`)."""
        module.register_forward_pre_hook(lambda *_: unit.gather())
        module.register_forward_hook(lambda _m, _i, output: _free_until_backward(unit, output))

    # ---------------------------------------------------------------- backward

    def _grad_ready(self, unit: FlatUnit) -> None:
        """Stages 2 and 3: when the last gradient of ``unit`` has been accumulated, no
        later part of the backward pass needs its weights or its full gradients."""
        if not self._waiting:  # the first gradient of this backward pass
            self._waiting = {id(u): len(u.params) for _, u in self.units}
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)
        self._waiting[id(unit)] -= 1
        if self._waiting[id(unit)] == 0:
            self._reduce(unit)

    def _reduce(self, unit: FlatUnit) -> None:
        """Reduce-scatter the unit's gradients, keep only this rank's shard, and
        (stage 3) free its gathered weights."""
        unit.reduce_scatter_grads()
        if self.stage == 3:
            _free(unit)

    def _end_of_backward(self) -> None:
        """Units some of whose parameters got no gradient in this backward pass are
        reduced now, in the same order on every rank."""
        for _, unit in self.units:
            if self._waiting[id(unit)] > 0:
                self._reduce(unit)
        self._waiting = {}

    def step(self) -> None:
        """Adam on this rank's shards, then (stages 1 and 2) all-gather the new parameters."""
        if self.stage == 1:
            for _, unit in self.units:
                unit.reduce_scatter_grads()
        self.optimizer.step()
        if self.stage < 3:
            for _, unit in self.units:
                unit.gather()

    def zero_grad(self) -> None:
        for _, unit in self.units:
            unit.shard.grad = None
            for p in unit.params:
                p.grad = None

    def state_bytes(self) -> dict:
        """Bytes this rank holds now, measured from the tensors: parameters, gradients and
        optimizer states (Adam's step counters apart)."""
        params = sum(u.full.untyped_storage().nbytes() for _, u in self.units)
        if self.stage == 3:
            params = sum(u.shard.nbytes for _, u in self.units)
        grads = sum(p.grad.nbytes for _, u in self.units for p in u.params if p.grad is not None)
        grads += sum(u.shard.grad.nbytes for _, u in self.units if u.shard.grad is not None)
        states = [self.optimizer.state[u.shard] for _, u in self.units]
        moments = [s[k] for s in states for k in ("exp_avg", "exp_avg_sq") if k in s]
        return {
            "parameters": params,
            "gradients": grads,
            "optimizer states": sum(m.nbytes for m in moments),
        }


def _free_until_backward(unit: FlatUnit, output) -> None:
    """Free the unit after its forward; gather it again when the first gradient of its
    outputs arrives, before autograd runs its backward."""
    _free(unit)
    gathered = []

    def regather(grad):
        if not gathered:
            gathered.append(True)
            unit.gather()
        return grad

    for t in tree_flatten(output)[0]:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(regather)


def _free(unit: FlatUnit) -> None:
    """Give back the full buffer's memory; the parameters' views point at nothing."""
    unit.full.untyped_storage().resize_(0)


def _units(model: nn.Module) -> list[nn.Module]:
    """Stage 3's units: every transformer block, then the model itself (the root: what
    remains, e.g. embeddings, final LayerNorm and the head)."""
    blocks = list(model.h) if hasattr(model, "h") else []
    return [*blocks, model]


def _direct_params(module: nn.Module, model: nn.Module, stage: int):
    """The parameters a unit owns: all of them at stage 1 (one unit); for the root at
    stages 2 and 3, those no block owns (a tied weight once)."""
    if stage < 2 or module is not model:
        return list(module.named_parameters())
    inside = {id(p) for b in _units(model)[:-1] for p in b.parameters()}
    return [(n, p) for n, p in model.named_parameters() if id(p) not in inside]
