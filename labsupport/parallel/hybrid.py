"""3D parallelism: data × tensor × pipeline parallel training of the course GPT, with
ZeRO on the data axis (the layout of Megatron-DeepSpeed's BLOOM-176B run, in miniature).

:class:`Hybrid3D` is one rank's part. Every rank builds the same GPT from a seed;
:class:`~labsupport.parallel.parallel_state.Mesh` gives it its coordinates and groups;
the model is split over the tensor-parallel group
(:class:`~labsupport.parallel.tensor_parallel_model.ParallelGPT`), cut into the pipeline
stage of its coordinate (:func:`~labsupport.parallel.pipeline_parallel.stage_modules`;
the rest of the model is dropped), run with the 1F1B schedule over the pipeline group
(the loss on logits split by vocabulary when tensor parallelism splits them,
:func:`vocab_parallel_loss`), and its stage's states sharded over the data-parallel
group (:class:`~labsupport.parallel.zero.ZeRO`, stage 1, which also averages the
gradients). The global batch is split over the data-parallel ranks, each share into
micro-batches. :func:`train_3d` is the training loop around it.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from labsupport.launch.runtime import device
from labsupport.models import GPT, GPTConfig, random_tokens, train_one_process
from labsupport.parallel import pipeline_parallel, schedules
from labsupport.parallel.parallel_state import Mesh
from labsupport.parallel.tensor_parallel import vocab_parallel_cross_entropy
from labsupport.parallel.tensor_parallel_model import ParallelGPT
from labsupport.parallel.zero import ZeRO


def global_batch(step: int, batch: int, config: GPTConfig):
    """The step's whole batch, the same on every rank: ``(idx, targets)``."""
    return random_tokens(batch, config.block_size, config.vocab_size, seed=1000 + step)


class Hybrid3D:
    """One rank's part of 3D-parallel training (built on every rank of a ``dp * tp * pp``
    world): its mesh coordinates and groups, its pipeline stage of the tensor-parallel
    GPT, the 1F1B schedule, and ZeRO-1 over its data-parallel group. A training loop
    calls :meth:`forward_backward` on each global batch, then :meth:`step`."""

    def __init__(
        self,
        config: dict,
        dp: int,
        tp: int,
        pp: int,
        microbatches: int,
        lr: float = 1e-3,
        seed: int = 0,
        order: str = "tp-dp-pp",
    ):
        self.config, self.dp, self.microbatches = GPTConfig(**config), dp, microbatches
        self.mesh = Mesh(dp, tp, pp, order)
        self.groups = self.mesh.process_groups()
        self.rank = dist.get_rank()
        self.coords = self.mesh.coords(self.rank)
        torch.manual_seed(seed)
        model = GPT(self.config).to(device())
        # dropout: each pipeline stage draws its own masks, as Megatron seeds seed + 100 x
        # its pipeline rank (replicated regions: the default generator; split ones: per TP rank)
        torch.manual_seed(seed + 100 * self.coords["pp"])
        self.loss_fn = pipeline_parallel.cross_entropy
        if tp > 1:
            tp_group = self.groups["tp"]
            model = ParallelGPT(model, group=tp_group, seed=seed + 100 * self.coords["pp"])
            start = model.wte.start
            self.loss_fn = functools.partial(vocab_parallel_loss, start=start, group=tp_group)
        self.chunks = pipeline_parallel.stage_modules(model, pp, self.coords["pp"])
        self.stage = self.chunks[0]  # the other stages' modules go with ``model``
        self.zero = ZeRO(self.stage, 1, group=self.groups["dp"], lr=lr)
        self.actions = schedules.one_f_one_b(pp, microbatches, self.coords["pp"])

    def forward_backward(self, idx, targets) -> float | None:
        """Forward and backward of this data-parallel rank's share of the global batch
        ``(idx, targets)``, in micro-batches through the pipeline (1F1B): the gradients
        accumulate in the stage. On the last stage, returns the loss of the whole global
        batch (the mean over the micro-batches and the data-parallel ranks)."""
        batch = idx.size(0)
        if batch % (self.dp * self.microbatches):
            raise ValueError(
                f"a global batch of {batch} does not split into {self.dp} data-parallel "
                f"shares of {self.microbatches} micro-batches; use a multiple of "
                f"{self.dp * self.microbatches}"
            )
        share = batch // self.dp
        micro = share // self.microbatches
        mine = slice(self.coords["dp"] * share, (self.coords["dp"] + 1) * share)
        out = pipeline_parallel.run(
            self.chunks,
            self.actions,
            list(idx[mine].split(micro)),
            list(targets[mine].split(micro)),
            (micro, self.config.block_size, self.config.n_embd),
            group=self.groups["pp"],
            embedding_group=self.groups.get("embedding"),
            loss_fn=self.loss_fn,
        )
        if not self.stage.last:
            return None
        loss = torch.tensor([sum(out["losses"].values()) / self.microbatches], device=device())
        dist.all_reduce(loss, group=self.groups["dp"])
        return loss.item() / self.dp

    def step(self) -> None:
        """ZeRO-1's step: reduce-scatter the stage's gradients over the data-parallel
        group, Adam on this rank's shard, all-gather the new weights; then zero the
        gradients."""
        self.zero.step()
        self.zero.zero_grad()

    def placement(self) -> dict:
        """This rank, its coordinates and the ranks of its three groups."""
        groups = {axis: self.mesh.group_of(axis, self.rank) for axis in ("tp", "dp", "pp")}
        return {"rank": self.rank, "coords": self.coords, "groups": groups}


def train_3d(
    config: dict,
    dp: int,
    tp: int,
    pp: int,
    microbatches: int,
    steps: int,
    batch: int,
    lr: float = 1e-3,
    seed: int = 0,
    order: str = "tp-dp-pp",
) -> dict:
    """Train for ``steps`` steps (run on every rank of a ``dp * tp * pp`` world).

    Returns this rank's coordinates, the ranks of its groups and, on the last pipeline
    stage, the loss of each step (the mean over the whole global batch).
    """
    model = Hybrid3D(config, dp, tp, pp, microbatches, lr, seed, order)
    losses = []
    for step in range(steps):
        loss = model.forward_backward(*global_batch(step, batch, model.config))
        model.step()
        if loss is not None:
            losses.append(loss)
    return model.placement() | {"losses": losses}


def vocab_parallel_loss(logits, targets, start: int, group):
    """The tensor-parallel GPT's loss, on logits split by vocabulary: the mean over every
    position of :func:`~labsupport.parallel.tensor_parallel.vocab_parallel_cross_entropy`."""
    return vocab_parallel_cross_entropy(logits, targets, start, group).mean()


def train_single(config: dict, steps: int, batch: int, lr: float = 1e-3, seed: int = 0):
    """The reference: one process, the whole batch, Adam. Returns the loss of each step."""
    cfg = GPTConfig(**config)
    torch.manual_seed(seed)
    model = GPT(cfg)
    opt = torch.optim.Adam(model.parameters(), lr=lr)
    return train_one_process(model, opt, (global_batch(step, batch, cfg) for step in range(steps)))
