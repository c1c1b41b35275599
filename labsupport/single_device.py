"""Lab 4, one device faster: gradient accumulation, mixed precision, activation
checkpointing and operator fusion, each measured next to its formula.

* Gradient accumulation: with a mean-reduced loss, ``k`` micro-batches of size ``b``, each
  loss divided by ``k``, give the gradient of one batch of ``k*b``; so does averaging the
  gradients of ``k`` ranks with ``all_reduce`` (data parallelism, chapter 10).
* Mixed precision (Micikevicius et al. 2018, arXiv:1710.03740): compute in bf16/fp16, keep
  fp32 master weights, scale the loss so fp16 gradients do not underflow.
* Activation checkpointing (Chen et al. 2016, arXiv:1604.06174): keep only segment
  inputs, recompute the rest in backward; bytes counted with ``saved_tensors_hooks`` and a
  small dispatch-mode memory tracker.
* Fusion: a chain of ``k`` elementwise ops moves ``2k`` tensors through memory unfused and
  2 fused (``torch.compile``).
"""

from __future__ import annotations

import math
import statistics
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.checkpoint import checkpoint

# --------------------------------------------------------------------------- timing


def median_seconds(fn, *args, repeats: int = 7, warmup: int = 2) -> float:
    """Median wall time of ``fn(*args)`` over ``repeats`` runs, after ``warmup`` runs."""
    for _ in range(warmup):
        fn(*args)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn(*args)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


# --------------------------------------------------------------------------- accumulation


def make_mlp(seed: int = 0, d_in: int = 16, hidden: int = 32, d_out: int = 4, batchnorm=False):
    """A small MLP, the same on every rank for the same ``seed``; BatchNorm optional."""
    torch.manual_seed(seed)
    norm = [nn.BatchNorm1d(hidden)] if batchnorm else []
    return nn.Sequential(nn.Linear(d_in, hidden), *norm, nn.Tanh(), nn.Linear(hidden, d_out))


def make_data(seed: int = 1, n: int = 64, d_in: int = 16, d_out: int = 4):
    """A regression batch ``(x, y)`` made in code: ``n`` samples."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=gen), torch.randn(n, d_out, generator=gen)


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
    model = make_mlp(seed)
    x, y = make_data(n=n)
    shard = slice(rank * n // world, (rank + 1) * n // world)
    grad = batch_gradient(model, x[shard], y[shard])
    print(f"{n // world} samples, local gradient norm {grad.norm():.6f}")
    dist.all_reduce(grad, op=dist.ReduceOp.SUM)
    grad /= world
    return grad


# --------------------------------------------------------------------------- mixed precision

#: Unit roundoff u = 2^-(significand bits): the largest relative error of one rounding.
UNIT_ROUNDOFF = {torch.float32: 2.0**-24, torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8}
FP16_MAX = 65504.0


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


def matmul_seconds(n: int = 1024, repeats: int = 7) -> dict:
    """Median times of an ``n x n`` matmul in fp32 and under bf16 autocast (run in turns)."""
    a, b = torch.randn(n, n), torch.randn(n, n)

    def bf16():
        with torch.autocast("cpu", dtype=torch.bfloat16):
            return a @ b

    pairs = [
        (median_seconds(torch.matmul, a, b, repeats=1), median_seconds(bf16, repeats=1))
        for _ in range(repeats)
    ]
    fp32 = statistics.median(f for f, _ in pairs)
    low = statistics.median(h for _, h in pairs)
    return {"fp32": fp32, "bf16": low, "speedup": fp32 / low, "flops": 2 * n**3}


def cpu_bf16_flags() -> list[str]:
    """The CPU's native bf16 instruction sets (Linux ``/proc/cpuinfo``; empty elsewhere)."""
    path = Path("/proc/cpuinfo")
    flags = set(path.read_text().split()) if path.exists() else set()
    return sorted(f for f in ("avx512_bf16", "amx_bf16", "avx_vnni_bf16") if f in flags)


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
    x, y = make_data(seed=seed + 1, n=4096, d_in=64, d_out=8)
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

#: Activation elements each block keeps for backward, in units of its input (b x d):
#: fc1's input (1), GELU's input (4), fc2's input (4).
BLOCK_UNITS = 9


