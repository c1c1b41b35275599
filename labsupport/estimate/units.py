"""Units: decimal and binary prefixes, bytes as people write them, parameter counts.

Datasheets, papers and model sizes mostly use **decimal** (SI) prefixes: 1 GB = 10^9 bytes,
"7B" parameters, "400 Gb/s". GPU memory is the exception: an "80 GB" H100 holds about
80 GiB. Operating systems and PyTorch's memory tools often use
**binary** (IEC 80000-13) prefixes: 1 GiB = 2^30 bytes, 7.4 % more. The course keeps
both, named apart.
"""

from __future__ import annotations

KB, MB, GB, TB = 1e3, 1e6, 1e9, 1e12
KiB, MiB, GiB = 2**10, 2**20, 2**30
TFLOPS = 1e12  # FLOP/s

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
    ``standard="auto"`` writes a size as people do: decimal for a multiple of 1000 bytes
    (``"1 GB"``, ``"1.5 MB"``, as datasheets), binary otherwise (``"16 KiB"``, as buffer
    sizes).
    """
    if standard == "auto":
        standard = "si" if float(n).is_integer() and n and int(n) % 1000 == 0 else "iec"
    try:
        base, units = PREFIXES[standard]
    except KeyError:
        raise ValueError(f"standard must be 'iec', 'si' or 'auto', got {standard!r}") from None
    sign, value = ("-" if n < 0 else ""), abs(n)
    power = 0
    while power < len(units) - 1 and round(value / base**power, decimals) >= base:
        power += 1
    scaled = value / base**power
    if power == 0 or scaled == int(scaled):
        return f"{sign}{scaled:.0f} {units[power]}"
    return f"{sign}{scaled:.{decimals}f} {units[power]}"


def format_count(n: float) -> str:
    """A parameter count the three ways papers and the notes write it: M, 亿 (10^8), B."""
    return f"{n / 1e6:,.1f}M = {n / 1e8:,.2f}亿 = {n / 1e9:.3f}B"
