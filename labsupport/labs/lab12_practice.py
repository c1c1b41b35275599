"""Lab 12, tensor parallelism in practice: grouped-query attention split by heads, the
all-gather before a column-parallel layer overlapped with its matrix products, and what
splitting a matrix product does to its speed.

The layers are :mod:`labsupport.parallel.tensor_parallel_gqa` and
:mod:`labsupport.parallel.tensor_parallel_overlap`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

from labsupport.launch.runtime import device
from labsupport.parallel import tensor_parallel_gqa as gqa
from labsupport.parallel import tensor_parallel_overlap as overlap
from labsupport.parallel.tensor_parallel import gather_from_sequence_parallel_region

TOL = {"rtol": 1e-5, "atol": 1e-6}


def heads_per_rank(n_heads: int, n_kv_heads: int, t: int) -> dict:
    """What rank ``r`` of ``t`` holds of an attention layer's heads, split as
    :class:`~labsupport.parallel.tensor_parallel_gqa.ParallelGroupedQueryAttention`
    splits them."""
    kv = max(1, n_kv_heads // t)
    return {"t": t, "query heads": n_heads // t, "key-value heads": kv,
            "copies of each key-value head": max(1, t // n_kv_heads)}  # fmt: skip


def gqa_check(heads: int = 8, kv_heads: int = 2, width: int = 32) -> dict:
    """The parallel grouped-query attention on this rank against the dense one, forward
    and backward (run on every rank): equal outputs and gradients, and the bytes of K
    and V it computed for 2 sequences of 8 tokens."""
    torch.manual_seed(0)
    dense = gqa.GroupedQueryAttention(width, heads, kv_heads).to(device())
    layer = gqa.ParallelGroupedQueryAttention(dense)
    x = torch.randn(2, 8, width, device=device(), requires_grad=True)
    y = layer(x)
    y.pow(2).sum().backward()
    gqa.all_reduce_replicated_kv_grads(layer)
    dx = x.grad
    x.grad = None
    want = dense(x)
    want.pow(2).sum().backward()
    t, r = dist.get_world_size(), dist.get_rank()
    rows = slice(r * width // t, (r + 1) * width // t)
    kv = (r // layer.replicas if layer.replicas > 1 else r) * layer.wk.out_features
    kv_rows = slice(kv, kv + layer.wk.out_features)
    grads = [
        (layer.wq.weight.grad, dense.wq.weight.grad[rows]),
        (layer.wk.weight.grad, dense.wk.weight.grad[kv_rows]),
        (layer.wv.weight.grad, dense.wv.weight.grad[kv_rows]),
        (layer.wo.weight.grad, dense.wo.weight.grad[:, rows]),
    ]
    return {
        "rank": r,
        "output = dense": torch.allclose(y, want, **TOL),
        "gradients = dense": torch.allclose(dx, x.grad, **TOL)
        and all(torch.allclose(a, b, **TOL) for a, b in grads),
        "K, V bytes": layer.kv_bytes(2, 8, 4),
        "copies": layer.replicas,
    }


def waiting_matmul(seconds: float):
    """``F.linear`` that also waits ``seconds``, as a rank waits for its GPU kernel."""

    def matmul(x, weight):
        out = F.linear(x, weight)
        time.sleep(seconds)
        return out

    return matmul


def overlap_steps(tokens: int = 1024, width: int = 512, out: int = 64, wait: float = 0.02,
                  repeats: int = 5) -> dict:  # fmt: skip
    """The all-gather of a sequence-parallel input of ``tokens`` tokens per rank, then a
    column-parallel product, both ways (run on every rank): first checked against
    :func:`~labsupport.parallel.tensor_parallel.gather_from_sequence_parallel_region`
    and ``F.linear``, forward and backward; then timed, each shard's product waiting
    ``wait`` seconds, median of ``repeats``; and the all-gather alone."""
    torch.manual_seed(dist.get_rank())
    x = torch.randn(2, 4, 16, device=device(), requires_grad=True)
    w = torch.randn(8, 16, device=device(), requires_grad=True)
    y = overlap.all_gather_matmul(x, w)
    y.pow(2).sum().backward()
    got = (y.detach(), x.grad, w.grad)
    x.grad = w.grad = None
    want = F.linear(gather_from_sequence_parallel_region(x), w)
    want.pow(2).sum().backward()
    same = all(
        torch.allclose(a, b, **TOL) for a, b in zip(got, (want, x.grad, w.grad), strict=True)
    )

    big = torch.randn(2, tokens, width, device=device())
    weight = torch.randn(out, width, device=device())
    timings = {}
    runs = {
        "all-gather, then the products": (overlap.all_gather_then_matmul, waiting_matmul(wait)),
        "overlapped": (overlap.all_gather_matmul, waiting_matmul(wait)),
        "all-gather alone": (overlap.all_gather_then_matmul, waiting_matmul(0.0)),
    }
    for name, (fn, matmul) in runs.items():
        seconds = []
        for _ in range(repeats):
            dist.barrier()
            start = time.perf_counter()
            fn(big, weight, matmul=matmul)
            seconds.append(time.perf_counter() - start)
        timings[name] = sorted(seconds)[repeats // 2]
    return {"same as gather then linear": same, "seconds": timings}


def gemm_intensity(tokens: int, hidden: int, t: int, element_bytes: int = 2) -> list[dict]:
    """The four matrix products of a transformer layer on one of ``t`` tensor-parallel
    ranks, for ``tokens`` tokens of width ``hidden`` (``M × K`` by ``K × N``): FLOPs, and
    FLOPs per byte of operands read and output written, ``2MKN / (bytes·(MK + KN + MN))``.
    Below a GPU's ridge (peak FLOP/s over memory bandwidth, chapter 1) a product waits for
    memory rather than for its arithmetic units."""
    h = hidden
    shapes = {
        "Q, K, V (column)": (tokens, h, 3 * h // t),
        "attention out (row)": (tokens, h // t, h),
        "MLP up (column)": (tokens, h, 4 * h // t),
        "MLP down (row)": (tokens, 4 * h // t, h),
    }
    rows = []
    for name, (m, k, n) in shapes.items():
        flops, moved = 2 * m * k * n, element_bytes * (m * k + k * n + m * n)
        rows.append({"product": name, "t": t, "M x K x N": f"{m} x {k} x {n}",
                     "FLOPs": flops, "FLOPs per byte": flops / moved})  # fmt: skip
    return rows


def gemm_rates(tokens: int = 2048, width: int = 1024, t_values=(1, 2, 4, 8), repeats: int = 5):
    """FLOP/s of the MLP's first product on one rank, ``tokens × width`` by ``width ×
    4·width/t``, as ``t`` splits it: the same arithmetic per rank falls as ``1/t``, the
    rate at which it runs need not stay."""
    x = torch.randn(tokens, width)
    out = []
    for t in t_values:
        w = torch.randn(4 * width // t, width)
        F.linear(x, w)  # warm up
        seconds = []
        for _ in range(repeats):
            start = time.perf_counter()
            F.linear(x, w)
            seconds.append(time.perf_counter() - start)
        best = min(seconds)
        out.append({"t": t, "flops": 2 * tokens * width * 4 * width / t, "seconds": best})
    return out
