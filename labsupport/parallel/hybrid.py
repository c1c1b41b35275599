"""3D parallelism: data × tensor × pipeline parallel training of the course GPT, with
ZeRO on the data axis (the layout of Megatron-DeepSpeed's BLOOM-176B run, in miniature).

Every rank builds the same GPT from a seed; :class:`~labsupport.parallel.parallel_state.
Mesh` gives it its coordinates and groups; the model is split over the tensor-parallel
group (:class:`~labsupport.parallel.tensor_parallel_model.ParallelGPT`), cut into the
pipeline stage of its coordinate (:func:`~labsupport.parallel.pipeline_parallel.
stage_modules`; the rest of the model is dropped), run with the 1F1B schedule over the
pipeline group (the loss on logits split by vocabulary when tensor parallelism splits
them, :func:`vocab_parallel_loss`), and its stage's states sharded over the data-parallel
group (:class:`~labsupport.parallel.zero.ZeRO`, stage 1, which also averages the
gradients). The global batch is split over the data-parallel ranks, each share into
micro-batches.
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
    cfg = GPTConfig(**config)
    mesh = Mesh(dp, tp, pp, order)
    groups = mesh.process_groups()
    rank = dist.get_rank()
    where = mesh.coords(rank)
    if batch % (dp * microbatches):
        raise ValueError(
            f"a global batch of {batch} does not split into {dp} data-parallel shares of "
            f"{microbatches} micro-batches; use a multiple of {dp * microbatches}"
        )
    torch.manual_seed(seed)
    model = GPT(cfg).to(device())
    # dropout: each pipeline stage draws its own masks, as Megatron seeds seed + 100 x its
    # pipeline rank (replicated regions: the default generator; split ones: per TP rank)
    torch.manual_seed(seed + 100 * where["pp"])
    loss_fn = pipeline_parallel.cross_entropy
    if tp > 1:
        model = ParallelGPT(model, group=groups["tp"], seed=seed + 100 * where["pp"])
        loss_fn = functools.partial(vocab_parallel_loss, start=model.wte.start, group=groups["tp"])
    chunks = pipeline_parallel.stage_modules(model, pp, where["pp"])
    stage = chunks[0]
    del model  # the stage holds its own modules: the other stages' can go
    zero = ZeRO(stage, 1, group=groups["dp"], lr=lr)
    actions = schedules.one_f_one_b(pp, microbatches, where["pp"])
    share = batch // dp
    micro = share // microbatches
    losses = []
    for step in range(steps):
        idx, targets = global_batch(step, batch, cfg)
        mine = slice(where["dp"] * share, (where["dp"] + 1) * share)
        out = pipeline_parallel.run(
            chunks,
            actions,
            list(idx[mine].split(micro)),
            list(targets[mine].split(micro)),
            (micro, cfg.block_size, cfg.n_embd),
            group=groups["pp"],
            embedding_group=groups.get("embedding"),
            loss_fn=loss_fn,
        )
        zero.step()
        zero.zero_grad()
        if stage.last:
            loss = torch.tensor([sum(out["losses"].values()) / microbatches], device=device())
            dist.all_reduce(loss, group=groups["dp"])
            losses.append(loss.item() / dp)
    return {
        "rank": rank,
        "coords": where,
        "groups": {axis: mesh.group_of(axis, rank) for axis in ("tp", "dp", "pp")},
        "losses": losses,
    }


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
