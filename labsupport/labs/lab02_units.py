"""Lab 2, units: format tables, what casts to 16 bits do to gradients, all-reducing in
each dtype on several ranks, and the exercises' checkers.

Parameter counts are in :mod:`labsupport.estimate.params` and
:mod:`labsupport.measure.memory`, dtypes and formats in :mod:`labsupport.estimate.dtypes`,
bytes in :mod:`labsupport.estimate.units`, the drawings in :mod:`labsupport.viz.dtypes`.
Mixed precision follows Micikevicius et al., "Mixed Precision Training", ICLR 2018.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import nn

from labsupport import comm
from labsupport.estimate.dtypes import FORMATS, bits, to_dtype
from labsupport.estimate.params import gpt_params
from labsupport.labs.cells import exercise
from labsupport.launch.runtime import device
from labsupport.measure.memory import count_parameters
from labsupport.models import GPT, GPTConfig, tiny_gpt


def format_rows() -> list[dict]:
    """One row per format: bits, range and precision from the formulas of :class:`FloatFormat`."""
    return [
        {
            "format": f.name,
            "bits (s-e-m)": f"{f.bits} (1-{f.exponent}-{f.mantissa})",
            "max": f"{f.max:.6g}",
            "smallest normal": f"{f.smallest_normal:.4g}",
            "smallest subnormal": f"{f.smallest_subnormal:.4g}",
            "eps": f"2^-{f.mantissa} = {f.eps:.3g}",
            "digits": f"{f.decimal_digits:.1f}",
        }
        for f in FORMATS.values()
    ]


def cast_report(values: torch.Tensor, dtype, scale: float = 1.0) -> dict:
    """What casting ``values * scale`` to ``dtype`` does to the nonzero ``values``.

    Returns the fractions that become zero (underflow), infinite (overflow) or
    subnormal (kept, with fewer significant bits), and the median relative error of
    those that stay finite and nonzero, after dividing the scale back out in float32.
    """
    dtype = to_dtype(dtype)
    nonzero = values[values != 0].to(torch.float32)
    cast = (nonzero * scale).to(dtype)
    back = cast.to(torch.float32) / scale
    zero, inf = cast == 0, torch.isinf(cast)
    tiny = torch.finfo(dtype).smallest_normal
    subnormal = (cast.abs() < tiny) & ~zero
    kept = ~zero & ~inf
    rel = ((back[kept] - nonzero[kept]) / nonzero[kept]).abs()
    n = nonzero.numel()
    return {
        "scale": scale,
        "zero": zero.sum().item() / n,
        "inf": inf.sum().item() / n,
        "subnormal": subnormal.sum().item() / n,
        "median rel. error": rel.median().item() if rel.numel() else float("nan"),
    }


def loss_scale_sweep(values: torch.Tensor, dtype="fp16", powers=range(0, 33, 2)) -> list[dict]:
    """:func:`cast_report` for the loss scales ``2^k``, ``k`` in ``powers``."""
    return [cast_report(values, dtype, 2.0**k) | {"log2 scale": k} for k in powers]


def sweep_rows(sweep: list[dict], dtype="fp16") -> list[dict]:
    """Rows of :func:`loss_scale_sweep` for a table, at a precision every machine prints
    alike: percentages of millions of values, and the median relative error in units of
    the format's unit roundoff ``u = 2^-(mantissa + 1)``, the largest relative error of
    rounding a normal number (``u = 2^-11`` for fp16), to two digits.

    The gradients the lab sweeps come out of float32 matrix products, whose last bits
    differ between CPUs (vector width, BLAS kernel, threads); the tests check that a
    relative change of 1e-4 of every value, a hundred times the largest difference
    measured between two CPUs, leaves these rows unchanged.
    """
    u = torch.finfo(to_dtype(dtype)).eps / 2
    return [
        {
            "S": f"2^{r['log2 scale']}",
            "zero": f"{r['zero']:.2%}",
            "subnormal": f"{r['subnormal']:.2%}",
            "inf": f"{r['inf']:.3%}",
            "median rel. error / u": f"{r['median rel. error'] / u:.2g}",
        }
        for r in sweep
    ]


def tiny_gpt_gradients(vocab_size: int = 4096, batch: int = 8, seed: int = 0) -> dict:
    """The gradients of one backward pass of a tiny GPT on random tokens, in float32.

    ``"logits"``: the gradient of the mean cross-entropy loss with respect to the logits,
    ``(softmax - onehot) / tokens``, the first gradient backward computes; its entries
    shrink as ``1 / (vocab_size x tokens)``. ``"parameters"``: every weight's gradient.
    """
    model = tiny_gpt(seed, vocab_size=vocab_size)
    g = torch.Generator().manual_seed(seed)
    shape = (batch, model.config.block_size + 1)
    tokens = torch.randint(0, vocab_size, shape, generator=g)
    logits, _ = model(tokens[:, :-1])
    logits.retain_grad()
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    return {
        "tokens": batch * model.config.block_size,
        "logits": logits.grad.flatten(),
        "parameters": torch.cat([p.grad.flatten() for p in model.parameters()]),
    }


ALL_REDUCE_CASES = (("fp32", 1.0), ("bf16", 1.0), ("fp16", 1.0), ("fp16", 2.0**16))
"""(dtype, loss scale) pairs :func:`all_reduce_in_dtypes` tries."""


def all_reduce_in_dtypes(numel: int = 4096, scale: float = 1e-3, seed: int = 0) -> dict:
    """Run on every rank: all-reduce (sum) one gradient in fp32, bf16 and fp16.

    Each rank makes its own gradient (``randn * scale``, seeded by rank) and, for each
    (dtype, loss scale) of :data:`ALL_REDUCE_CASES`, multiplies it by the loss scale,
    casts it to the dtype and sums it over the ranks twice: with
    ``torch.distributed.all_reduce``, to measure the error (after dividing the scale
    back out) against an exact float64 sum, and with the course's ring
    (:func:`labsupport.comm.all_reduce`) inside
    :func:`~labsupport.comm.count_traffic`, to count the bytes this rank sends.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    grad = (torch.randn(numel, generator=gen, dtype=torch.float64) * scale).to(device())
    exact = grad.clone()
    dist.all_reduce(exact)
    out = {"rank": rank, "world_size": world, "cases": []}
    for name, loss_scale in ALL_REDUCE_CASES:
        summed = (grad * loss_scale).to(to_dtype(name))
        dist.all_reduce(summed)
        result = summed.double() / loss_scale
        with comm.count_traffic() as traffic:
            comm.all_reduce((grad * loss_scale).to(to_dtype(name)), algorithm="ring")
        out["cases"].append(
            {
                "dtype": name,
                "loss scale": loss_scale,
                "relative error": ((result - exact).norm() / exact.norm()).item(),
                "zeros": int((summed == 0).sum()),
                "infs": int(torch.isinf(summed).sum()),
                "bytes sent": traffic.bytes_sent,
                "checksum": float(result.sum()),
            }
        )
    return out


