"""Lab 12, tensor parallelism: one linear layer split by columns and by rows, the MLP,
attention and whole GPT against the dense ones, the collectives counted, and the checkers.

The layers are :mod:`labsupport.parallel.tensor_parallel` and
:mod:`labsupport.parallel.tensor_parallel_model`, the collectives' record
:mod:`labsupport.comm.traced`; the memory measurement is in
:mod:`labsupport.labs.lab12_memory`, the drawings in :mod:`labsupport.viz.tensor_parallel`.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport import launch
from labsupport.comm import traced
from labsupport.estimate.memory import activation_memory
from labsupport.labs.cells import exercise, number
from labsupport.launch.runtime import device
from labsupport.models import random_tokens, tiny_gpt
from labsupport.parallel import tensor_parallel_model as tpm
from labsupport.parallel.tensor_parallel import ColumnParallelLinear, RowParallelLinear

#: float32 products summed over a few dozen terms, in another order or split over ranks
#: and all-reduced: each ordering's rounding is at most n·2^-24 of the sum of the terms'
#: magnitudes (n ≤ 128 here, ~1e-5 relative at worst, far less in practice). A wrong
#: split (a missing all-reduce, a bias added t times) is off by 10% or more.
TOL = {"rtol": 1e-5, "atol": 1e-6}

BLOCK_GPT = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 4, "n_embd": 32}
BATCH = 2


def _close(a, b) -> bool:
    return bool(torch.allclose(a.detach().cpu(), b.detach().cpu(), **TOL))


def split_linear(in_features: int = 8, out_features: int = 12, rows: int = 3) -> dict:
    """One dense ``nn.Linear`` split over the ranks both ways (run on every rank).

    Column-parallel: rank ``i`` holds the rows ``A_i`` of the weight (its output
    features) and computes ``Y_i = X A_iᵀ``; ``gather_output`` all-gathers the ``Y_i``.
    Row-parallel: rank ``i`` holds the weight's columns for its slice of the input
    features and computes a partial ``X_i A_iᵀ``; *g* all-reduces the partial sums, and
    the bias is added once. Returns what each rank holds, computes and sends.
    """
    t, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(0)
    dense = nn.Linear(in_features, out_features).to(device())
    x = torch.randn(rows, in_features, generator=torch.Generator().manual_seed(1)).to(device())
    column = ColumnParallelLinear(in_features, out_features, gather_output=True).to(device())
    row = RowParallelLinear(in_features, out_features, input_is_parallel=False).to(device())
    with torch.no_grad():
        column.weight.copy_(dense.weight.chunk(t)[rank])
        column.bias.copy_(dense.bias.chunk(t)[rank])
        row.weight.copy_(dense.weight.chunk(t, dim=1)[rank])
        row.bias.copy_(dense.bias)
        want = dense(x)
        with traced.trace_collectives() as by_columns:
            y_column = column(x)
        with traced.trace_collectives() as by_rows:
            y_row = row(x)
        local = out_features // t, in_features // t
        return {
            "rank": rank,
            "column weight": tuple(column.weight.shape),
            "column output": (rows, local[0]),
            "column features": (rank * local[0], (rank + 1) * local[0]),
            "column collectives": [name for name, _, _ in by_columns.calls],
            "column = dense": _close(y_column, want),
            "row weight": tuple(row.weight.shape),
            "row input features": (rank * local[1], (rank + 1) * local[1]),
            "row collectives": [name for name, _, _ in by_rows.calls],
            "row = dense": _close(y_row, want),
        }


def compare_block(sequence_parallel: bool = False, part: str = "block") -> dict:
    """A dense block of the course GPT and its :class:`~labsupport.parallel.
    tensor_parallel_model.ParallelBlock` on the same input (run on every rank): whether
    the output, the input's gradient and every weight's gradient agree, and the
    collectives of the forward and of the backward pass. ``part`` is ``"block"``,
    ``"mlp"`` or ``"attention"`` (the whole block, or only one of its halves)."""
    t, rank = dist.get_world_size(), dist.get_rank()
    gpt = tiny_gpt(0, **BLOCK_GPT)
    config, dense = gpt.config, gpt.h[0]
    block = tpm.ParallelBlock(dense, config, sequence_parallel=sequence_parallel)
    run_dense, run_parallel = _halves(dense, block, part)
    x = torch.randn(
        BATCH, config.block_size, config.n_embd, generator=torch.Generator().manual_seed(1)
    )
    x_dense = x.clone().requires_grad_(True)
    y_dense = run_dense(x_dense)
    y_dense.square().sum().backward()
    shard = x.chunk(t, dim=1)[rank] if sequence_parallel else x
    x_local = shard.clone().requires_grad_(True)
    with traced.trace_collectives() as forward:
        y = run_parallel(x_local)
    with traced.trace_collectives() as backward:
        y.square().sum().backward()
    if sequence_parallel:
        tpm.all_reduce_sequence_parallel_grads(block)
    want_y, want_x = y_dense.detach(), x_dense.grad
    if sequence_parallel:
        want_y, want_x = want_y.chunk(t, dim=1)[rank], want_x.chunk(t, dim=1)[rank]
    return {
        "rank": rank,
        "output": _close(y, want_y),
        "input gradient": _close(x_local.grad, want_x),
        "weight gradients": all(_close(g, w) for g, w in _grad_pairs(dense, block, t, rank)),
        "forward": [name for name, _, _ in forward.calls],
        "backward": [name for name, _, _ in backward.calls],
        "bytes": traced.bytes_per_rank(forward) + traced.bytes_per_rank(backward),
    }


def _halves(dense, block, part: str):
    """The dense and the parallel function to compare: the whole block, or one half."""
    if part == "block":
        return dense, block
    if part == "attention":

        def dense_half(x):
            return dense.attn(dense.ln_1(x))

        def parallel_half(x):
            return block.attn_proj(block._attention(block.ln_1(x)))

    elif part == "mlp":

        def dense_half(x):
            return dense.mlp(dense.ln_2(x))

        def parallel_half(x):
            return block.mlp_proj(F.gelu(block.c_fc(block.ln_2(x))))

    else:
        raise ValueError(f"part must be block, mlp or attention, got {part!r}")
    return dense_half, parallel_half


def _grad_pairs(dense, block, t: int, rank: int):
    """(parallel gradient, the dense gradient's slice) for every weight that got one."""
    d, a = dense, block
    slices = [
        (a.c_attn.weight, d.attn.c_attn.weight, lambda g: tpm._rows(g, t, rank, 3)),
        (a.attn_proj.weight, d.attn.c_proj.weight, lambda g: g.chunk(t, 1)[rank]),
        (a.c_fc.weight, d.mlp.c_fc.weight, lambda g: g.chunk(t)[rank]),
        (a.mlp_proj.weight, d.mlp.c_proj.weight, lambda g: g.chunk(t, 1)[rank]),
        (a.ln_1.weight, d.ln_1.weight, lambda g: g),
        (a.ln_2.weight, d.ln_2.weight, lambda g: g),
    ]
    return [(p.grad, cut(w.grad)) for p, w, cut in slices if w.grad is not None]


def collective_bytes_formula(b: int, s: int, h: int, t: int, bytes_per_value: int = 4) -> float:
    """Bytes each rank sends per transformer block, forward and backward: 4 all-reduces
    (*g* after attention and after the MLP, *f*'s twins in the backward pass) of the
    ``b·s·h`` activation, ``2(t-1)/t`` of it each in a ring (Shoeybi et al. 2019, 3)."""
    return 4 * 2 * (t - 1) / t * b * s * h * bytes_per_value


def gpt_losses(vocab: int) -> dict:
    """The loss of the whole course GPT, dense and tensor-parallel (vocabulary split and
    padded to a multiple of ``t``; the logits never gathered), on every rank."""
    t = dist.get_world_size()
    dense = tiny_gpt(0, **(BLOCK_GPT | {"vocab_size": vocab}))
    idx, targets = random_tokens(BATCH, dense.config.block_size, vocab, seed=3)
    model = tpm.ParallelGPT(dense)
    return {
        "rank": dist.get_rank(),
        "rows of the vocabulary": model.wte.end - model.wte.start,
        "padded vocabulary": model.wte.padded,
        "loss = dense": _close(model(idx, targets)[1], dense(idx, targets)[1]),
        "t": t,
    }


# --------------------------------------------------------------------------- exercises


@exercise
def check_tp_bytes(fn) -> str:
    """Exercise 1: ``fn(b, s, h, t, bytes_per_value)``: bytes each rank sends per block
    and training step in the all-reduces of tensor parallelism (ring)."""
    for b, s, h, t, p in [(1, 2048, 12288, 8, 2), (4, 1024, 4096, 2, 2), (8, 512, 1024, 4, 4)]:
        got = number(fn(b, s, h, t, p))
        want = collective_bytes_formula(b, s, h, t, p)
        if math.isclose(got, want, rel_tol=1e-12):
            continue
        where = f"b={b}, s={s}, h={h}, t={t}: got {got:,.0f} bytes, "
        ratio = got / want
        hints = {
            0.5: "half: a block runs 4 all-reduces (2 forward, 2 backward) and a ring "
            "all-reduce sends 2(t-1)/t of the tensor; one of the two factors is halved",
            t / (2 * (t - 1)): "as if an all-reduce sent the whole tensor once: a ring "
            "sends 2(t-1)/t of it",
            t / (t - 1): "as if an all-reduce sent the whole tensor twice: a ring sends "
            "2(t-1)/t of it",
            0.25: "one all-reduce's worth per pass: a block has two in the forward pass and "
            "two in the backward",
        }
        hint = next((text for r, text in hints.items() if math.isclose(ratio, r)), None)
        raise AssertionError(where + (hint or f"{ratio:.3g} times the bytes a rank sends"))
    return "the bytes of tensor parallelism's all-reduces per block, forward and backward"


def row_parallel_case(fn, world: int) -> dict:
    """Run the learner's ``fn(x, weight, bias)`` on ``world`` ranks against the dense
    layer: returns ``(matches, partial sum instead of total, bias added t times)``."""

    def on_rank():
        torch.manual_seed(0)
        dense = nn.Linear(8, 6)
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
        out = fn(
            x.to(device()), dense.weight.detach().to(device()), dense.bias.detach().to(device())
        )
        out = torch.as_tensor(out).cpu()
        t, rank = dist.get_world_size(), dist.get_rank()
        partial = F.linear(x.chunk(t, -1)[rank], dense.weight.chunk(t, 1)[rank]) + dense.bias
        want = dense(x).detach()
        return {
            "shape": out.shape == want.shape,
            "equal": out.shape == want.shape and _close(out, want),
            "partial": out.shape == want.shape and _close(out, partial),
            "bias t times": out.shape == want.shape and _close(out, want + (t - 1) * dense.bias),
        }

    return launch(on_rank, world, timeout=120)


@exercise
def check_row_parallel(fn) -> str:
    """Exercise 2: ``fn(x, weight, bias)``, run on every rank with the *whole* input and
    the dense layer's weight and bias, must compute the row-parallel layer: this rank's
    slice of the input features times its slice of the weight, summed over the ranks."""
    for world in (2, 4):
        results = row_parallel_case(fn, world)
        if all(r["equal"] for r in results):
            continue
        r = next(r for r in results if not r["equal"])
        where = f"on {world} ranks, "
        if not r["shape"]:
            raise AssertionError(where + "the output's shape is not the dense layer's")
        if r["partial"]:
            raise AssertionError(where + "each rank returns its partial sum: all-reduce them")
        if r["bias t times"]:
            raise AssertionError(where + "the bias is added on every rank: add it once")
        raise AssertionError(where + "the output is not the dense layer's")
    return "a row-parallel linear layer on 2 and 4 ranks equals the dense layer"


@exercise
def check_sp_activations(fn) -> str:
    """Exercise 3: ``fn(s, b, h, a, t)``: activation bytes per layer and GPU with tensor
    and sequence parallelism (16-bit values, 1-byte masks, no recomputation)."""
    for s, b, h, a, t in [(2048, 1, 12288, 96, 8), (4096, 2, 4096, 32, 4), (1024, 4, 1024, 16, 2)]:
        got = number(fn(s, b, h, a, t))
        want = activation_memory(s, b, h, a, 1, tensor_parallel=t, sequence_parallel=True)
        if math.isclose(got, want, rel_tol=1e-9):
            continue
        where = f"s={s}, b={b}, h={h}, a={a}, t={t}: got {got:,.0f} bytes, "
        if math.isclose(got, activation_memory(s, b, h, a, 1, tensor_parallel=t), rel_tol=1e-9):
            hint = (
                "tensor parallelism alone: sequence parallelism also splits the layer "
                "norms, the dropouts and the inputs of the column-parallel layers"
            )
        elif math.isclose(got, activation_memory(s, b, h, a, 1), rel_tol=1e-9):
            hint = "the whole layer on one GPU: divide by the t ranks"
        elif math.isclose(got, 34 * s * b * h / t, rel_tol=1e-9):
            hint = "the attention scores (5·a·s/h) are missing: they split over the heads too"
        else:
            hint = f"{got / want:.3g} times the formula"
        raise AssertionError(where + hint)
    return "activation bytes per layer with tensor and sequence parallelism"
