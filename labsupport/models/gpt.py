"""The course's one GPT: GPT-2's architecture, as karpathy/nanoGPT's ``model.py`` writes it.

Token and position embeddings, ``n_layer`` pre-LayerNorm blocks of causal
self-attention and a 4x-wide GELU MLP, a final LayerNorm, and an output layer that
shares its weight with the token embedding (weight tying); nanoGPT's module names
(``wte``, ``wpe``, ``h``, ``c_attn``, ``c_proj``, ``c_fc``, ``ln_f``, ``lm_head``) and its
initialization. At :data:`GPT2_SMALL` and :data:`GPT2_MEDIUM` it has exactly the
parameter counts of the released GPT-2 checkpoints (124,439,808 and 354,823,168; Radford
et al. 2019).

Options the chapters need, in :class:`GPTConfig`:

* ``attention="sdpa"`` (the default) runs PyTorch's fused attention;
  ``attention="math"`` writes it out, so that every tensor the activation-memory formulas
  count (Korthikanti et al. 2022, section 4) is one autograd can save and a lab can see;
* ``dropout`` (after the embeddings, on the attention probabilities, after each residual
  branch, as nanoGPT and the formulas place it);
* ``recompute="selective"`` recomputes the attention core in the backward pass and
  ``"full"`` every block (Megatron's ``recompute_granularity``);
* ``moe=MoEConfig(...)`` replaces every block's MLP by a mixture of experts whose experts
  are that MLP (:mod:`labsupport.models.moe`; chapter 18).

A parallel strategy may replace the attention core of a block: setting
``block.attn.attention_fn = fn`` makes :meth:`CausalSelfAttention.core` return
``fn(q, k, v)`` (context parallelism does, :mod:`labsupport.parallel.context_parallel_model`),
and :meth:`GPT.embed` takes the positions of the tokens it is given when they are not
``0, 1, 2, ...`` (a rank holding part of each sequence).

The forward pass is :meth:`GPT.embed`, then :meth:`GPT.run_block` for each block, then
:meth:`GPT.head`: the pieces a pipeline stage or a per-layer measurement needs.

Build a big one on the ``meta`` device to count its parameters without memory::

    with torch.device("meta"):
        model = GPT(GPT2_SMALL)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from labsupport.models.moe import MoE, MoEConfig
from labsupport.models.recompute import RECOMPUTE

ATTENTION = ("sdpa", "math")


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT and how it runs. ``bias=False`` drops every bias (LayerNorm's
    too); ``tie_weights=False`` gives the output layer its own ``vocab_size x n_embd``."""

    vocab_size: int = 50257
    block_size: int = 1024  # context length: number of positions
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    tie_weights: bool = True
    attention: str = "sdpa"
    recompute: str = "none"
    moe: MoEConfig | None = None  # experts in place of each block's MLP

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(
                f"n_embd={self.n_embd} does not divide into n_head={self.n_head} heads; "
                "choose n_embd as a multiple of n_head"
            )
        if self.attention not in ATTENTION:
            raise ValueError(f"attention must be one of {ATTENTION}, got {self.attention!r}")
        if self.recompute not in RECOMPUTE:
            raise ValueError(f"recompute must be one of {RECOMPUTE}, got {self.recompute!r}")