def ddp_gradient_dtypes(compress: bool = False, seed: int = 0) -> dict:
    """Run on every rank: one backward of ``DistributedDataParallel`` under bf16 autocast.

    Autocast runs the matmuls in bf16 on bf16 copies of the weights, but the parameters
    stay fp32, so their gradients are fp32 too, and so is every bucket DDP hands to the
    all-reduce: 4 bytes per gradient. A communication hook records each bucket's dtype
    and length, then passes the bucket to one of PyTorch's hooks
    (``torch.distributed.algorithms.ddp_comm_hooks.default_hooks``): ``allreduce_hook``,
    what DDP does without a hook, or with ``compress`` ``bf16_compress_hook``, which casts
    the bucket to bf16 for the all-reduce (2 bytes per gradient) and back to fp32 after,
    so that every gradient it returns is a bf16 number.
    """
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel

    rank = dist.get_rank()
    torch.manual_seed(seed)  # the same weights on every rank
    model = nn.Sequential(nn.Linear(64, 256), nn.GELU(), nn.Linear(256, 8)).to(device())
    ddp = DistributedDataParallel(model)
    pytorch_hook = default_hooks.bf16_compress_hook if compress else default_hooks.allreduce_hook
    buckets = []

    def recording_hook(state, bucket):
        buffer = bucket.buffer()
        buckets.append({"dtype": str(buffer.dtype).removeprefix("torch."), "numel": buffer.numel()})
        return pytorch_hook(state, bucket)

    ddp.register_comm_hook(None, recording_hook)
    gen = torch.Generator().manual_seed(seed + 1 + rank)  # this rank's share of the batch
    x = torch.randn(32, 64, generator=gen).to(device())
    with torch.autocast(device().type, dtype=torch.bfloat16):
        out = ddp(x)
    out.float().pow(2).mean().backward()
    grads = [p.grad for p in model.parameters()]
    return {
        "rank": rank,
        "output dtype": str(out.dtype).removeprefix("torch."),
        "param dtype": str(next(model.parameters()).dtype).removeprefix("torch."),
        "grad dtype": str(grads[0].dtype).removeprefix("torch."),
        "buckets": buckets,
        "bf16 numbers": all(torch.equal(g, g.bfloat16().float()) for g in grads),
        "grads": torch.cat([g.flatten() for g in grads]).cpu(),
    }


