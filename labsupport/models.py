"""Small models the labs build locally, with no downloads: an MLP, a small CNN, and GPT-2.

:class:`GPT` follows the architecture of GPT-2 (Radford et al., "Language Models are
Unsupervised Multitask Learners", 2019) as karpathy/nanoGPT's ``model.py`` writes it: token
and position embeddings, ``n_layer`` pre-LayerNorm blocks of causal self-attention and a
4x-wide GELU MLP, a final LayerNorm, and an output layer that shares its weight with the
token embedding (weight tying). At :data:`GPT2_SMALL` and :data:`GPT2_MEDIUM` it has exactly
the parameter counts of the released GPT-2 checkpoints (124,439,808 and 354,823,168).

Build a big one on the ``meta`` device to count its parameters without allocating memory::

    with torch.device("meta"):
        model = GPT(GPT2_SMALL)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


class MLP(nn.Sequential):
    """Fully connected layers of the given ``sizes`` with ReLU in between.

    ``MLP([784, 256, 10])`` is ``Linear(784, 256), ReLU(), Linear(256, 10)``.
    """

    def __init__(self, sizes: list[int]):
        layers = []
        for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:], strict=True)):
            if i:
                layers.append(nn.ReLU())
            layers.append(nn.Linear(fan_in, fan_out))
        super().__init__(*layers)


class SmallCNN(nn.Sequential):
    """A LeNet-style CNN for ``image_size`` x ``image_size`` images.

    Two blocks of ``Conv2d(kernel, padding=kernel // 2)``, ``ReLU`` and ``MaxPool2d(2)``,
    then a linear classifier on the flattened feature map (``image_size // 4`` squared
    positions of ``channels[-1]`` features).
    """

    def __init__(self, in_channels=1, channels=(16, 32), kernel=5, image_size=28, classes=10):
        c1, c2 = channels
        side = image_size // 4
        super().__init__(
            nn.Conv2d(in_channels, c1, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Conv2d(c1, c2, kernel, padding=kernel // 2),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * side * side, classes),
        )


@dataclass(frozen=True)
class GPTConfig:
    """The shape of a GPT-2-style model. ``bias=False`` drops every bias (LayerNorm's too);
    ``tie_weights=False`` gives the output layer its own ``vocab_size x n_embd`` matrix."""

    vocab_size: int = 50257
    block_size: int = 1024  # context length: number of positions
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    bias: bool = True
    tie_weights: bool = True


GPT2_SMALL = GPTConfig(n_layer=12, n_head=12, n_embd=768)
GPT2_MEDIUM = GPTConfig(n_layer=24, n_head=16, n_embd=1024)
GPT2_LARGE = GPTConfig(n_layer=36, n_head=20, n_embd=1280)
GPT2_XL = GPTConfig(n_layer=48, n_head=25, n_embd=1600)


class CausalSelfAttention(nn.Module):
    def __init__(self, config: GPTConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0, "n_embd must be a multiple of n_head"
        self.n_head = config.n_head
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)  # q, k, v
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.c_attn(x).split(C, dim=2)
        q, k, v = (t.view(B, T, self.n_head, C // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(B, T, C))


class Block(nn.Module):
    """One transformer layer: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig):
        super().__init__()
        d = config.n_embd
        self.ln_1 = nn.LayerNorm(d, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(d, bias=config.bias)
        self.mlp = nn.Sequential(
            nn.Linear(d, 4 * d, bias=config.bias),
            nn.GELU(approximate="tanh"),
            nn.Linear(4 * d, d, bias=config.bias),
        )

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
        self.h = nn.ModuleList(Block(config) for _ in range(config.n_layer))
        self.ln_f = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if config.tie_weights:
            self.lm_head.weight = self.wte.weight  # one matrix, used twice
        if not any(p.is_meta for p in self.parameters()):
            self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module):
        """GPT-2's initialization: normal(0, 0.02), zero biases (nanoGPT's, without the
        residual-projection scaling, which does not matter for this course)."""
        if isinstance(module, nn.Linear | nn.Embedding):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)
        if isinstance(module, nn.Linear) and module.bias is not None:
            nn.init.zeros_(module.bias)

    def forward(self, idx, targets=None):
        """Logits for token ids ``idx`` (batch x time); with ``targets``, also the loss."""
        _, t = idx.shape
        assert t <= self.config.block_size, f"sequence of {t} > block_size"
        pos = torch.arange(t, device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        logits = self.lm_head(self.ln_f(x))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.reshape(-1, logits.size(-1)), targets.reshape(-1))
        return logits, loss


def tiny_gpt(seed: int = 0, **overrides) -> GPT:
    """A GPT small enough to train on a laptop core: 2 layers, d = 64, 256 tokens."""
    torch.manual_seed(seed)
    fields = {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64}
    return GPT(GPTConfig(**(fields | overrides)))


__all__ = [
    "GPT",
    "GPT2_LARGE",
    "GPT2_MEDIUM",
    "GPT2_SMALL",
    "GPT2_XL",
    "MLP",
    "GPTConfig",
    "SmallCNN",
    "tiny_gpt",
]
