"""The process-group mesh of 3D parallelism: which ranks share a tensor-, pipeline- and
data-parallel group.

Megatron-LM's ``megatron/core/parallel_state.py`` builds these groups in
``initialize_model_parallel`` and keeps them in module-level globals; PyTorch's
``init_device_mesh`` builds them from a mesh shape. :class:`Mesh` is an explicit object
instead (no global state): built from the sizes ``dp``, ``tp``, ``pp`` and an ``order``,
it answers which coordinates a rank has and which ranks form each group, and
:meth:`Mesh.process_groups` creates the ``torch.distributed`` groups.

The order lists the axes from the fastest-varying: with Megatron's default
``"tp-dp-pp"``, ``rank = tp_rank + tp · (dp_rank + dp · pp_rank)``, so a tensor-parallel
group is ``tp`` consecutive ranks, which a launcher places on one node, where NVLink is.
PyTorch's ``init_device_mesh("cuda", (pp, dp, tp))`` numbers ranks the same way (the last
dimension varies fastest); ``"dp-tp-pp"`` is another convention, which splits TP groups
across the GPUs of a node differently.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

import torch.distributed as dist

AXES = ("tp", "dp", "pp")


@dataclass
class Mesh:
    dp: int
    tp: int
    pp: int
    order: str = "tp-dp-pp"
    axes: tuple = field(init=False)

    def __post_init__(self):
        self.axes = tuple(self.order.split("-"))
        if sorted(self.axes) != sorted(AXES):
            raise ValueError(
                f"order must name tp, dp and pp once each, e.g. 'tp-dp-pp'; got {self.order!r}"
            )
        for axis in AXES:
            if getattr(self, axis) < 1:
                raise ValueError(f"{axis} must be at least 1, got {getattr(self, axis)}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.pp

    def size(self, axis: str) -> int:
        return getattr(self, axis)

    def coords(self, rank: int) -> dict:
        """``{"tp": ..., "dp": ..., "pp": ...}`` of ``rank``."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} is not in a mesh of {self.world_size} ranks")
        out = {}
        for axis in self.axes:
            rank, out[axis] = divmod(rank, self.size(axis))
        return out

    def rank_of(self, tp: int, dp: int, pp: int) -> int:
        coords, rank, stride = {"tp": tp, "dp": dp, "pp": pp}, 0, 1
        for axis in self.axes:
            rank += coords[axis] * stride
            stride *= self.size(axis)
        return rank

    def groups(self, axis: str) -> list[list[int]]:
        """Every group along ``axis``: the ranks that differ only in that coordinate."""
        others = [a for a in AXES if a != axis]
        found = []
        for fixed in itertools.product(*(range(self.size(a)) for a in others)):
            where = dict(zip(others, fixed, strict=True))
            found.append([self.rank_of(**where, **{axis: i}) for i in range(self.size(axis))])
        return sorted(found)

    def group_of(self, axis: str, rank: int) -> list[int]:
        return next(g for g in self.groups(axis) if rank in g)

    def embedding_groups(self) -> list[list[int]]:
        """The first and last stage of each pipeline: they hold the tied embedding."""
        return sorted(sorted({g[0], g[-1]}) for g in self.groups("pp"))

    def process_groups(self) -> dict:
        """Create every group (all ranks must call this, in the same order) and return
        this rank's: ``{"tp": ..., "dp": ..., "pp": ..., "embedding": ...}``."""
        if dist.get_world_size() != self.world_size:
            raise ValueError(
                f"a mesh of dp={self.dp} x tp={self.tp} x pp={self.pp} = {self.world_size} "
                f"ranks, but the world has {dist.get_world_size()}; launch "
                f"{self.world_size} ranks or change the sizes"
            )
        me, mine = dist.get_rank(), {}
        kinds = {axis: self.groups(axis) for axis in AXES}
        kinds["embedding"] = self.embedding_groups()
        for kind, groups in kinds.items():
            for ranks in groups:
                group = dist.new_group(ranks)
                if me in ranks:
                    mine[kind] = group
        return mine
