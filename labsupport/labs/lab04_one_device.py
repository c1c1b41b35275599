"""Lab 4, one device faster: gradient accumulation, mixed precision, activation
checkpointing and operator fusion, each measured next to its formula.

* Gradient accumulation: with a mean-reduced loss, ``k`` micro-batches of size ``b``, each
  loss divided by ``k``, give the gradient of one batch of ``k*b``; so does averaging the
  gradients of ``k`` ranks with ``all_reduce`` (data parallelism, chapter 10), step after
  step of training.
* Mixed precision (Micikevicius et al. 2018, arXiv:1710.03740): compute in bf16/fp16, keep
  fp32 master weights, scale the loss so fp16 gradients do not underflow.
* Activation checkpointing (Chen et al. 2016, arXiv:1604.06174) on
  :class:`labsupport.models.MLPStack`: :mod:`labsupport.labs.lab04_checkpointing`.
* Fusion: a chain of ``k`` elementwise ops moves ``2k`` tensors through memory unfused and
  2 fused (``torch.compile``): :mod:`labsupport.labs.lab04_fusion`.

This module also holds the checkers of the lab's exercises.
"""

from __future__ import annotations

import itertools
import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.labs.cells import exercise
from labsupport.labs.lab04_checkpointing import saved_bytes
from labsupport.launch.progress import progress
from labsupport.launch.runtime import device
from labsupport.measure.timing import side_by_side
from labsupport.models import MLPStack, mse_loss, regression_data, train_one_process
from labsupport.parallel.data_parallel import all_reduce_gradients

#: fp32's unit roundoff: one rounding changes a value by at most this share of it.
FP32_UNIT_ROUNDOFF = 2.0**-24


def rounding_tolerance(reference: torch.Tensor, terms: int) -> float:
    """How far two fp32 computations of ``reference`` may differ when they add up
    ``terms`` values in different orders: ``terms · u · max|reference|``.

    Summing n numbers in fp32 makes an error of at most about n·u·Σ|terms| (Higham 2002,
    "Accuracy and Stability of Numerical Algorithms", section 4.2), with u = 2^-24. The
    terms are not at hand here, so the scale is the largest element of the sum: a
    practical tolerance, not a guarantee (it is smaller than Higham's bound where the
    terms cancel), which holds on every CPU and thread count the course is tested on.
    """
    return terms * FP32_UNIT_ROUNDOFF * reference.abs().max().item()


# --------------------------------------------------------------------------- accumulation


def make_mlp(seed: int = 0, d_in: int = 16, hidden: int = 32, d_out: int = 4, batchnorm=False):
    """A small MLP, the same on every rank for the same ``seed``; BatchNorm optional."""
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(hidden)] if batchnorm else []
    return nn.Sequential(nn.Linear(d_in, hidden), *norm, nn.Tanh(), nn.Linear(hidden, d_out))


def flat_grad(model: nn.Module) -> torch.Tensor:
    """All parameter gradients of ``model`` as one vector (a copy)."""
    return torch.cat([p.grad.detach().flatten() for p in model.parameters()]).clone()


def batch_gradient(model: nn.Module, x, y) -> torch.Tensor:
    """The gradient of the mean-squared error over the whole batch, in one backward."""
    model.zero_grad()
    F.mse_loss(model(x), y).backward()
    return flat_grad(model)


def accumulated_gradient(model: nn.Module, x, y, micro_batches: int) -> torch.Tensor:
    """Gradient accumulation: ``micro_batches`` equal chunks, each loss divided by their count.

    ``backward`` adds into ``.grad``; dividing each micro-batch's mean loss by ``k`` makes
    the sum the mean over the whole batch. Needs equal chunks (see exercise 1).
    """
    if len(x) % micro_batches:
        raise ValueError(f"{len(x)} samples do not split into {micro_batches} equal chunks")
    model.zero_grad()
    for xm, ym in zip(x.chunk(micro_batches), y.chunk(micro_batches), strict=True):
        (F.mse_loss(model(xm), ym) / micro_batches).backward()
    return flat_grad(model)


