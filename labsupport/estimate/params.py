"""Parameter counts in closed form, for the models of :mod:`labsupport.models`.

Each formula counts what the layers hold (a ``Linear(a, b)`` has ``a·b`` weights and
``b`` biases); the labs and tests check them against the models built on the ``meta``
device, which counts without allocating memory.
"""

from __future__ import annotations


def mlp_params(sizes: list[int]) -> int:
    """Closed form for :class:`labsupport.models.MLP`: each ``Linear(a, b)`` has ``a*b + b``."""
    return sum(a * b + b for a, b in zip(sizes[:-1], sizes[1:], strict=True))


def cnn_params(in_channels=1, channels=(16, 32), kernel=5, image_size=28, classes=10) -> int:
    """Closed form for :class:`labsupport.models.SmallCNN`.

    A ``Conv2d(c_in, c_out, k)`` has ``c_out * c_in * k * k`` weights and ``c_out`` biases;
    the classifier sees ``c2 * (image_size // 4)**2`` features after two 2x poolings.
    """
    c1, c2 = channels
    conv = c1 * in_channels * kernel**2 + c1 + c2 * c1 * kernel**2 + c2
    features = c2 * (image_size // 4) ** 2
    return conv + features * classes + classes


def gpt_params(vocab_size: int, block_size: int, n_embd: int, n_layer: int) -> int:
    """Closed form for :class:`labsupport.models.GPT` (GPT-2) with tied embeddings.

    Embeddings ``V*d + P*d``; per layer ``12*d**2 + 13*d`` (attention: ``4*d**2 + 4*d``,
    MLP: ``8*d**2 + 5*d``, two LayerNorms: ``4*d``); final LayerNorm ``2*d``; the output
    layer reuses the token embedding, so it adds nothing.
    """
    d = n_embd
    return vocab_size * d + block_size * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def gpt_breakdown(vocab_size: int, block_size: int, n_embd: int, n_layer: int) -> list[dict]:
    """The terms of :func:`gpt_params`, as rows for a table."""
    d = n_embd
    rows = [
        ("token embedding  V·d", vocab_size * d),
        ("position embedding  P·d", block_size * d),
        ("attention weights  L·4d²", n_layer * 4 * d * d),
        ("MLP weights  L·8d²", n_layer * 8 * d * d),
        ("biases and LayerNorms  L·13d", n_layer * 13 * d),
        ("final LayerNorm  2d", 2 * d),
    ]
    total = sum(n for _, n in rows)
    return [{"term": t, "parameters": f"{n:,}", "share": f"{n / total:.1%}"} for t, n in rows]