@exercise
def check_untied_gpt_params(fn) -> str:
    """Exercise 1: ``fn(vocab_size, block_size, n_embd, n_layer)`` for a GPT with no biases
    (LayerNorms without bias) and an untied output layer, checked against models built
    on the meta device."""
    cases = [(50257, 1024, 768, 12), (32000, 4096, 4096, 2), (256, 64, 64, 3), (1000, 8, 16, 1)]
    for vocab, block, d, layers in cases:
        config = GPTConfig(vocab, block, layers, 1, d, bias=False, tie_weights=False)
        with torch.device("meta"):
            want = count_parameters(GPT(config))
        got = fn(vocab, block, d, layers)
        hint = ""
        if got == gpt_params(vocab, block, d, layers):
            hint = " (that is GPT-2's count: drop the biases, add the output layer)"
        elif got == want - vocab * d:
            hint = " (the untied output layer is a second V x d matrix)"
        elif got > want:
            hint = " (too many: with bias=False no Linear or LayerNorm has a bias)"
        assert got == want, (
            f"V={vocab}, P={block}, d={d}, L={layers}: got {got:,}, the model has {want:,}{hint}"
        )
    return f"the parameter counts of {len(cases)} GPTs without biases or tying, built and counted"


@exercise
def check_safe_loss_scale(fn) -> str:
    """Exercise 2: ``fn(grads)``, the largest power of two ``S`` (possibly below 1) with
    ``max|grads| x S <= 65504``, fp16's largest finite number."""
    fp16_max = torch.finfo(torch.float16).max
    gen = torch.Generator().manual_seed(2)
    cases = [
        torch.randn(1000, generator=gen) * 1e-3,
        torch.randn(1000, generator=gen) * 3e-7,
        torch.tensor([1.0, -2.0, 0.5]),
        torch.tensor([1e6, 3.0]),
        torch.tensor([-0.37]),
    ]
    for grads in cases:
        peak = grads.abs().max().item()
        want = 2.0 ** math.floor(math.log2(fp16_max / peak))
        got = float(fn(grads.clone()))
        assert got > 0 and math.log2(got) == int(math.log2(got)), f"{got} is not a power of two"
        assert got <= want, (
            f"max |g| = {peak:.3g}: scale {got:g} takes max |g| x S above 65504, fp16's "
            "largest number"
        )
        assert got == want, f"max |g| = {peak:.3g}: scale {got:g} is safe, but a larger one is too"
    return f"the largest safe power of two for {len(cases)} sets of gradients, tiny to huge"


@exercise
def check_decode(fn) -> str:
    """Exercise 3: ``fn(pattern, exponent_bits, mantissa_bits)`` decodes a pattern such as
    ``"1 01111 1000000000"`` (what :func:`bits` returns) to its value: normals and
    subnormals of every format, checked against the value torch stores."""
    values = [1.0, -1.5, 0.1, 1 / 3, 3.0e4, 448.0, 2.0**-7, -(2.0**-9), 5.96e-8, 1e-40, 0.0]
    checked = 0
    for name in ("fp32", "fp16", "bf16", "fp8 e4m3", "fp8 e5m2"):
        f = FORMATS[name]
        dtype = getattr(torch, f.dtype)
        for value in values:
            stored = torch.tensor(value, dtype=torch.float64).to(dtype)
            if not math.isfinite(float(stored)):
                continue
            pattern = bits(value, dtype)
            got, want = fn(pattern, f.exponent, f.mantissa), float(stored)
            hint = ""
            if pattern.split()[1].strip("0") == "" and want != 0:
                hint = " (an all-zeros exponent holds the subnormals)"
            assert got == want, f"{name} {pattern}: got {got!r}, stored value is {want!r}{hint}"
            checked += 1
    return f"{checked} bit patterns of fp32, fp16, bf16 and both fp8 formats, subnormals included"
