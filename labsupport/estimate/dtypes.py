"""Number formats: bytes per dtype, and the bit layout of each floating-point format.

* :func:`to_dtype` and :func:`dtype_bytes` take a ``torch.dtype`` or a name (``"bf16"``);
  :func:`param_bytes` is ``num_params x dtype_bytes``;
* :data:`FORMATS` describes each floating-point format by its sign, exponent and
  mantissa bits; its range and precision follow from them (:class:`FloatFormat`), and
  the lab checks them against ``torch.finfo``; :func:`bits` shows the fields of a
  number stored in a dtype.

Sources: IEEE 754-2019 (binary16, binary32); bfloat16 (Kalamkar et al., 2019,
arXiv:1905.12322); TF32 (NVIDIA A100 architecture); FP8 E4M3 and E5M2 (Micikevicius et
al., "FP8 Formats for Deep Learning", 2022, arXiv:2209.05433, and the OCP 8-bit
floating point specification, 2023).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

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
    def unit_roundoff(self) -> float:
        """The largest relative error of rounding to nearest: ``2^-(mantissa + 1)``."""
        return self.eps / 2

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
