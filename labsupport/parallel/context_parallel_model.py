"""The course GPT with context parallelism, and with context × data parallelism.

Every block of the model is unchanged but its attention: each rank holds ``s/cp`` tokens
of every sequence (in a :class:`~labsupport.parallel.context_parallel.Layout`), runs the
embeddings, LayerNorms, MLPs and the loss on them alone (they treat each token apart),
and the attention sees the whole sequence through one of the three context-parallel
attentions. The position embedding takes each token's position in the whole sequence.

* :func:`context_parallel_attention`: ring, all-gather or Ulysses, by name;
* :class:`ContextParallelGPT`: a :class:`labsupport.models.GPT` whose attention is
  context-parallel (the model's ``attention_fn`` option), fed this rank's tokens;
* :func:`cp_dp_groups`: the groups of a ``cp × dp`` mesh, context parallelism inside
  (Llama 3's order [TP, CP, PP, DP]; Megatron-LM's default ``tp-cp-ep-dp-pp`` too);
* :func:`train`: the GPT trained ``cp × dp``. The gradients are averaged over the
  context- *and* data-parallel ranks together, as Megatron-LM (its data-parallel group
  "with context parallel") and DeepSpeed-Ulysses do: every rank's loss is the mean over
  its own tokens, so the average of the ranks' gradients is the whole batch's.
"""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist
from torch import nn

from labsupport.comm import traced
from labsupport.launch.runtime import device
from labsupport.models import GPT, GPTConfig
from labsupport.parallel.context_parallel import make_layout, ring_attention, shard_sequence
from labsupport.parallel.context_parallel_variants import allgather_attention, ulysses_attention
from labsupport.parallel.data_parallel import all_reduce_gradients
from labsupport.parallel.hybrid import global_batch

VARIANTS = {"ring": ring_attention, "all_gather": allgather_attention, "ulysses": ulysses_attention}


def context_parallel_attention(q, k, v, group=None, causal=True, layout="zigzag", variant="ring"):
    """Context-parallel attention by ``variant``: ``"ring"``, ``"all_gather"``, ``"ulysses"``."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {', '.join(VARIANTS)}, got {variant!r}")
    return VARIANTS[variant](q, k, v, group=group, causal=causal, layout=layout)


class ContextParallelGPT(nn.Module):
    """``gpt`` (its own weights, shared, not copied) run on this rank's tokens of every
    sequence, its attention over ``group``. ``forward(idx, targets)`` takes this rank's
    token ids (:func:`shard_sequence` of the whole batch) and returns its logits and the
    mean loss over its tokens."""

    def __init__(self, gpt: GPT, group=None, layout="zigzag", variant="ring"):
        super().__init__()
        if gpt.config.dropout:
            raise ValueError(
                "context-parallel attention has no attention dropout: build the GPT with "
                f"dropout=0.0 (it has {gpt.config.dropout})"
            )
        self.gpt, self.group = gpt, group
        self.cp, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.layout = make_layout(layout, self.cp)
        attend = functools.partial(
            context_parallel_attention, group=group, layout=self.layout, variant=variant
        )
        for block in gpt.h:
            block.attn.attention_fn = attend

    def positions(self, local_tokens: int) -> torch.Tensor:
        """Where this rank's tokens sit in the whole sequence."""
        return self.layout.positions(self.rank, local_tokens * self.cp).to(device())

    def forward(self, idx, targets=None):
        x = self.gpt.embed(idx, pos=self.positions(idx.size(1)))
        for block in self.gpt.h:
            x = self.gpt.run_block(block, x)
        return self.gpt.head(x, targets)


def cp_dp_groups(cp: int, dp: int) -> dict:
    """Create the groups of a ``cp × dp`` world (every rank calls this): global rank
    ``cp_rank + cp · dp_rank``. Returns this rank's ``{"cp", "dp", "cp_dp"}`` groups and
    its coordinates ``{"cp_rank", "dp_rank"}``."""
    world, rank = dist.get_world_size(), dist.get_rank()
    if cp * dp != world:
        raise ValueError(f"cp={cp} x dp={dp} = {cp * dp} ranks, but the world has {world}")
    mine = {"cp_rank": rank % cp, "dp_rank": rank // cp}
    for d in range(dp):
        group = dist.new_group([d * cp + c for c in range(cp)])
        if d == mine["dp_rank"]:
            mine["cp"] = group
    for c in range(cp):
        group = dist.new_group([d * cp + c for d in range(dp)])
        if c == mine["cp_rank"]:
            mine["dp"] = group
    mine["cp_dp"] = dist.group.WORLD
    return mine


def train(config: dict, cp: int, dp: int, steps: int, batch: int, lr: float = 1e-3, **kw):
    """Train the course GPT ``cp × dp`` with Adam for ``steps`` steps (run on every
    rank); ``kw`` may set ``layout``, ``variant`` and ``seed``. Each step's global batch
    is :func:`labsupport.parallel.hybrid.global_batch`'s, so that
    :func:`labsupport.parallel.hybrid.train_single` is the one-process reference.
    Returns the rank's coordinates and the loss of each step over the whole batch."""
    layout, variant, seed = kw.get("layout", "zigzag"), kw.get("variant", "ring"), kw.get("seed", 0)
    if batch % dp:
        raise ValueError(f"a batch of {batch} sequences does not split over dp={dp} ranks")
    groups = cp_dp_groups(cp, dp)
    cfg = GPTConfig(**config)
    torch.manual_seed(seed)
    model = ContextParallelGPT(GPT(cfg).to(device()), groups["cp"], layout, variant)
    optimizer = torch.optim.Adam(model.parameters(), lr=lr)
    share, losses = batch // dp, []
    for step in range(steps):
        idx, targets = global_batch(step, batch, cfg)
        rows = slice(groups["dp_rank"] * share, (groups["dp_rank"] + 1) * share)
        idx, targets = (
            shard_sequence(t[rows].to(device()), 1, groups["cp"], layout) for t in (idx, targets)
        )
        _, loss = model(idx, targets)  # the mean over this rank's tokens
        optimizer.zero_grad()
        loss.backward()
        all_reduce_gradients(model, groups["cp_dp"])  # the mean over every rank's tokens
        optimizer.step()
        total = traced.all_reduce(loss.detach().clone(), groups["cp_dp"])
        losses.append(total.item() / (cp * dp))
    where = {"cp_rank": groups["cp_rank"], "dp_rank": groups["dp_rank"]}
    return {"rank": dist.get_rank(), **where, "losses": losses}
