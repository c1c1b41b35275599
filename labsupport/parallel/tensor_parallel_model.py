"""The course GPT, tensor-parallel: its blocks, embedding and head split over ``t`` ranks.

Built from a dense :class:`labsupport.models.GPT` (same weights, so a test can hold
every output and gradient against the dense model's), with the layers of
:mod:`labsupport.parallel.tensor_parallel`:

* attention: ``c_attn`` column-parallel, each rank the Q, K and V of ``n_head / t``
  heads; the heads' attention computed locally; ``c_proj`` row-parallel;
* MLP: ``c_fc`` column-parallel, ``c_proj`` row-parallel;
* LayerNorms replicated; with ``sequence_parallel`` they (and the dropouts, and the
  row-parallel layers' biases) work on ``1/t`` of the sequence each, and
  :func:`all_reduce_sequence_parallel_grads` sums their gradients over the ranks after
  backward (Korthikanti et al. 2022, section 4.2.2);
* dropout where the ranks hold different data (inside the split attention, and the
  residual dropouts under sequence parallelism, which see different tokens) draws from
  the rank's own generator state, one per rank shared by all the blocks of a model
  (:class:`RankRNGTracker`, Megatron's ``get_cuda_rng_tracker()``), so each layer draws
  new masks; dropout in the replicated regions draws from the default generator, seeded
  alike on every rank (the same mask on every rank);
* the token embedding and the output layer split by vocabulary (padded to a multiple of
  ``t``), the loss computed without gathering the logits.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.parallel.tensor_parallel import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    _divide,
    copy_to_tensor_model_parallel_region,
    vocab_parallel_cross_entropy,
)


def _rows(weight: torch.Tensor, parts: int, rank: int, pieces: int = 1) -> torch.Tensor:
    """This rank's slice of each of ``pieces`` equal row blocks (Q, K, V: pieces = 3)."""
    return torch.cat([w.chunk(parts)[rank] for w in weight.chunk(pieces)])


class RankRNGTracker:
    """A generator state of this rank's own, for dropout where the ranks hold different
    data: Megatron's ``CudaRNGStatesTracker`` (``megatron/core/tensor_parallel/random.py``),
    for the CPU and CUDA. Build one per model and rank, seeded ``seed + 2718 + rank`` as
    Megatron's ``model_parallel_cuda_manual_seed``; every block draws from it in turn."""

    def __init__(self, seed: int):
        self.seed = seed
        self.states: dict[str, torch.Tensor] = {}  # one per device

    @contextlib.contextmanager
    def fork(self, device):
        """Swap this state into ``device``'s default generator, run the ``with`` block,
        save the advanced state for the next fork and give the generator its own back
        (on CUDA, the GPU's generator; on the CPU, the CPU's, without touching CUDA)."""
        device = torch.device(device)
        if device.type == "cpu":
            get, put = torch.get_rng_state, torch.set_rng_state
        else:
            module = torch.get_device_module(device.type)
            if device.index is None:
                device = torch.device(device.type, module.current_device())
            get = functools.partial(module.get_rng_state, device)
            put = functools.partial(module.set_rng_state, device=device)
        key = str(device)
        if key not in self.states:
            self.states[key] = torch.Generator(device).manual_seed(self.seed).get_state()
        devices = [] if device.type == "cpu" else [device]
        with torch.random.fork_rng(devices=devices, device_type=device.type):
            put(self.states[key])
            try:
                yield
            finally:
                self.states[key] = get()


def rank_tracker(group=None, seed: int = 0) -> RankRNGTracker:
    """A :class:`RankRNGTracker` seeded ``seed + 2718 +`` this rank's place in ``group``."""
    return RankRNGTracker(seed + 2718 + dist.get_rank(group))


