"""Lab 10, fewer bytes and their price: PyTorch's communication hooks (fp16 and bf16
compression, PowerSGD) run on the course's DDP and on PyTorch's, the bytes they all-reduce
counted; the error of summing gradients in bf16 instead of fp32 as the ranks grow; and
``gradient_as_bucket_view``, the gradients as views of DDP's buckets.

The hooks are PyTorch's own (``torch.distributed.algorithms.ddp_comm_hooks``): Vogels et
al. 2019, "PowerSGD: Practical Low-Rank Gradient Compression for Distributed
Optimization" (NeurIPS), for PowerSGD.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as powersgd

from labsupport.labs.lab10_data_parallel import LR, make_gpt, my_share
from labsupport.launch.runtime import device
from labsupport.parallel.data_parallel import DistributedDataParallel

#: The hooks the lab compares, by name: ``() -> (state, hook)``. PowerSGD all-reduces
#: plain gradients for its first 2 steps (PyTorch requires it with error feedback), then
#: each matrix's rank-4 factors; it keeps state, so each DDP gets its own.
HOOKS = {
    "fp32 (allreduce_hook)": lambda: (None, default_hooks.allreduce_hook),
    "fp16_compress_hook": lambda: (None, default_hooks.fp16_compress_hook),
    "bf16_compress_hook": lambda: (None, default_hooks.bf16_compress_hook),
    "PowerSGD, rank 4": lambda: (
        powersgd.PowerSGDState(None, matrix_approximation_rank=4, start_powerSGD_iter=2),
        powersgd.powerSGD_hook,
    ),
}
STEPS = 3  # PowerSGD compresses from the third


@contextlib.contextmanager
def count_all_reduces():
    """Every ``dist.all_reduce`` called inside the block, on any thread: a list of
    ``(dtype, bytes)``. PyTorch's hooks call it by name (so does ``comm.traced``), so
    the block replaces ``torch.distributed.all_reduce`` with a counting wrapper while it
    lasts; PyTorch's DDP without a hook all-reduces from C++, which this does not see."""
    calls, original = [], dist.all_reduce

    def counting(tensor, *args, **kwargs):
        calls.append(
            (str(tensor.dtype).removeprefix("torch."), tensor.numel() * tensor.element_size())
        )
        return original(tensor, *args, **kwargs)

    dist.all_reduce = counting
    try:
        yield calls
    finally:
        dist.all_reduce = original


def hooked_training(steps: int = STEPS) -> dict:
    """On every rank: ``steps`` of SGD on the lab's GPT with each hook of :data:`HOOKS`,
    on ours and on PyTorch's DDP, in one bucket (on gloo, PowerSGD's callbacks run
    collectives from gloo's threads, which with several buckets meet other collectives in
    different orders on different ranks). Returns, per ``(hook, "ours" | "torch")``, the
    bytes and dtypes all-reduced at each step and the parameters after, or the error
    PyTorch's DDP refused the hook with."""
    out = {}
    for name, make in HOOKS.items():
        for kind, cls in (
            ("ours", DistributedDataParallel),
            ("torch", nn.parallel.DistributedDataParallel),
        ):
            model = make_gpt().to(device())
            ddp = cls(model, bucket_cap_mb=25)
            try:
                ddp.register_comm_hook(*make())
            except TypeError as refused:  # torch's bf16 hook wants CUDA and NCCL
                out[(name, kind)] = {"refused": str(refused)}
                continue
            optimizer, sent = torch.optim.SGD(model.parameters(), lr=LR), []
            for step in range(steps):
                idx, targets = my_share(step)
                optimizer.zero_grad()
                with count_all_reduces() as calls:
                    ddp(idx, targets)[1].backward()
                sent.append(
                    {"bytes": sum(b for _, b in calls), "dtypes": sorted({d for d, _ in calls})}
                )
                optimizer.step()
            params = nn.utils.parameters_to_vector(model.parameters()).detach().cpu()
            out[(name, kind)] = {"steps": sent, "params": params}
    return out


def powersgd_numbers(model: nn.Module, rank: int = 4, min_compression_rate: float = 2) -> int:
    """How many numbers PowerSGD all-reduces per step for ``model``'s gradients: for each
    matrix ``n x m`` it compresses, ``P`` and ``Q``, ``(n + m) * r`` numbers with
    ``r = min(n, m, rank)``; every other tensor whole. It compresses a matrix when
    ``(n + m) * r * min_compression_rate < n * m`` (``powerSGD_hook``'s
    ``_should_compress``; a tensor of more dimensions is a matrix of its first one)."""
    total = 0
    for p in model.parameters():
        n, m = p.shape[0], p[0].numel() if p.dim() > 1 else 1
        r = min(n, m, rank)
        compress = p.dim() > 1 and (n + m) * r * min_compression_rate < n * m
        total += (n + m) * r if compress else p.numel()
    return total


# --------------------------------------------------------------------------- bf16 sums


def ring_sum(grads: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """The sum of ``grads[0] + grads[1] + ...`` as one chunk of a ring all-reduce adds them
    in ``dtype``: one term at a time, the partial sum rounded to ``dtype`` after each
    addition (``N - 1`` roundings for ``N`` ranks); returned in float64."""
    total = grads[0].to(dtype)
    for g in grads[1:]:
        total = total + g.to(dtype)
    return total.double()


def reduction_errors(ranks=(2, 8, 64, 512), n: int = 4096, seed: int = 0) -> list:
    """For each number of ranks ``N``: the relative error of the average of ``N`` ranks'
    gradients (a shared signal plus as much noise per rank) summed in bf16 and in fp32 as
    a ring does, against the exact sum; each rank's gradient rounded to the dtype first,
    as a bf16 model's gradients are."""
    g = torch.Generator().manual_seed(seed)
    signal, rows = torch.randn(n, generator=g, dtype=torch.float64), []
    for world in ranks:
        grads = signal + torch.randn(world, n, generator=g, dtype=torch.float64)
        exact = grads.sum(0)
        row = {"ranks": world}
        for dtype in (torch.bfloat16, torch.float32):
            error = (ring_sum(grads, dtype) - exact).norm() / exact.norm()
            row[str(dtype).removeprefix("torch.")] = error.item()
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- bucket views


def gradient_storage() -> dict:
    """On every rank: two steps of PyTorch's DDP on the lab's GPT with
    ``gradient_as_bucket_view`` off and on; for each, how many ``.grad`` tensors there are,
    in how many distinct storages they live, and how many bytes those storages hold. As
    views, the gradients live in DDP's buckets (from the second step on: the first
    rebuilds the buckets); otherwise each ``.grad`` is a tensor of its own, and the buckets
    hold a second copy of the gradients."""
    out = {}
    for as_view in (False, True):
        model = make_gpt().to(device())
        ddp = nn.parallel.DistributedDataParallel(
            model, bucket_cap_mb=0.5, gradient_as_bucket_view=as_view
        )
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        for step in range(2):
            idx, targets = my_share(step)
            optimizer.zero_grad(set_to_none=False)
            ddp(idx, targets)[1].backward()
            optimizer.step()
        grads = [p.grad for p in model.parameters()]
        storages = {g.untyped_storage().data_ptr(): g.untyped_storage().nbytes() for g in grads}
        out[as_view] = {
            "grads": len(grads),
            "storages": len(storages),
            "bytes": sum(storages.values()),
        }
    return out