GPT2_SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768)
GPT2_MEDIUM = GPTConfig(n_layer=24, n_head=16, n_embd=1024)
GPT2_LARGE = GPTConfig(n_layer=36, n_head=20, n_embd=1280)
GPT2_XL = GPTConfig(n_layer=48, n_head=25, n_embd=1600)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention: one ``c_attn`` projection to Q, K and V, then
    ``softmax(Q·Kᵀ/√d)·V`` per head, then the output projection ``c_proj``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.attention_fn = None  # fn(q, k, v): a parallel strategy's attention core
        if config.attention == "math":  # the causal mask: True above the diagonal
            future = torch.ones(config.block_size, config.block_size, dtype=torch.bool).triu(1)
            self.register_buffer("future", future, persistent=False)

    def core(self, q, k, v):
        """``softmax(Q·Kᵀ/√d, causal)·V``: what selective recomputation recomputes."""
        if self.attention_fn is not None:
            return self.attention_fn(q, k, v)
        if self.config.attention == "sdpa":
            p = self.config.dropout if self.training else 0.0
            return F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        t = q.size(-2)
        scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(q.size(-1)))
        scores = scores.masked_fill(self.future[:t, :t], float("-inf"))
        return self.attn_dropout(F.softmax(scores, dim=-1)) @ v

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.c_attn(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        if self.config.recompute == "selective" and torch.is_grad_enabled():
            y = checkpoint(self.core, q, k, v, use_reentrant=True)
        else:
            y = self.core(q, k, v)
        y = y.transpose(1, 2).contiguous().view(b, t, c)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    """The transformer's feed-forward block: ``c_fc`` to 4x the width, GELU, ``c_proj``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    """One transformer layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        if config.moe is None:
            self.mlp = MLP(config)
        else:  # a mixture of experts, each expert an MLP
            self.mlp = MoE(config.n_embd, config.moe, lambda: MLP(config))

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    """GPT-2: embeddings, ``n_layer`` blocks, final LayerNorm, (tied) output layer."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        self.config = config
        self.wte = nn.Embedding(config.vocab_size, config.n_embd)  # token embedding
        self.wpe = nn.Embedding(config.block_size, config.n_embd)  # position embedding
        self.drop = nn.Dropout(config.dropout)
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one matrix, used twice
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)
            for name, p in self.named_parameters():
                if name.endswith("c_proj.weight"):  # GPT-2's scaled residual projections
                    nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    @staticmethod
    def _init_weights(module):
        """GPT-2's initialization, as nanoGPT: normal(0, 0.02) weights, zero biases."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def embed(self, idx, pos=None):
        """Token plus position embeddings of the ids ``idx`` (batch x time), with dropout;
        ``pos``: the tokens' positions, ``0, 1, 2, ...`` if not given."""
        t = idx.size(1)
        if t > self.config.block_size:
            raise ValueError(f"a sequence of {t} tokens is longer than block_size")
        if pos is None:
            pos = torch.arange(t, device=idx.device)
        return self.drop(self.wte(idx) + self.wpe(pos))

    def run_block(self, block: Block, x):
        """One block; with ``recompute="full"`` its activations are recomputed in backward.

        The reentrant checkpoint keeps the block's input with ``save_for_backward``,
        where a saved-tensor hook sees it (:mod:`labsupport.measure.memory`).
        """
        if self.config.recompute == "full" and torch.is_grad_enabled():
            return checkpoint(block, x, use_reentrant=True)
        return block(x)

    def head(self, x, targets=None):
        """Final LayerNorm and output layer: ``(logits, loss)``, the loss ``None`` without
        ``targets`` (mean cross-entropy over every position, as nanoGPT)."""
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss

    def forward(self, idx, targets=None):
        """``(logits, loss)`` for token ids ``idx``; ``loss`` is ``None`` without targets."""
        x = self.embed(idx)
        for block in self.h:
            x = self.run_block(block, x)
        return self.head(x, targets)


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A GPT small enough to train on a laptop core: 2 layers, d = 64, 256 tokens.

    The weights depend only on ``seed`` (and the shape), so every rank that builds it
    with the same seed holds the same model. ``overrides`` are :class:`GPTConfig` fields:
    a lab builds its own GPT as ``tiny_gpt(seed, **LAB_GPT)``, a dict that gives the
    whole shape, and gets exactly what ``torch.manual_seed(seed)`` then ``GPT(...)`` gives.
    """
    torch.manual_seed(seed)
    fields = {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
    return GPT(GPTConfig(**(fields | overrides)))