class ParallelBlock(nn.Module):
    """One transformer block of the course GPT, split over the ranks of ``group``. Its
    sharded dropouts draw from ``rng`` (a model's blocks share one; a block built alone
    gets its own, :func:`rank_tracker`)."""

    def __init__(self, block, config, group=None, sequence_parallel: bool = False, rng=None):
        super().__init__()
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        c = config.n_embd
        self.heads = _divide(config.n_head, t, "n_head")
        _divide(4 * c, t, "4 * n_embd")
        self.group, self.sequence_parallel, self.config = group, sequence_parallel, config
        self.ln_1, self.ln_2 = _copy(block.ln_1), _copy(block.ln_2)
        sp = {"sequence_parallel": sequence_parallel, "group": group}
        bias = config.bias
        self.c_attn = ColumnParallelLinear(c, 3 * c, bias=bias, **sp)
        self.attn_proj = RowParallelLinear(c, c, bias=bias, **sp)
        self.c_fc = ColumnParallelLinear(c, 4 * c, bias=bias, **sp)
        self.mlp_proj = RowParallelLinear(4 * c, c, bias=bias, **sp)
        dense = block.attn.c_attn, block.attn.c_proj, block.mlp.c_fc, block.mlp.c_proj
        with torch.no_grad():
            self.c_attn.weight.copy_(_rows(dense[0].weight, t, rank, 3))
            self.attn_proj.weight.copy_(dense[1].weight.chunk(t, dim=1)[rank])
            self.c_fc.weight.copy_(dense[2].weight.chunk(t)[rank])
            self.mlp_proj.weight.copy_(dense[3].weight.chunk(t, dim=1)[rank])
            if bias:
                self.c_attn.bias.copy_(_rows(dense[0].bias, t, rank, 3))
                self.c_fc.bias.copy_(dense[2].bias.chunk(t)[rank])
                self.attn_proj.bias.copy_(dense[1].bias)
                self.mlp_proj.bias.copy_(dense[3].bias)
        self.rng = rng if rng is not None else rank_tracker(group)

    def forward(self, x):
        a = self.attn_proj(self._attention(self.ln_1(x)))
        with self._residual_rng(x):
            x = x + F.dropout(a, self.config.dropout, self.training)
        h = self.mlp_proj(F.gelu(self.c_fc(self.ln_2(x))))
        with self._residual_rng(x):
            return x + F.dropout(h, self.config.dropout, self.training)

    def rank_rng(self, x: torch.Tensor):
        """Draw random numbers from this rank's own generator state (a different mask on
        every rank, and in every layer) on ``x``'s device; the default generator is left
        as it was."""
        return self.rng.fork(x.device)

    def _residual_rng(self, x: torch.Tensor):
        # under sequence parallelism each rank holds other tokens: masks of their own
        return self.rank_rng(x) if self.sequence_parallel else contextlib.nullcontext()

    def _attention(self, x):
        q, k, v = self.c_attn(x).chunk(3, dim=-1)
        b, s, local = q.shape
        q, k, v = (z.view(b, s, self.heads, local // self.heads).transpose(1, 2) for z in (q, k, v))
        p = self.config.dropout if self.training else 0.0
        with self.rank_rng(x):  # a different dropout mask per rank's heads
            y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return y.transpose(1, 2).reshape(b, s, local)


def _copy(module: nn.Module) -> nn.Module:
    import copy

    return copy.deepcopy(module)


def all_reduce_sequence_parallel_grads(module: nn.Module, group=None) -> None:
    """With sequence parallelism each rank's LayerNorms, and the biases added after a
    row-parallel layer's reduce-scatter, saw ``1/t`` of the sequence: sum their gradients
    over the ranks (Megatron does it for parameters marked ``sequence_parallel``)."""
    for m in module.modules():
        shared = [*m.parameters()] if isinstance(m, nn.LayerNorm) else []
        if isinstance(m, RowParallelLinear) and m.sequence_parallel and m.bias is not None:
            shared.append(m.bias)
        for p in shared:
            if p.grad is not None:
                dist.all_reduce(p.grad, group=group)


class _Head(nn.Module):
    """The output layer: this rank's rows of the (padded) vocabulary, its input passed
    through *f*; the logits of the padding rows are ``-inf``. A module of its own, so that
    a pipeline's last stage can hold it (:mod:`labsupport.parallel.pipeline_parallel`)."""

    def __init__(self, weight: nn.Parameter, start: int, vocab_size: int, group=None):
        super().__init__()
        self.weight = weight
        self.start, self.vocab_size, self.group = start, vocab_size, group

    def forward(self, x):
        x = copy_to_tensor_model_parallel_region(x, self.group)
        logits = F.linear(x, self.weight)  # this rank's slice of the vocabulary
        padding = torch.arange(logits.size(-1), device=logits.device) + self.start
        return logits.masked_fill(padding >= self.vocab_size, float("-inf"))


class ParallelGPT(nn.Module):
    """The whole course GPT, tensor-parallel (without sequence parallelism): the
    vocabulary-parallel embedding (tied with the output layer's weight, both split by
    vocabulary), replicated positions, parallel blocks, and the loss computed on logits
    split by vocabulary. It has the dense model's modules (``wte``, ``wpe``, ``drop``,
    ``h``, ``ln_f``, ``lm_head``), so a pipeline stage can hold its part of it
    (:func:`labsupport.parallel.pipeline_parallel.stage_modules`); it does not recompute
    (``recompute="full"`` is the dense model's). Its blocks share one
    :class:`RankRNGTracker`, seeded ``seed + 2718 + rank``."""

    def __init__(self, gpt, group=None, seed: int = 0):
        super().__init__()
        t, rank = dist.get_world_size(group), dist.get_rank(group)
        config = gpt.config
        self.config, self.group = config, group
        self.wte = VocabParallelEmbedding(config.vocab_size, config.n_embd, group)
        padded = torch.zeros(self.wte.padded, config.n_embd)
        padded[: config.vocab_size] = gpt.wte.weight.detach()
        with torch.no_grad():
            self.wte.weight.copy_(padded.chunk(t)[rank])
        self.wpe, self.ln_f = _copy(gpt.wpe), _copy(gpt.ln_f)
        self.drop = nn.Dropout(config.dropout)
        self.rng = rank_tracker(group, seed)
        self.h = nn.ModuleList(ParallelBlock(b, config, group, rng=self.rng) for b in gpt.h)
        if config.tie_weights:
            weight = self.wte.weight
        else:
            head = torch.zeros(self.wte.padded, config.n_embd)
            head[: config.vocab_size] = gpt.lm_head.weight.detach()
            weight = nn.Parameter(head.chunk(t)[rank].clone())
        self.lm_head = _Head(weight, self.wte.start, config.vocab_size, group)

    def embed(self, idx):
        pos = torch.arange(idx.size(1), device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def run_block(self, block, x):
        return block(x)

    def head(self, x, targets=None):
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        losses = vocab_parallel_cross_entropy(logits, targets, self.wte.start, self.group)
        return logits, losses.mean()

    def forward(self, idx, targets=None):
        x = self.embed(idx)
        for block in self.h:
            x = self.run_block(block, x)
        return self.head(x, targets)
