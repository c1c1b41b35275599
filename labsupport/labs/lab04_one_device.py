"""Lab 4, one device faster: gradient accumulation, mixed precision, activation
checkpointing and operator fusion, each measured next to its formula.

* Gradient accumulation: with a mean-reduced loss, ``k`` micro-batches of size ``b``, each
  loss divided by ``k``, give the gradient of one batch of ``k*b``; so does averaging the
  gradients of ``k`` ranks with ``all_reduce`` (data parallelism, chapter 10).
* Mixed precision (Micikevicius et al. 2018, arXiv:1710.03740): compute in bf16/fp16, keep
  fp32 master weights, scale the loss so fp16 gradients do not underflow.
* Activation checkpointing (Chen et al. 2016, arXiv:1604.06174) on
  :class:`labsupport.models.MLPStack`; formulas in :mod:`labsupport.estimate.memory`,
  measurements in :mod:`labsupport.measure.memory`.
* Fusion: a chain of ``k`` elementwise ops moves ``2k`` tensors through memory unfused and
  2 fused (``torch.compile``).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from labsupport.estimate.dtypes import FORMATS
from labsupport.launch.runtime import device
from labsupport.measure.memory import LiveMemory, saved_tensors
from labsupport.measure.timing import side_by_side
from labsupport.models import MLPStack, regression_data

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
    print(f"rank {rank}: {len(x[shard])} samples, the mean loss of its shard")
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    grad /= world
    return grad.cpu()


# --------------------------------------------------------------------------- mixed precision

FP16_MAX = FORMATS["fp16"].max  # 65504


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
    seconds of each and the median per-round ratio fp32 / bf16 (the speed-up)."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    t = side_by_side({"fp32": lambda: a @ b, "bf16": bf16}, rounds=rounds)
    return {"fp32": t["fp32"], "bf16": t["bf16"], "speedup": 1 / t["ratio"]["bf16"],
            "flops": 2 * n**3}  # fmt: skip


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


# --------------------------------------------------------------------------- checkpointing


def saved_bytes(stack: MLPStack, x, segment: int | None = None) -> int:
    """Bytes of activations the forward of ``stack`` saves for backward, parameters not
    counted (:func:`labsupport.measure.memory.saved_tensors`)."""
    with saved_tensors(exclude=stack) as saved:
        stack(x, segment)
    return saved.nbytes


def step_memory(stack: MLPStack, x, segment: int | None = None) -> dict:
    """Bytes alive after the forward and at the peak of forward + backward.

    The gradients' buffers are allocated before (as in a training loop after the first
    step), so what the tracker sees is activations and backward's temporary gradients.
    """
    for p in stack.parameters():
        p.grad = torch.zeros_like(p)
    x = x.detach().requires_grad_()
    with LiveMemory() as tracker:
        out = stack(x, segment)
        after_forward = tracker.live
        out.sum().backward()
    return {"after_forward": after_forward, "peak": tracker.peak}


def recompute_ratio(stack: MLPStack, x, segment: int = 1, rounds: int = 7) -> dict:
    """Time of a checkpointed training step over a plain one, timed side by side
    (:func:`labsupport.measure.timing.side_by_side`)."""

    def step(segment):
        for p in stack.parameters():
            p.grad = None
        stack(x, segment).sum().backward()

    t = side_by_side({"plain": lambda: step(None), "checkpointed": lambda: step(segment)},
                     rounds=rounds)  # fmt: skip
    return {"plain": t["plain"], "checkpointed": t["checkpointed"],
            "ratio": t["ratio"]["checkpointed"]}  # fmt: skip


#: Backward costs about twice the forward, so fwd+bwd = 3 forwards; recomputing adds one.
RECOMPUTE_PREDICTION = 4 / 3


# --------------------------------------------------------------------------- fusion


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


def tiled_chain(x: torch.Tensor, block: int = 2**15) -> torch.Tensor:
    """Fusion by hand, without a compiler: run the whole chain on one cache-sized block at a
    time, so the intermediates stay in cache and main memory sees one read and one write."""
    out = torch.empty_like(x)
    flat_in, flat_out = x.reshape(-1), out.reshape(-1)
    for start in range(0, flat_in.numel(), block):
        piece = flat_out[start : start + block]
        piece.copy_(flat_in[start : start + block])
        chain_in_place(piece)
    return out


def fused_chain():
    """``(function, how)``: the chain compiled into one loop by ``torch.compile``, or, where
    compiling fails (no C++ compiler), the hand-tiled version."""
    compiled = torch.compile(elementwise_chain)
    try:
        compiled(torch.ones(1024))
        return compiled, "torch.compile"
    except Exception:  # noqa: BLE001 - any compiler failure: fall back
        return tiled_chain, "tiled by hand (torch.compile failed)"


def chain_bytes(n: int, ops: int = CHAIN_OPS, fused: bool = False, itemsize: int = 4) -> int:
    """Bytes the chain moves through memory: each unfused op reads and writes ``n`` elements;
    the fused chain reads the input and writes the output once."""
    return (2 if fused else 2 * ops) * n * itemsize


# --------------------------------------------------------------------------- exercises


def check_accumulation(fn) -> None:
    """Exercise 1: ``fn(model, x, y, sizes)`` accumulates over micro-batches of the given
    (possibly unequal) ``sizes``; it must equal the whole batch's gradient."""
    model = make_mlp()
    x, y = regression_data(n=60)
    want = batch_gradient(model, x, y)
    for sizes in ([60], [30, 30], [40, 20], [7, 13, 40], [1] * 60):
        model.zero_grad()
        got = fn(model, x, y, sizes)
        assert got.shape == want.shape, f"sizes={sizes}: got shape {tuple(got.shape)}"
        assert torch.allclose(got, want, atol=1e-6), (
            f"sizes={sizes}: max difference {(got - want).abs().max():.2e} from the batch gradient"
        )
    print("Correct: every split gives the whole batch's gradient.")


def check_saved_bytes(fn) -> None:
    """Exercise 2: ``fn(layers, batch, d, segment)`` predicts the bytes the forward saves
    with checkpointing every ``segment`` blocks; checked against the measurement."""
    for layers, batch, d, segment in [(4, 8, 16, 1), (6, 4, 8, 2), (8, 2, 16, 3), (5, 3, 8, 5)]:
        measured = saved_bytes(MLPStack(layers, d), torch.randn(batch, d), segment)
        got = fn(layers, batch, d, segment)
        assert got == measured, (
            f"L={layers}, b={batch}, d={d}, segment={segment}: you predict {got} bytes, "
            f"the forward saved {measured}"
        )
    print("Correct: your formula matches the bytes saved, segment by segment.")


def largest_safe_scale(max_grad: float) -> float:
    """The largest power of two ``S`` with ``max_grad · S <= 65504`` (fp16's largest)."""
    return 2.0 ** math.floor(math.log2(FP16_MAX / max_grad))


def check_loss_scale(fn) -> None:
    """Exercise 3: ``fn(max_grad)`` is the largest power-of-two scale that does not overflow."""
    for max_grad in (1.0, 1e-3, 3.7e-6, 0.02, 65504.0, 100.0):
        got, want = fn(max_grad), largest_safe_scale(max_grad)
        assert got == want, f"max_grad={max_grad}: got {got}, expected {want}"
    print("Correct: the largest power-of-two scale that keeps fp16 finite.")
