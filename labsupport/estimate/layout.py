"""A cluster and a layout on it: the planner's two inputs (:mod:`labsupport.estimate.planner`)."""

from __future__ import annotations

from dataclasses import dataclass

from labsupport.estimate.datasheets import ASSUMED_ALPHA


@dataclass(frozen=True)
class Cluster:
    """GPUs (a name of :data:`labsupport.estimate.datasheets.DEVICES`) in nodes; the
    bandwidths are bytes/s per GPU and direction, inside a node and across nodes."""

    name: str
    gpu: str
    gpus: int
    gpus_per_node: int
    intra_node: float
    inter_node: float
    alpha: float = ASSUMED_ALPHA


@dataclass(frozen=True)
class Layout:
    """How a run is laid out and what its framework does. ``chunks``: interleaved model
    chunks per pipeline rank; ``ep``: expert-parallel group size (it divides ``dp·cp``);
    ``dp_overlap``: the data-parallel reduction overlaps the last backward pass (``False``:
    it starts after the pipeline flush); ``a2a_overlap``: expert parallelism's all-to-alls
    hide behind compute; ``fused_attention``: FlashAttention (no score matrix in memory);
    ``fp8``: the linear layers' GEMMs in FP8."""

    dp: int
    tp: int
    pp: int
    zero: int = 1
    micro_batch: int = 1
    chunks: int = 1
    recompute: str = "selective"
    sequence_parallel: bool = True
    cp: int = 1
    ep: int = 1
    dp_overlap: bool = True
    a2a_overlap: bool = False
    fused_attention: bool = True
    fp8: bool = False

    @property
    def mesh(self) -> tuple:
        """``(dp, tp, pp)``, the 3D mesh; :attr:`axes` adds context and expert parallelism."""
        return (self.dp, self.tp, self.pp)

    @property
    def axes(self) -> tuple:
        return (self.dp, self.tp, self.cp, self.pp, self.ep)

    @property
    def gpus(self) -> int:
        return self.dp * self.tp * self.cp * self.pp
