"""Lab 2, units: parameter counts, bytes per dtype, binary and decimal prefixes, bit layouts.

* Counting: :func:`count_parameters` counts a module's parameters (a tied weight once),
  :func:`storage_bytes` measures the bytes their storage really takes, and
  :func:`gpt2_params`, :func:`mlp_params`, :func:`cnn_params` are the closed forms the
  lab checks them against (the models are in :mod:`labsupport.models`).
* Sizes: :func:`dtype_bytes` (a torch dtype or a name such as ``"bf16"``),
  :func:`param_bytes`, and :func:`format_bytes`, which prints either binary (IEC: KiB,
  MiB, ... powers of 1024) or decimal (SI: kB, MB, ... powers of 1000) units.
* Formats: :data:`FORMATS` describes each floating-point format by its sign, exponent
  and mantissa bits; its range and precision follow from them
  (:class:`FloatFormat`), and the lab checks them against ``torch.finfo``.
  :func:`bits` shows the fields of a number stored in a dtype.
* Mixed precision: :func:`cast_report` and :func:`loss_scale_sweep` measure how many
  values a cast to a low-precision dtype flushes to zero or overflows, with and without
  a loss scale (Micikevicius et al., "Mixed Precision Training", ICLR 2018).
* On several ranks: :func:`all_reduce_in_dtypes` all-reduces one gradient in several
  dtypes and measures the error and the bytes each rank sends.

Sources: IEEE 754-2019 (binary16, binary32); bfloat16 (Kalamkar et al., 2019,
arXiv:1905.12322); TF32 (NVIDIA A100 architecture); FP8 E4M3 and E5M2 (Micikevicius et
al., "FP8 Formats for Deep Learning", 2022, arXiv:2209.05433, and the OCP 8-bit
floating point specification, 2023); binary prefixes (IEC 80000-13).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import matplotlib.pyplot as plt
import torch
from torch import nn

from labsupport import plotting

# --------------------------------------------------------------------------- counting


def count_parameters(module: nn.Module, trainable_only: bool = False) -> int:
    """The number of parameters of ``module``; a weight shared by two layers counts once.

    ``module.parameters()`` already yields a shared (tied) parameter only once, which is
    what makes GPT-2's tied embedding and output layer count as one matrix.
    """
    return sum(p.numel() for p in module.parameters() if p.requires_grad or not trainable_only)


def storage_bytes(tensors) -> int:
    """Bytes of memory the storages of ``tensors`` (or a module's parameters) occupy.

    Measured from each tensor's storage, not computed from its shape and dtype; a storage
    shared by several tensors (tied weights, views) is counted once.
    """
    if isinstance(tensors, nn.Module):
        tensors = list(tensors.parameters())
    seen, total = set(), 0
    for t in tensors:
        storage = t.untyped_storage()
        key = (t.device, storage.data_ptr()) if not t.is_meta else id(t)
        if key not in seen:
            seen.add(key)
            total += storage.nbytes()
    return total


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


def gpt2_params(vocab_size: int, block_size: int, n_embd: int, n_layer: int) -> int:
    """Closed form for GPT-2 with tied embeddings (:class:`labsupport.models.GPT`).

    Embeddings ``V*d + P*d``; per layer ``12*d**2 + 13*d`` (attention: ``4*d**2 + 4*d``,
    MLP: ``8*d**2 + 5*d``, two LayerNorms: ``4*d``); final LayerNorm ``2*d``; the output
    layer reuses the token embedding, so it adds nothing.
    """
    d = n_embd
    return vocab_size * d + block_size * d + n_layer * (12 * d * d + 13 * d) + 2 * d


def gpt2_breakdown(vocab_size: int, block_size: int, n_embd: int, n_layer: int) -> list[dict]:
    """The terms of :func:`gpt2_params`, as rows for a table."""
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


def format_count(n: float) -> str:
    """A parameter count the three ways papers and the notes write it: M, 亿 (10^8), B."""
    return f"{n / 1e6:,.1f}M = {n / 1e8:,.2f}亿 = {n / 1e9:.3f}B"


# --------------------------------------------------------------------------- dtypes and bytes

_ALIASES = {
    torch.float64: ("fp64", "float64", "double"),
    torch.float32: ("fp32", "float32", "float", "tf32"),  # TF32 is stored as float32
    torch.float16: ("fp16", "float16", "half"),
    torch.bfloat16: ("bf16", "bfloat16"),
    torch.float8_e4m3fn: ("fp8_e4m3", "float8_e4m3fn", "fp8_e4m3fn", "e4m3"),
    torch.float8_e5m2: ("fp8_e5m2", "float8_e5m2", "e5m2"),
    torch.int64: ("int64", "long"),
    torch.int32: ("int32", "int"),
    torch.int16: ("int16", "short"),
    torch.int8: ("int8",),
    torch.uint8: ("uint8",),
    torch.bool: ("bool",),
}
DTYPE_NAMES = {alias: dtype for dtype, aliases in _ALIASES.items() for alias in aliases}
"""Names :func:`to_dtype` accepts (with or without a ``torch.`` prefix, any case)."""


def to_dtype(dtype) -> torch.dtype:
    """A ``torch.dtype`` from a dtype or a name: ``"bf16"``, ``"bfloat16"``, ``"fp8_e4m3"``.

    ``"tf32"`` gives ``torch.float32``: TF32 is a format tensor cores compute in, and a
    TF32 value is stored in a 32-bit float.
    """
    if isinstance(dtype, torch.dtype):
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(f"expected a torch.dtype or a name such as 'bf16', got {dtype!r}")
    name = dtype.strip().lower().removeprefix("torch.")
    try:
        return DTYPE_NAMES[name]
    except KeyError:
        known = ", ".join(sorted(DTYPE_NAMES))
        raise ValueError(f"unknown dtype name {dtype!r}; known names: {known}") from None


def dtype_bytes(dtype) -> int:
    """Bytes per element of ``dtype`` (a ``torch.dtype`` or a name such as ``"bf16"``)."""
    return to_dtype(dtype).itemsize


def param_bytes(num_params: int, dtype) -> int:
    """Bytes to store ``num_params`` values of ``dtype``: ``num_params x dtype_bytes``."""
    if num_params < 0:
        raise ValueError(f"num_params must be non-negative, got {num_params}")
    return int(num_params) * dtype_bytes(dtype)


PREFIXES = {
    "iec": (1024, ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB")),
    "si": (1000, ("B", "kB", "MB", "GB", "TB", "PB", "EB")),
}
"""IEC binary prefixes (kibi = 2^10, ...) and SI decimal prefixes (kilo = 10^3, ...)."""


def format_bytes(n: float, standard: str = "iec", decimals: int = 1) -> str:
    """``n`` bytes with binary (``"iec"``: KiB = 1024 B) or decimal (``"si"``: kB = 1000 B)
    prefixes: ``format_bytes(440e6)`` is ``"419.6 MiB"``, with ``"si"`` ``"440 MB"``.

    Uses the largest unit the value reaches, ``decimals`` decimals, none when the value
    is a whole number of that unit, and plain bytes below one kilobyte.
    """
    try:
        base, units = PREFIXES[standard]
    except KeyError:
        raise ValueError(f"standard must be 'iec' or 'si', got {standard!r}") from None
    sign, value = ("-" if n < 0 else ""), abs(n)
    power = 0
    while power < len(units) - 1 and round(value / base**power, decimals) >= base:
        power += 1
    scaled = value / base**power
    if power == 0 or scaled == int(scaled):
        return f"{sign}{scaled:.0f} {units[power]}"
    return f"{sign}{scaled:.{decimals}f} {units[power]}"


# --------------------------------------------------------------------------- float formats


@dataclass(frozen=True)
class FloatFormat:
    """A binary floating-point format: 1 sign bit, ``exponent`` bits, ``mantissa`` bits.

    A normal number is ``(-1)^s x 1.m x 2^(e - bias)`` with ``bias = 2^(exponent-1) - 1``;
    the all-zeros exponent holds zero and the subnormals ``(-1)^s x 0.m x 2^(1 - bias)``.
    IEEE-style formats reserve the all-ones exponent for infinities and NaN.
    ``finite_only`` formats (FP8 E4M3) keep no infinity: the all-ones exponent holds
    normal numbers, and only the all-ones mantissa with it is NaN.
    """

    name: str
    exponent: int
    mantissa: int
    dtype: str | None  # the torch dtype's name, or None (TF32 has no storage type)
    finite_only: bool = False

    @property
    def bits(self) -> int:
        return 1 + self.exponent + self.mantissa

    @property
    def bias(self) -> int:
        return 2 ** (self.exponent - 1) - 1

    @property
    def eps(self) -> float:
        """Gap between 1 and the next number: ``2^-mantissa``."""
        return 2.0**-self.mantissa

    @property
    def max(self) -> float:
        """The largest finite number."""
        if self.finite_only:  # top exponent usable, top mantissa is NaN
            return (2 - 2.0 ** (1 - self.mantissa)) * 2.0 ** (2**self.exponent - 1 - self.bias)
        return (2 - 2.0**-self.mantissa) * 2.0 ** (2**self.exponent - 2 - self.bias)

    @property
    def smallest_normal(self) -> float:
        return 2.0 ** (1 - self.bias)

    @property
    def smallest_subnormal(self) -> float:
        return 2.0 ** (1 - self.bias - self.mantissa)

    @property
    def decimal_digits(self) -> float:
        """Significant decimal digits: ``log10(2^(mantissa + 1))``."""
        return (self.mantissa + 1) * math.log10(2)


FORMATS = {
    f.name: f
    for f in [
        FloatFormat("fp32", 8, 23, "float32"),
        FloatFormat("tf32", 8, 10, None),
        FloatFormat("fp16", 5, 10, "float16"),
        FloatFormat("bf16", 8, 7, "bfloat16"),
        FloatFormat("fp8 e4m3", 4, 3, "float8_e4m3fn", finite_only=True),
        FloatFormat("fp8 e5m2", 5, 2, "float8_e5m2"),
    ]
}
"""The floating-point formats of deep learning, by name."""


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


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(value: float, dtype) -> str:
    """The bits of ``value`` stored as ``dtype``: ``"sign exponent mantissa"``.

    ``bits(-1.5, "fp16")`` is ``"1 01111 1000000000"``. The value is rounded to ``dtype``
    from float64 (one rounding), then its storage is reinterpreted as an integer with
    ``Tensor.view``.
    """
    dtype = to_dtype(dtype)
    fmt = next((f for f in FORMATS.values() if f.dtype and getattr(torch, f.dtype) == dtype), None)
    if fmt is None:
        raise ValueError(f"bits() knows the floating-point formats {list(FORMATS)}, not {dtype}")
    stored = torch.tensor(value, dtype=torch.float64).to(dtype)
    word = int(stored.view(_INT_VIEW[dtype.itemsize]).item()) & (2**fmt.bits - 1)
    text = format(word, f"0{fmt.bits}b")
    return f"{text[0]} {text[1 : 1 + fmt.exponent]} {text[1 + fmt.exponent :]}"


# --------------------------------------------------------------------------- mixed precision


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


def tiny_gpt_gradients(vocab_size: int = 4096, batch: int = 8, seed: int = 0) -> dict:
    """The gradients of one backward pass of a tiny GPT on random tokens, in float32.

    ``"logits"``: the gradient of the mean cross-entropy loss with respect to the logits,
    ``(softmax - onehot) / tokens``, the first gradient backward computes; its entries
    shrink as ``1 / (vocab_size x tokens)``. ``"parameters"``: every weight's gradient.
    """
    from labsupport.models import tiny_gpt

    model = tiny_gpt(seed, vocab_size=vocab_size)
    g = torch.Generator().manual_seed(seed)
    shape = (batch, model.config.block_size + 1)
    tokens = torch.randint(0, vocab_size, shape, generator=g)
    logits = model(tokens[:, :-1])
    logits.retain_grad()
    loss = nn.functional.cross_entropy(logits.reshape(-1, vocab_size), tokens[:, 1:].reshape(-1))
    loss.backward()
    return {
        "tokens": batch * model.config.block_size,
        "logits": logits.grad.flatten(),
        "parameters": torch.cat([p.grad.flatten() for p in model.parameters()]),
    }


# --------------------------------------------------------------------------- several ranks

ALL_REDUCE_CASES = (("fp32", 1.0), ("bf16", 1.0), ("fp16", 1.0), ("fp16", 2.0**16))
"""(dtype, loss scale) pairs :func:`all_reduce_in_dtypes` tries."""


def all_reduce_in_dtypes(numel: int = 4096, scale: float = 1e-3, seed: int = 0) -> dict:
    """Run on every rank: all-reduce (sum) one gradient in fp32, bf16 and fp16.

    Each rank makes its own gradient (``randn * scale``, seeded by rank) and, for each
    (dtype, loss scale) of :data:`ALL_REDUCE_CASES`, multiplies it by the loss scale,
    casts it to the dtype and sums it over the ranks twice: with
    ``torch.distributed.all_reduce``, to measure the error (after dividing the scale
    back out) against an exact float64 sum, and with the course's ring
    (:func:`labsupport.collectives.all_reduce`) inside
    :func:`~labsupport.collectives.count_traffic`, to count the bytes this rank sends.
    """
    import torch.distributed as dist

    from labsupport import collectives

    rank, world = dist.get_rank(), dist.get_world_size()
    gen = torch.Generator().manual_seed(seed + rank)
    grad = torch.randn(numel, generator=gen, dtype=torch.float64) * scale
    exact = grad.clone()
    dist.all_reduce(exact)
    out = {"rank": rank, "world_size": world, "cases": []}
    for name, loss_scale in ALL_REDUCE_CASES:
        summed = (grad * loss_scale).to(to_dtype(name))
        dist.all_reduce(summed)
        result = summed.double() / loss_scale
        with collectives.count_traffic() as traffic:
            collectives.all_reduce((grad * loss_scale).to(to_dtype(name)), algorithm="ring")
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


def ring_bytes_per_rank(num_params: int, dtype, world_size: int) -> float:
    """Bytes a rank sends in a ring all-reduce: ``2 (N - 1) / N x num_params x bytes``."""
    return 2 * (world_size - 1) / world_size * param_bytes(num_params, dtype)


# --------------------------------------------------------------------------- figures

FIELD_COLORS = {"sign": "#D55E00", "exponent": "#0072B2", "mantissa": "#E69F00"}


def dtype_layouts(names=("fp32", "tf32", "bf16", "fp16", "fp8 e5m2", "fp8 e4m3")):
    """Chapter 2: the sign, exponent and mantissa fields of each format, one bit per box."""
    fig, ax = plotting.figure(9.5, 0.62 * len(names) + 0.9)
    for row, name in enumerate(names):
        f = FORMATS[name]
        y = len(names) - 1 - row
        fields = [("sign", 1), ("exponent", f.exponent), ("mantissa", f.mantissa)]
        x = 0
        for field, width in fields:
            for _ in range(width):
                ax.add_patch(
                    plt.Rectangle((x, y), 0.92, 0.7, facecolor=FIELD_COLORS[field],
                                           edgecolor="black", linewidth=0.4)
                )  # fmt: skip
                x += 1
            if field != "sign":
                ax.text(x - width / 2 - 0.04, y + 0.35, str(width), ha="center", va="center",
                        fontsize=8, color="white" if field == "exponent" else "black")  # fmt: skip
        label = f"{name}  ({f.bits} bits)" if name != "tf32" else "tf32  (19 bits, in 32)"
        ax.text(-0.6, y + 0.35, label, ha="right", va="center", fontsize=9)
        note = f"max {f.max:.6g}, eps 2^-{f.mantissa}"
        ax.text(33, y + 0.35, note, ha="left", va="center", fontsize=8, color="#444444")
    handles = [plt.Rectangle((0, 0), 1, 1, facecolor=c, edgecolor="black")
               for c in FIELD_COLORS.values()]  # fmt: skip
    ax.legend(handles, list(FIELD_COLORS), ncol=3, loc="lower center", frameon=False,
              bbox_to_anchor=(0.45, 1.0), fontsize=9)  # fmt: skip
    ax.set_xlim(-9, 44)
    ax.set_ylim(-0.2, len(names))
    ax.set_aspect("equal")
    ax.axis("off")
    return fig


def range_and_precision(names=("fp32", "bf16", "fp16", "fp8 e5m2", "fp8 e4m3")):
    """Chapter 2: the magnitudes each format holds (log2 scale), subnormals lighter, with
    a gradient of 1e-8 and a value of 70,000 marked."""
    fig, ax = plotting.figure(8.5, 0.55 * len(names) + 1.2)
    for row, name in enumerate(names):
        f = FORMATS[name]
        y = len(names) - 1 - row
        lo, mid, hi = (math.log2(v) for v in (f.smallest_subnormal, f.smallest_normal, f.max))
        color = plotting.rank_color(row)
        ax.barh(y, mid - lo, left=lo, height=0.5, color=color, alpha=0.35)
        ax.barh(y, hi - mid, left=mid, height=0.5, color=color)
        ax.text(min(hi, 150) + 2, y, f"{f.smallest_subnormal:.1e} … {f.max:.3g}", va="center",
                fontsize=8)  # fmt: skip
    for value, label in ((1e-8, "gradient 1e-8"), (7e4, "70,000")):
        ax.axvline(math.log2(value), color="black", lw=1, ls="--")
        ax.text(math.log2(value) + 2, -0.75, label, ha="left", fontsize=8)
    ax.set_ylim(-0.9, len(names) - 0.5)
    ax.set_yticks(range(len(names)), list(reversed(names)))
    ax.set_xlim(-155, 185)
    ax.set_xticks(range(-150, 151, 50), [f"$2^{{{k}}}$" for k in range(-150, 151, 50)])
    ax.set_xlabel("magnitude (log scale); light: subnormal numbers, fewer significant bits")
    ax.set_title("Range of each format: fp16 loses both marked values, bf16 keeps them")
    return fig


def plot_loss_scaling(rows: list[dict], title: str = "fp16, gradients scaled by 2^k"):
    """Lab 2: what a cast to fp16 does to gradients, against the loss scale ``2^k``.

    Left: median relative error after the round trip (scale, cast, cast back, unscale).
    Right: the share of values that became subnormal, zero, or infinite.
    """
    plt.rcParams.update(plotting.STYLE)
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.3))
    k = [r["log2 scale"] for r in rows]
    left.plot(k, [r["median rel. error"] for r in rows], "o-", color=plotting.rank_color(0))
    left.axhline(2.0**-11, color="#999999", ls=":", lw=1)
    left.text(k[-1], 2.0**-11 * 1.3, "2^-11: fp16's largest rounding error", ha="right", fontsize=8)
    left.set_yscale("log")
    left.set_xlabel("log2 of the loss scale")
    left.set_ylabel("median relative error")
    series = [("subnormal", "s--", 2), ("zero", "o-", 0), ("inf", "^-", 5)]
    for key, style, color in series:
        right.plot(k, [100 * r[key] for r in rows], style, color=plotting.rank_color(color),
                   label=key)  # fmt: skip
    right.set_yscale("symlog", linthresh=0.01)
    right.set_xlabel("log2 of the loss scale")
    right.set_ylabel("% of nonzero gradients")
    right.legend(frameon=False, fontsize=8)
    fig.suptitle(title)
    return fig


# --------------------------------------------------------------------------- exercises


def check_untied_gpt_params(fn) -> None:
    """Exercise 1: ``fn(vocab_size, block_size, n_embd, n_layer)`` for a GPT with no biases
    (LayerNorms without bias) and an untied output layer, checked against models built
    on the meta device."""
    from labsupport.models import GPT, GPTConfig

    cases = [(50257, 1024, 768, 12), (32000, 4096, 4096, 2), (256, 64, 64, 3), (1000, 8, 16, 1)]
    for vocab, block, d, layers in cases:
        config = GPTConfig(vocab, block, layers, 1, d, bias=False, tie_weights=False)
        with torch.device("meta"):
            want = count_parameters(GPT(config))
        got = fn(vocab, block, d, layers)
        hint = ""
        if got == gpt2_params(vocab, block, d, layers):
            hint = " (that is GPT-2's formula: drop the biases, add the output layer)"
        elif got == want - vocab * d:
            hint = " (the untied output layer is a second V x d matrix)"
        assert got == want, (
            f"V={vocab}, P={block}, d={d}, L={layers}: got {got:,}, the model has {want:,}{hint}"
        )
    print("Correct: 2·V·d + P·d + L·(12d² + 2d) + d.")


def check_safe_loss_scale(fn) -> None:
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
        assert torch.isfinite((grads * got).half()).all(), (
            f"max |g| = {peak:.3g}: with scale {got:g} some gradients overflow fp16"
        )
        assert got == want, f"max |g| = {peak:.3g}: got {got:g}, the largest safe scale is {want:g}"
    print("Correct: S = 2^floor(log2(65504 / max|g|)); dynamic loss scaling searches for it.")


def check_decode(fn) -> None:
    """Exercise 3: ``fn(pattern, exponent_bits, mantissa_bits)`` decodes a pattern such as
    ``"1 01111 1000000000"`` (what :func:`bits` returns) to its value: normals and
    subnormals of every format, checked against the value torch stores."""
    values = [1.0, -1.5, 0.1, 1 / 3, 3.0e4, 448.0, 2.0**-7, -(2.0**-9), 5.96e-8, 1e-40, 0.0]
    for name in ("fp32", "fp16", "bf16", "fp8 e4m3", "fp8 e5m2"):
        f = FORMATS[name]
        dtype = getattr(torch, f.dtype)
        for value in values:
            stored = torch.tensor(value, dtype=torch.float64).to(dtype)
            if not math.isfinite(float(stored)):
                continue
            pattern = bits(value, dtype)
            got, want = fn(pattern, f.exponent, f.mantissa), float(stored)
            assert got == want, f"{name} {pattern}: got {got!r}, stored value is {want!r}"
    print("Correct: (-1)^s · 1.m · 2^(e - bias), and 0.m · 2^(1 - bias) when e = 0.")