class Block(nn.Module):
    """A transformer-style MLP block: ``x + fc2(gelu(fc1(x)))``, hidden width ``4d``."""

    def __init__(self, d: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


def make_stack(layers: int = 16, d: int = 64, seed: int = 0) -> nn.ModuleList:
    """``layers`` blocks of width ``d``."""
    torch.manual_seed(seed)
    return nn.ModuleList(Block(d) for _ in range(layers))


def forward_stack(blocks, x, segment: int | None = None):
    """Run the blocks; with ``segment=s``, checkpoint every run of ``s`` blocks.

    A checkpointed segment keeps only its input; backward re-runs its forward to get the
    rest (``use_reentrant=False``, the implementation PyTorch recommends).
    """

    def run(h, start, stop):
        for block in blocks[start:stop]:
            h = block(h)
        return h

    if segment is None:
        return run(x, 0, len(blocks))
    for start in range(0, len(blocks), segment):
        x = checkpoint(run, x, start, start + segment, use_reentrant=False)
    return x


def saved_bytes(blocks, x, segment: int | None = None) -> int:
    """Bytes of activations the forward saves for backward (parameters not counted).

    ``saved_tensors_hooks`` sees every tensor an op saves; each storage counts once.
    """
    params = {p.untyped_storage().data_ptr() for p in blocks.parameters()}
    saved = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        forward_stack(blocks, x, segment)
    return sum(saved.values())


def saved_bytes_formula(layers: int, batch: int, d: int, segment=None, itemsize=4) -> int:
    """Saved activations: ``9·L·b·d`` elements without checkpointing, ``(L/s)·b·d`` with."""
    units = BLOCK_UNITS * layers if segment is None else math.ceil(layers / segment)
    return units * batch * d * itemsize


class LiveMemory(TorchDispatchMode):
    """Counts the bytes of tensors that ops create and that are still alive; keeps the peak.

    A CPU stand-in for ``torch.cuda.max_memory_allocated``: every op's new output storage
    is added when created and subtracted when freed (a ``weakref.finalize``). Views and
    in-place results share an input's storage and are not counted again.
    """

    def __init__(self):
        super().__init__()
        self.live = self.peak = 0
        self._seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {
            t.untyped_storage().data_ptr()
            for t in tree_flatten((args, kwargs))[0]
            if isinstance(t, torch.Tensor)
        }
        for t in tree_flatten(out)[0]:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in inputs or key in self._seen or size == 0:
                continue
            self._seen.add(key)
            self.live += size
            self.peak = max(self.peak, self.live)
            weakref.finalize(storage, self._free, key, size)
        return out

    def _free(self, key, size):
        self.live -= size
        self._seen.discard(key)


def step_memory(blocks, x, segment: int | None = None) -> dict:
    """Bytes alive after the forward and at the peak of forward + backward.

    The gradients' buffers are allocated before (as in a training loop after the first
    step), so what the tracker sees is activations and backward's temporary gradients.
    """
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    x = x.detach().requires_grad_()
    tracker = LiveMemory()
    with tracker:
        out = forward_stack(blocks, x, segment)
        after_forward = tracker.live
        out.sum().backward()
    return {"after_forward": after_forward, "peak": tracker.peak}


def peak_formula(layers: int, batch: int, d: int, segment=None, itemsize=4) -> int:
    """Chen et al.'s estimate of the peak: kept segment inputs plus one segment recomputed.

    ``(L/s + 9·s)·b·d`` elements with segments of ``s`` blocks, ``9·L·b·d`` without. The
    minimum over ``s`` is at ``s = sqrt(L/9)``: ``O(sqrt(L))`` memory.
    """
    if segment is None:
        units = BLOCK_UNITS * layers
    else:
        units = math.ceil(layers / segment) + BLOCK_UNITS * segment
    return units * batch * d * itemsize


def step_seconds(blocks, x, segment=None, repeats: int = 7) -> float:
    """Median time of one forward + backward through the blocks."""

    def step():
        for p in blocks.parameters():
            p.grad = None
        forward_stack(blocks, x, segment).sum().backward()

    return median_seconds(step, repeats=repeats)


def recompute_ratio(blocks, x, segment: int = 1, repeats: int = 7) -> dict:
    """Time of a checkpointed step over a plain one: the median of ``repeats`` pairs,
    each pair run back to back so both see the same load on a shared machine."""
    pairs = [
        (step_seconds(blocks, x, None, repeats=1), step_seconds(blocks, x, segment, repeats=1))
        for _ in range(repeats)
    ]
    return {
        "plain": statistics.median(p for p, _ in pairs),
        "checkpointed": statistics.median(c for _, c in pairs),
        "ratio": statistics.median(c / p for p, c in pairs),
    }


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
    x, y = make_data(n=60)
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
        blocks = make_stack(layers, d)
        measured = saved_bytes(blocks, torch.randn(batch, d), segment)
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


# --------------------------------------------------------------------------- figures


def checkpoint_memory_figure(layers: int = 16, batch: int = 512, d: int = 64):
    """Chapter 4: memory of a 16-block stack without and with checkpointing, measured
    (:class:`LiveMemory`) next to the formulas, for segments of 1 to 16 blocks."""
    from labsupport import plotting

    blocks = make_stack(layers, d)
    x = torch.randn(batch, d)
    unit = batch * d * 4
    segments = [1, 2, 4, 8, 16]
    cases = [None, *segments]
    measured = [step_memory(blocks, x, s) for s in cases]
    fig, ax = plotting.figure(7.5, 3.4)
    labels = ["none", *[str(s) for s in segments]]
    pos = range(len(cases))
    ax.bar([p - 0.2 for p in pos], [m["after_forward"] / unit for m in measured], 0.4,
           color=plotting.rank_color(0), label="kept after forward (measured)")  # fmt: skip
    ax.bar([p + 0.2 for p in pos], [m["peak"] / unit for m in measured], 0.4,
           color=plotting.rank_color(1), label="peak in forward + backward (measured)")  # fmt: skip
    kept = [saved_bytes_formula(layers, batch, d, s) / unit for s in cases]
    peak = [peak_formula(layers, batch, d, s) / unit for s in cases]
    ax.plot([p - 0.2 for p in pos], kept, "k_", ms=22, mew=2, label="formula: kept (L/s)")
    ax.plot([p + 0.2 for p in pos], peak, "k.", ms=9, label="formula: peak (L/s + 9s)")
    ax.set_xticks(list(pos), labels)
    ax.set_xlabel("checkpointed segment size s (blocks); 'none' = no checkpointing")
    ax.set_ylabel("memory (units of b·d·4 bytes)")
    ax.set_title(f"Activation memory of {layers} MLP blocks (b={batch}, d={d})")
    ax.legend(fontsize=8, frameon=False, loc="upper center")
    return fig


def mixed_precision_loop_figure():
    """Chapter 4: one step of mixed-precision training (Micikevicius et al. 2018, fig. 1)."""
    from matplotlib.patches import FancyBboxPatch

    from labsupport import plotting

    fig, ax = plotting.figure(10.0, 3.4)
    low, high = "#cfe3f3", "#f6dfb5"  # 16-bit, 32-bit

    def box(x, y, text, color, w, h=0.8):
        ax.add_patch(FancyBboxPatch((x, y), w, h, boxstyle="round,pad=0.04",
                                    facecolor=color, edgecolor="#555555"))  # fmt: skip
        ax.text(x + w / 2, y + h / 2, text, ha="center", va="center", fontsize=8.5)
        return x, y, w, h

    def arrow(a, b, text=None, dx=0.0, dy=0.0):
        ax.annotate("", xy=b, xytext=a, arrowprops={"arrowstyle": "->", "lw": 1.3})
        if text:
            mx, my = (a[0] + b[0]) / 2 + dx, (a[1] + b[1]) / 2 + dy
            ax.text(mx, my, text, fontsize=8, ha="center", color="#333333")

    w, gap = 2.6, 0.9
    xs = [i * (w + gap) for i in range(4)]
    top, bottom = 2.6, 0.4
    box(xs[0], top, "master weights\nfp32", high, w)
    box(xs[1], top, "weights\nbf16 / fp16", low, w)
    box(xs[2], top, "forward: matmuls\nin bf16 / fp16", low, w)
    box(xs[3], top, "loss in fp32,\ntimes scale S", high, w)
    box(xs[3], bottom, "backward: activation\ngradients in 16 bits", low, w)
    box(xs[2], bottom, "weight gradients\nto fp32, divided by S", high, w)
    box(xs[1], bottom, "inf or NaN found?\nskip step, halve S", "#eeeeee", w)
    box(xs[0], bottom, "optimizer update\nin fp32: w -= lr·g", high, w)
    for i in range(3):
        arrow((xs[i] + w, top + 0.4), (xs[i + 1], top + 0.4), "cast" if i == 0 else None, dy=0.1)
        arrow((xs[i + 1], bottom + 0.4), (xs[i] + w, bottom + 0.4),
              "finite" if i == 0 else None, dy=0.1)  # fmt: skip
    arrow((xs[3] + w / 2, top), (xs[3] + w / 2, bottom + 0.8))
    arrow((xs[0] + w / 2, bottom + 0.8), (xs[0] + w / 2, top))
    legend_x = xs[3] + w + 0.5
    ax.text(legend_x, 2.9, "16-bit", fontsize=8, va="center",
            bbox={"facecolor": low, "edgecolor": "#555555"})  # fmt: skip
    ax.text(legend_x, 2.3, "32-bit", fontsize=8, va="center",
            bbox={"facecolor": high, "edgecolor": "#555555"})  # fmt: skip
    ax.text(legend_x, 1.1, "S: loss scale\n(fp16; bf16 has\nfp32's range and\nneeds none)",
            fontsize=8, va="center")  # fmt: skip
    ax.set_xlim(-0.2, legend_x + 1.9)
    ax.set_ylim(0.2, 3.6)
    ax.axis("off")
    ax.set_title("One step of mixed-precision training")
    return fig
