"""Lab 4, section 4: operator fusion. A chain of ``k`` elementwise ops moves ``2k``
tensors through memory unfused and 2 fused: :func:`elementwise_chain` eager, in place,
tiled by hand, and compiled by ``torch.compile``, checked to rounding and timed side by
side.
"""

from __future__ import annotations

import torch

from labsupport.labs.lab04_one_device import FP32_UNIT_ROUNDOFF
from labsupport.measure.timing import side_by_side


def elementwise_chain(x: torch.Tensor) -> torch.Tensor:
    """Eight cheap elementwise ops; in eager mode each reads and writes a whole tensor."""
    y = x * 2.0
    y = y + 1.0
    y = torch.relu(y)
    y = y * 0.5
    y = y - 1.0
    y = y.abs()
    y = y * 3.0
    y = y + 2.0
    return y


CHAIN_OPS = 8


def unfused_into(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The chain op by op, without allocating: the first op writes ``out``, the rest work
    in place on it. Still 8 passes over memory, each reading and writing ``n`` elements."""
    torch.mul(x, 2.0, out=out)
    return chain_in_place(out, first=False)


def chain_in_place(y: torch.Tensor, first: bool = True) -> torch.Tensor:
    """The same chain, in place on ``y`` (``first=False``: skip the first op, done already)."""
    if first:
        y.mul_(2.0)
    y.add_(1.0).relu_().mul_(0.5).sub_(1.0).abs_().mul_(3.0).add_(2.0)
    return y


def tiled_chain(x: torch.Tensor, block: int = 2**16) -> torch.Tensor:
    """Fusion by hand, without a compiler: run the whole chain on one cache-sized block at a
    time, so the intermediates stay in cache and main memory sees one read and one write."""
    out = torch.empty_like(x)
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.numel(), block):
        piece = flat_out[start : start + block]
        piece.copy_(flat_in[start : start + block])
        chain_in_place(piece)
    return out


def chain_matches(got: torch.Tensor, x: torch.Tensor) -> bool:
    """Whether ``got`` is :func:`elementwise_chain` of ``x``, up to rounding.

    Of the 8 ops, four round (the two additions, the subtraction, the product by 3), each
    by at most u = 2^-24 of a value that, carried to the end, is no larger than the
    output (the chain ends with x3 and +2): one evaluation is within 4u of the exact
    output, so two evaluations in any order, fused or not, agree within 8u of it.
    """
    want = elementwise_chain(x)
    bound = CHAIN_OPS * FP32_UNIT_ROUNDOFF * want.abs()
    return got.shape == want.shape and bool(((got - want).abs() <= bound).all())


def fused_chain(x: torch.Tensor):
    """``(function, how)``: the chain compiled into one loop by ``torch.compile`` for
    tensors like ``x``, or, where compiling fails (no C++ compiler) or its result is not
    the chain's (:func:`chain_matches`), the hand-tiled version."""
    compiled = torch.compile(elementwise_chain)
    try:
        result = compiled(x)
    except Exception:  # noqa: BLE001 - any compiler failure: fall back
        return tiled_chain, "tiled by hand (torch.compile failed)"
    if not chain_matches(result, x):
        return tiled_chain, "tiled by hand (torch.compile's result was wrong)"
    return compiled, "torch.compile"


def chain_seconds(fused, x: torch.Tensor, rounds: int = 7) -> dict:
    """The chain fused, eager, and eager into one preallocated buffer, timed side by side
    (:func:`labsupport.measure.timing.side_by_side`): median seconds of each, and each one's
    median per-round time over the fused one's under ``"ratio"``."""
    out = torch.empty_like(x)
    return side_by_side(
        {
            "fused": lambda: fused(x),
            "eager": lambda: elementwise_chain(x),
            "eager, no allocation": lambda: unfused_into(x, out),
        },
        rounds=rounds,
    )


def chain_bytes(n: int, ops: int = CHAIN_OPS, fused: bool = False, itemsize: int = 4) -> int:
    """Bytes the chain moves through memory: each unfused op reads and writes ``n`` elements;
    the fused chain reads the input and writes the output once."""
    return (2 if fused else 2 * ops) * n * itemsize
