"""Interconnects as their datasheets give them: the numbers chapter 5 and lab 5 model with.

Datasheets quote bandwidth three different ways, and mixing them up is the most common
error in back-of-the-envelope cluster maths:

* PCIe and NVLink are quoted by NVIDIA as a **bidirectional total** in GB/s (gigabytes,
  10^9 bytes, per second): "NVLink 900 GB/s" for an H100 means 450 GB/s out of the GPU
  while 450 GB/s come in. One message only ever uses one direction.
* Network ports (InfiniBand, Ethernet) are quoted **per direction in Gb/s** (gigabits):
  a 400 Gb/s NDR port moves 400 / 8 = 50 GB/s each way.
* The course's models use **bytes per second, per direction**: ``beta = 1 / that``.

Every entry of :data:`LINKS` keeps what the source says (``datasheet``) next to the
per-direction number derived from it (``gb_per_s``), and the source's URL. Latency is
``None`` throughout: no datasheet gives the end-to-end latency a training job sees (it
depends on the software stack as much as on the wire), so the course does not invent one.

Sources:

* PCIe: per-lane rates and encodings of the PCI Express Base Specifications, PCI-SIG
  (https://pcisig.com/specifications; 6.0: https://pcisig.com/pci-express-6.0-specification).
  x16 per direction = 16 lanes x rate x encoding efficiency / 8 bits.
* NVLink 2, 3, 4: NVIDIA V100, A100 and H100 (SXM) datasheets
  (https://www.nvidia.com/en-us/data-center/v100/, .../a100/, .../h100/); NVLink 5:
  https://www.nvidia.com/en-us/data-center/nvlink/ (18 links x 100 GB/s = 1.8 TB/s).
* InfiniBand: InfiniBand Trade Association roadmap, 4x port data rates
  (https://www.infinibandta.org/infiniband-roadmap/).
* RoCE at 400 Gb/s: the 400 Gb/s Ethernet ports of NVIDIA ConnectX-7 adapters, the NICs of
  a DGX H100 (https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-
  foundation-enterprise-ai/latest/core-components.html), and the fabric Llama 3 405B was
  trained on (Llama 3 paper, arXiv:2407.21783, section 3.3.1).
"""

from __future__ import annotations

GB = 1e9  # bytes: datasheets use decimal gigabytes

PCI_SIG = "https://pcisig.com/specifications"
PCIE6 = "https://pcisig.com/pci-express-6.0-specification"
IBTA = "https://www.infinibandta.org/infiniband-roadmap/"


def pcie_x16(gt_per_s: float, payload_bits: int, line_bits: int) -> float:
    """Per-direction GB/s of a PCIe x16 link: 16 lanes x transfers/s x encoding / 8."""
    return 16 * gt_per_s * payload_bits / line_bits / 8


def per_direction(value: float, unit: str) -> float:
    """Convert a datasheet bandwidth to bytes per second in one direction.

    ``unit`` is ``"Gb/s"`` (gigabits per second per direction, as network ports are
    quoted), ``"GB/s"`` (gigabytes per second per direction) or ``"GB/s bidirectional"``
    (a total over both directions, as NVIDIA quotes NVLink and PCIe).
    """
    if unit == "Gb/s":
        return value * GB / 8
    if unit == "GB/s":
        return value * GB
    if unit == "GB/s bidirectional":
        return value * GB / 2
    raise ValueError(f"unknown unit {unit!r}: use 'Gb/s', 'GB/s' or 'GB/s bidirectional'")


def _link(name, kind, gb_per_s, datasheet, source):
    return {
        "name": name,
        "kind": kind,
        "gb_per_s": gb_per_s,
        "datasheet": datasheet,
        "latency_s": None,
        "source": source,
    }


def _bidirectional(total_gb_per_s):
    return per_direction(total_gb_per_s, "GB/s bidirectional") / GB


def _gbit(gbit_per_s):
    return per_direction(gbit_per_s, "Gb/s") / GB


NVIDIA = "https://www.nvidia.com/en-us/data-center/"
DGX_H100 = (
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-"
    "enterprise-ai/latest/core-components.html"
)

LINKS = {
    link["name"]: link
    for link in [
        _link("PCIe 3.0 x16", "PCIe", pcie_x16(8, 128, 130),
              "8 GT/s per lane, 128b/130b", PCI_SIG),
        _link("PCIe 4.0 x16", "PCIe", pcie_x16(16, 128, 130),
              "16 GT/s per lane, 128b/130b", PCI_SIG),
        _link("PCIe 5.0 x16", "PCIe", pcie_x16(32, 128, 130),
              "32 GT/s per lane, 128b/130b", PCI_SIG),
        _link("PCIe 6.0 x16", "PCIe", pcie_x16(64, 1, 1),
              "64 GT/s per lane (PAM4, FLIT); 256 GB/s bidirectional, raw", PCIE6),
        _link("NVLink 2 (V100)", "NVLink", _bidirectional(300),
              "6 links, 300 GB/s bidirectional", NVIDIA + "v100/"),
        _link("NVLink 3 (A100)", "NVLink", _bidirectional(600),
              "12 links, 600 GB/s bidirectional", NVIDIA + "a100/"),
        _link("NVLink 4 (H100)", "NVLink", _bidirectional(900),
              "18 links, 900 GB/s bidirectional", NVIDIA + "h100/"),
        _link("NVLink 5 (B200)", "NVLink", _bidirectional(1800),
              "18 links, 1.8 TB/s bidirectional", NVIDIA + "nvlink/"),
        _link("InfiniBand EDR", "InfiniBand", _gbit(100), "100 Gb/s per 4x port", IBTA),
        _link("InfiniBand HDR", "InfiniBand", _gbit(200), "200 Gb/s per 4x port", IBTA),
        _link("InfiniBand NDR", "InfiniBand", _gbit(400), "400 Gb/s per 4x port", IBTA),
        _link("InfiniBand XDR", "InfiniBand", _gbit(800), "800 Gb/s per 4x port", IBTA),
        _link("RoCE 400 GbE", "Ethernet", _gbit(400), "400 Gb/s per port (ConnectX-7)", DGX_H100),
    ]
}  # fmt: skip
"""Interconnects by name; ``gb_per_s`` is GB/s (10^9 bytes/s) in **one direction**.

PCIe 3.0 to 5.0 include the 128b/130b encoding overhead. PCIe 6.0 is the raw 64 GT/s
rate, before the overhead of its FLIT framing and forward error correction."""


def link(name: str) -> dict:
    """The entry of :data:`LINKS` called ``name`` (a clear error for a typo)."""
    try:
        return LINKS[name]
    except KeyError:
        raise KeyError(f"no link {name!r}; known links: {', '.join(LINKS)}") from None


def beta(name: str) -> float:
    """The alpha-beta model's ``beta`` (seconds per byte, one direction) of a link."""
    return 1 / (link(name)["gb_per_s"] * GB)