def data_parallel_gradient(seed: int = 0, n: int = 64) -> torch.Tensor:
    """On every rank: the same model, this rank's shard of the batch, then the average.

    Each rank computes the mean-loss gradient of its ``n / world`` samples; ``all_reduce``
    sums them over ranks and dividing by the world size gives the mean over the whole
    batch: gradient accumulation with the micro-batches on different processes. This is
    what ``DistributedDataParallel`` does (chapter 10).
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(seed).to(device())
    x, y = regression_data(n=n)
    shard = slice(rank * n // world, (rank + 1) * n // world)
    grad = batch_gradient(model, x[shard].to(device()), y[shard].to(device()))
    print(f"{len(x[shard])} of the {n} samples: the gradient of their mean loss")
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    grad /= world
    return grad.cpu()


#: The training runs of the lab: plain SGD on :func:`make_mlp`, the whole batch each step.
TRAIN_STEPS, TRAIN_LR = 300, 0.1


def flat_params(model: nn.Module) -> torch.Tensor:
    """All parameters of ``model`` as one vector (a copy)."""
    return torch.cat([p.detach().flatten() for p in model.parameters()]).clone()


def train(model: nn.Module, x, y, steps: int = TRAIN_STEPS, lr: float = TRAIN_LR) -> list:
    """``steps`` steps of SGD on the mean-squared error of the whole batch, on one process;
    returns the loss before each step."""
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    return train_one_process(model, optimizer, itertools.repeat((x, y), steps), mse_loss)


def data_parallel_training(
    steps: int = TRAIN_STEPS, lr: float = TRAIN_LR, seed: int = 0, n: int = 64
) -> dict:
    """On every rank: :func:`train`, with this rank's shard of the batch and the gradients
    averaged over the ranks before each step by ``all_reduce_gradients``
    (:mod:`labsupport.parallel.data_parallel`): what ``DistributedDataParallel`` does after
    ``backward`` (chapter 10 adds buckets and overlaps the sums with the backward pass).

    Every rank starts from the same weights (same seed) and applies the same averaged
    gradient, so the ranks stay identical, step after step, and follow the run of one
    process on the whole batch. A progress bar per rank shows the steps as they go.
    Returns the final weights and the loss of the whole batch before each step (the
    mean of the ranks' losses, as the shards are equal), on the CPU.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_mlp(seed).to(device())
    x, y = regression_data(n=n)
    shard = slice(rank * n // world, (rank + 1) * n // world)
    x, y = x[shard].to(device()), y[shard].to(device())
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    print(f"{len(x)} of the {n} samples, {steps} steps of SGD")
    losses = []
    for _ in progress(range(steps), "train"):
        optimizer.zero_grad()
        loss = F.mse_loss(model(x), y)
        loss.backward()
        all_reduce_gradients(model)
        optimizer.step()
        losses.append(loss.detach())
    losses = torch.stack(losses)
    dist.all_reduce(losses)
    return {"weights": flat_params(model).cpu(), "losses": (losses / world).cpu()}


# --------------------------------------------------------------------------- mixed precision


def rounding_error(x: torch.Tensor, dtype) -> float:
    """Relative (Frobenius) error of rounding ``x`` to ``dtype`` once."""
    return ((x.to(dtype).double() - x.double()).norm() / x.double().norm()).item()


def matmul_errors(n: int = 256, seed: int = 0) -> dict:
    """Relative error of ``a @ b`` in fp32 and under bf16 autocast, vs a float64 reference.

    Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the inputs are rounded to bf16,
    the products summed in fp32, and the output rounded to bf16: three independent
    roundings of Gaussian-like tensors, so the predicted error is ``sqrt(3)`` times the
    error of rounding one tensor.
    """
    gen = torch.Generator().manual_seed(seed)
    a, b = torch.randn(n, n, generator=gen), torch.randn(n, n, generator=gen)
    ref = a.double() @ b.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = a @ b

    def rel(c):
        return ((c.double() - ref).norm() / ref.norm()).item()

    one = rounding_error(a, torch.bfloat16)
    return {
        "fp32": rel(a @ b),
        "bf16": rel(low),
        "bf16_dtype": low.dtype,
        "one_rounding": one,
        "predicted_bf16": math.sqrt(3) * one,
    }


def matmul_seconds(n: int = 1024, rounds: int = 7) -> dict:
    """An ``n x n`` matmul in fp32 and under bf16 autocast, timed side by side: median
    seconds of each, the median per-round ratio fp32 / bf16 (the speed-up), and the
    dtype the timed bf16 matmul returns."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    t = side_by_side({"fp32": lambda: a @ b, "bf16": bf16}, rounds=rounds)
    return {
        "fp32": t["fp32"],
        "bf16": t["bf16"],
        "speedup": 1 / t["ratio"]["bf16"],
        "flops": 2 * n**3,
        "bf16_dtype": bf16().dtype,
    }


def repeated_update(dtype, w0: float = 1.0, update: float = 1e-3, steps: int = 1000) -> float:
    """Add ``update`` to a weight ``steps`` times, stored in ``dtype``: the final weight.

    An update smaller than half the spacing of ``dtype`` around ``w`` rounds away: why
    mixed precision keeps fp32 *master weights* and applies updates to them.
    """
    w = torch.tensor(w0, dtype=dtype)
    step = torch.tensor(update, dtype=dtype)
    for _ in range(steps):
        w = w + step
    return w.item()


def spacing(w: float, dtype) -> float:
    """The gap between ``w`` and the next larger number of ``dtype`` (its ulp)."""
    t = torch.tensor(w, dtype=dtype)
    return (torch.nextafter(t, torch.tensor(math.inf, dtype=dtype)) - t).item()


def make_amp_model(seed: int = 0):
    """A 3-layer MLP and a batch of 4096 samples for the loss-scaling experiment."""
    torch.manual_seed(seed)
    model = nn.Sequential(
        nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 8)
    )
    x, y = regression_data(n=4096, d_in=64, d_out=8, seed=seed + 1)
    return model, x, y


#: The experiment shrinks the loss by this factor to put its gradients where the paper
#: found many of a real network's: below fp16's smallest numbers.
SMALL_LOSS = 2.0**-10


def amp_gradient(model, x, y, dtype=None, loss_scale: float = 1.0) -> torch.Tensor:
    """Gradients (fp32, unscaled) of the small loss, forward under autocast in ``dtype``.

    The weights stay fp32 (the master weights); autocast runs the matmuls in ``dtype``,
    so the activation gradients flowing backward are ``dtype`` too. With ``loss_scale``
    the loss is multiplied before ``backward`` and the gradients divided after: a static
    loss scaler. ``dtype=None`` is the fp32 reference.
    """
    model.zero_grad()
    with torch.autocast("cpu", dtype=dtype or torch.bfloat16, enabled=dtype is not None):
        loss = F.mse_loss(model(x).float(), y) * SMALL_LOSS
    (loss * loss_scale).backward()
    return flat_grad(model) / loss_scale


def gradscaler_gradient(model, x, y, init_scale: float) -> torch.Tensor:
    """The same fp16 gradients through PyTorch's ``torch.amp.GradScaler`` (scale, unscale)."""
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model.zero_grad()
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y) * SMALL_LOSS
    scaler.scale(loss).backward()
    scaler.unscale_(optimizer)
    return flat_grad(model)


def gradscaler_overflow_step(init_scale: float = 2.0**40) -> dict:
    """One ``GradScaler`` step with a scale so large that fp16 gradients overflow.

    ``scaler.step`` finds inf in the gradients and skips the update; ``scaler.update``
    halves the scale (``backoff_factor=0.5``). A dynamic scaler finds its scale this way.
    """
    model, x, y = make_amp_model()
    scaler = torch.amp.GradScaler("cpu", init_scale=init_scale)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    with torch.autocast("cpu", dtype=torch.float16):
        loss = F.mse_loss(model(x).float(), y) * SMALL_LOSS
    scaler.scale(loss).backward()
    scaler.step(optimizer)
    scaler.update()
    unchanged = all(torch.equal(b, p) for b, p in zip(before, model.parameters(), strict=True))
    return {"scale_before": init_scale, "scale_after": scaler.get_scale(), "skipped": unchanged}


# --------------------------------------------------------------------------- exercises


@exercise
def check_accumulation(fn) -> str:
    """Exercise 1: ``fn(model, x, y, sizes)`` accumulates over micro-batches of the given
    (possibly unequal) ``sizes``; it must equal the whole batch's gradient."""
    model = make_mlp()
    x, y = regression_data(n=60)
    want = batch_gradient(model, x, y)
    tolerance = rounding_tolerance(want, len(x))  # the gradient sums over the 60 samples
    splits = ([60], [30, 30], [40, 20], [7, 13, 40], [1] * 60)
    for sizes in splits:
        model.zero_grad()
        got = fn(model, x, y, sizes)
        assert isinstance(got, torch.Tensor) and got.shape == want.shape, (
            f"sizes={sizes}: return the flat gradient, flat_grad(model), a tensor of shape "
            f"{tuple(want.shape)}; got {got!r:.60}"
        )
        hint = ""
        if torch.allclose(got, want * len(sizes), atol=len(sizes) * tolerance):
            hint = f" ({len(sizes)} times too big: the micro-batch losses need a weight)"
        assert (got - want).abs().max() <= tolerance, (
            f"sizes={sizes}: max difference {(got - want).abs().max():.2e} from the whole "
            f"batch's gradient{hint}"
        )
    return f"{len(splits)} splits of 60 samples, equal and unequal, give the batch's gradient"


@exercise
def check_saved_bytes(fn) -> str:
    """Exercise 2: ``fn(layers, batch, d, segment)`` predicts the bytes the forward saves
    with checkpointing every ``segment`` blocks; checked against the measurement."""
    cases = [(4, 8, 16, 1), (6, 4, 8, 2), (8, 2, 16, 3), (5, 3, 8, 5), (7, 2, 8, 2)]
    for layers, batch, d, segment in cases:
        measured = saved_bytes(MLPStack(layers, d), torch.randn(batch, d), segment)
        got = fn(layers, batch, d, segment)
        assert got == measured, (
            f"layers={layers}, batch={batch}, d={d}, segment={segment}: you predict {got} "
            f"bytes, the forward saved {measured}"
        )
    return f"{len(cases)} stacks and segment sizes, byte for byte against the forward"


def checkpoint_peak_units(layers: int, units_per_block: float, segment: int) -> float:
    """Chen et al.'s peak, in units of one block's input: ``ceil(L/c) + m·c`` for segments
    of ``c`` blocks that each save ``m`` units (the kept segment inputs, plus the segment
    backward is rebuilding)."""
    return math.ceil(layers / segment) + units_per_block * segment


def best_segment_length(layers: int, units_per_block: float) -> int:
    """The segment length ``c`` (1 to ``layers``) with the smallest
    :func:`checkpoint_peak_units`; of equal peaks, the shortest, which recomputes least
    (exercise 3's answer, for its checker)."""
    return min(
        range(1, layers + 1), key=lambda c: checkpoint_peak_units(layers, units_per_block, c)
    )


@exercise
def check_best_segment(fn) -> str:
    """Exercise 3: ``fn(layers, units_per_block)`` is the segment length with the lowest
    peak, the shortest of equal ones."""
    cases = [(16, 9), (96, 57), (100, 1), (1000, 1), (50, 2), (7, 1), (64, 4), (1, 5), (3, 100)]
    for layers, units in cases:
        got, want = fn(layers, units), best_segment_length(layers, units)
        label = f"layers={layers}, units_per_block={units}"
        assert isinstance(got, int) and 1 <= got <= layers, (
            f"{label}: expected a whole number of blocks from 1 to {layers}, got {got!r}"
        )
        peak = checkpoint_peak_units(layers, units, got)
        best = checkpoint_peak_units(layers, units, want)
        assert peak == best, (
            f"{label}: segments of {got} blocks peak at {peak:g} units; another length "
            f"peaks lower, at {best:g}"
        )
        assert got == want, (
            f"{label}: {got} blocks reach the lowest peak, {best:g} units, but so does a "
            "shorter segment, which recomputes less"
        )
    return f"{len(cases)} stacks, from 1 to 1,000 blocks: the lowest peak, and the shortest segment"
