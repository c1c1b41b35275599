"""Every datasheet number of the course, with its source: devices, links, models.

* :data:`DEVICES`: GPUs and a laptop CPU, with memory, memory bandwidth and peak FLOP/s
  (chapters 1 to 4);
* :data:`LINKS`: PCIe, NVLink, InfiniBand and RoCE bandwidths (chapter 5);
* :data:`MODELS`: published training runs, GPT-3, BLOOM and Llama 3 (chapter 3);
* :data:`HIERARCHY`: the memory levels of an H100 and of the laptop CPU (chapter 1).

Two numbers are assumptions, not datasheet values, and say so:
:data:`ASSUMED_ALPHA` and :data:`ASSUMED_MFU`.

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

Sources of the links:

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

from labsupport.estimate.units import GB, TFLOPS

ASSUMED_ALPHA = 5e-6
"""Seconds of latency per message assumed for *modelled* clusters (chapters 3 and 5).

No datasheet gives it: it depends on the software (NCCL's protocol, kernel launches) as
much as on the wire. 5 microseconds is an order of magnitude, not a measurement; replace
it with what ``nccl-tests`` reports for small messages on your own cluster."""

ASSUMED_MFU = 0.40
"""Model FLOPs utilization assumed throughout (Llama 3 405B reported 38-43%)."""

NVIDIA = "https://www.nvidia.com/en-us/data-center/"

# --------------------------------------------------------------------------- devices

ADA = "https://images.nvidia.com/aem-dam/Solutions/geforce/ada/nvidia-ada-gpu-architecture.pdf"
AMD_7840U = (
    "https://www.amd.com/en/products/processors/laptop/ryzen/7000-series/amd-ryzen-7-7840u.html"
)


def _entry(
    name,
    kind,
    memory,
    memory_gb,
    bandwidth_gb_s,
    fp32_tflops,
    tensor_tflops,
    tensor_precision,
    datasheet,
    source,
):
    return {
        "name": name,
        "kind": kind,
        "memory": memory,
        "memory_bytes": memory_gb * GB,
        "bandwidth": bandwidth_gb_s * GB,
        "fp32": fp32_tflops * TFLOPS,
        "tensor": None if tensor_tflops is None else tensor_tflops * TFLOPS,
        "tensor_precision": tensor_precision,
        "datasheet": datasheet,
        "source": source,
    }


LAPTOP_CPU = {
    "name": "AMD Ryzen 7 7840U",
    "cores": 8,
    "base_clock_hz": 3.3e9,
    # Zen 4: two 256-bit FMA pipes per core = 2 x 8 fp32 lanes x 2 FLOPs (multiply + add)
    "fp32_flops_per_cycle": 32,
    # DDR5-5600: 5600 million transfers/s on each of two 64-bit (8-byte) channels
    "memory_transfers_per_s": 5600e6,
    "channels": 2,
    "bytes_per_transfer": 8,
}
"""The ingredients of the laptop CPU's peak numbers, which no datasheet states directly:
cores, base clock and supported memory from AMD's product page, FLOPs per cycle from
AMD's Zen 4 software optimization guide (publication 57647)."""


def laptop_cpu_peaks(cpu: dict = LAPTOP_CPU) -> tuple[float, float]:
    """Peak fp32 FLOP/s (cores x clock x FLOPs per cycle) and DRAM bandwidth (bytes/s)."""
    flops = cpu["cores"] * cpu["base_clock_hz"] * cpu["fp32_flops_per_cycle"]
    bandwidth = cpu["memory_transfers_per_s"] * cpu["channels"] * cpu["bytes_per_transfer"]
    return flops, bandwidth


_CPU_FLOPS, _CPU_BANDWIDTH = laptop_cpu_peaks()

DEVICES = {
    entry["name"]: entry
    for entry in [
        _entry(
            "V100 SXM2",
            "GPU",
            "32 GB HBM2",
            32,
            900,
            15.7,
            125,
            "FP16",
            "FP32 15.7 TFLOPS; Tensor 125 TFLOPS (FP16 inputs); HBM2 900 GB/s",
            NVIDIA + "v100/",
        ),
        _entry(
            "A100 SXM 80GB",
            "GPU",
            "80 GB HBM2e",
            80,
            2039,
            19.5,
            312,
            "BF16",
            "FP32 19.5 TFLOPS; BF16 Tensor 312 TFLOPS (624 with sparsity); 2,039 GB/s",
            NVIDIA + "a100/",
        ),
        _entry(
            "H100 SXM",
            "GPU",
            "80 GB HBM3",
            80,
            3350,
            67,
            989,
            "BF16",
            "FP32 67 TFLOPS; BF16 Tensor 1,979 TFLOPS with sparsity (989 dense); 3.35 TB/s",
            NVIDIA + "h100/",
        ),
        _entry(
            "H200 SXM",
            "GPU",
            "141 GB HBM3e",
            141,
            4800,
            67,
            989,
            "BF16",
            "FP32 67 TFLOPS; BF16 Tensor 1,979 TFLOPS with sparsity (989 dense); 4.8 TB/s",
            NVIDIA + "h200/",
        ),
        _entry(
            "RTX 4090",
            "GPU",
            "24 GB GDDR6X",
            24,
            1008,
            82.6,
            165.2,
            "BF16",
            "FP32 82.6 TFLOPS; BF16 Tensor, FP32 accumulate, 165.2 TFLOPS (330.4 with "
            "sparsity); 1,008 GB/s",
            ADA,
        ),
        _entry(
            "Ryzen 7 7840U (laptop CPU)",
            "CPU",
            "DDR5-5600, 2 channels",
            32,
            _CPU_BANDWIDTH / GB,
            _CPU_FLOPS / TFLOPS,
            None,
            None,
            "8 cores, 3.3 GHz base; computed: 8 x 3.3 GHz x 32 FLOP/cycle = 844.8 GFLOP/s; "
            "2 x 8 B x 5600 MT/s = 89.6 GB/s",
            AMD_7840U,
        ),
    ]
}
"""Datasheet numbers, **dense** (no sparsity): ``bandwidth`` in bytes/s, ``fp32`` and
``tensor`` in FLOP/s. ``fp32`` is the non-tensor (CUDA core, or CPU vector unit) rate;
``tensor`` is the tensor-core rate at ``tensor_precision``: NVIDIA lists the H100 and H200
16-bit rates only *with* 2:4 structured sparsity (the A100 lists both), twice the dense rate
given here. The
V100's tensor cores take FP16 (they predate BF16). The laptop CPU's numbers are computed
from its specifications (:data:`LAPTOP_CPU`), at base clock."""


def device_spec(name: str) -> dict:
    """The entry of :data:`DEVICES` called ``name`` (a clear error for a typo)."""
    try:
        return DEVICES[name]
    except KeyError:
        raise KeyError(f"no device {name!r}; known: {', '.join(DEVICES)}") from None


HIERARCHY = {
    "H100 SXM (one GPU)": [
        ("registers", 132 * 256 * 1024, "256 KB per SM x 132 SMs"),
        ("L1 / shared memory", 132 * 256 * 1024, "256 KB per SM x 132 SMs"),
        ("L2 cache", 50 * 10**6, "50 MB"),
        ("HBM3 (VRAM)", 80 * 10**9, "80 GB, 3.35 TB/s"),
        ("host RAM (DGX H100)", 2 * 10**12, "2 TB, over PCIe 5.0: 63 GB/s each way"),
    ],
    "Ryzen 7 7840U (laptop CPU)": [
        ("L1 data cache", 8 * 32 * 1024, "32 KB per core x 8"),
        ("L2 cache", 8 * 2**20, "1 MB per core x 8"),
        ("L3 cache", 16 * 2**20, "16 MB shared"),
        ("DDR5 RAM", 32 * 10**9, "size varies (32 GB drawn); 89.6 GB/s"),
    ],
}
"""Capacities (bytes) of the memory levels, fastest first: H100 from NVIDIA's Hopper
architecture description and the DGX H100 reference architecture; the laptop CPU from
AMD's product page and Zen 4 optimization guide. The RAM size of a laptop varies."""


# --------------------------------------------------------------------------- links

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


DGX_H100 = (
    "https://docs.nvidia.com/dgx-basepod/reference-architecture-infrastructure-foundation-"
    "enterprise-ai/latest/core-components.html"
)

LINKS = {
    link["name"]: link
    for link in [
        _link("PCIe 3.0 x16", "PCIe", pcie_x16(8, 128, 130), "8 GT/s per lane, 128b/130b", PCI_SIG),
        _link(
            "PCIe 4.0 x16", "PCIe", pcie_x16(16, 128, 130), "16 GT/s per lane, 128b/130b", PCI_SIG
        ),
        _link(
            "PCIe 5.0 x16", "PCIe", pcie_x16(32, 128, 130), "32 GT/s per lane, 128b/130b", PCI_SIG
        ),
        _link(
            "PCIe 6.0 x16",
            "PCIe",
            pcie_x16(64, 1, 1),
            "64 GT/s per lane (PAM4, FLIT), raw",
            PCIE6,
        ),
        _link(
            "NVLink 2 (V100)",
            "NVLink",
            _bidirectional(300),
            "6 links, 300 GB/s bidirectional",
            NVIDIA + "v100/",
        ),
        _link(
            "NVLink 3 (A100)",
            "NVLink",
            _bidirectional(600),
            "12 links, 600 GB/s bidirectional",
            NVIDIA + "a100/",
        ),
        _link(
            "NVLink 4 (H100)",
            "NVLink",
            _bidirectional(900),
            "18 links, 900 GB/s bidirectional",
            NVIDIA + "h100/",
        ),
        _link(
            "NVLink 5 (B200)",
            "NVLink",
            _bidirectional(1800),
            "18 links, 1.8 TB/s bidirectional",
            NVIDIA + "nvlink/",
        ),
        _link("InfiniBand EDR", "InfiniBand", _gbit(100), "100 Gb/s per 4x port", IBTA),
        _link("InfiniBand HDR", "InfiniBand", _gbit(200), "200 Gb/s per 4x port", IBTA),
        _link("InfiniBand NDR", "InfiniBand", _gbit(400), "400 Gb/s per 4x port", IBTA),
        _link("InfiniBand XDR", "InfiniBand", _gbit(800), "800 Gb/s per 4x port", IBTA),
        _link("RoCE 400 GbE", "Ethernet", _gbit(400), "400 Gb/s per port (ConnectX-7)", DGX_H100),
    ]
}
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


# --------------------------------------------------------------------------- models

MODELS = {
    "GPT-3 175B": {
        "params": 175e9,
        "tokens": 300e9,
        "layers": 96,
        "hidden": 12288,
        "heads": 96,
        "seq_len": 2048,
        "batch_tokens": 3.2e6,
        "reported_flops": 3.14e23,
        "source": "Brown et al. 2020, tables 2.1 and D.1",
    },
    "BLOOM 176B": {
        "params": 176_247e6,
        "tokens": 366e9,
        "layers": 70,
        "hidden": 14336,
        "heads": 112,
        "seq_len": 2048,
        "batch_tokens": 2048 * 2048,
        "reported_gpu_hours": 1_082_990,
        "source": "BigScience 2022, sections 3.2 and 3.5",
    },
    "Llama 3 405B": {
        "params": 405e9,
        "tokens": 15.6e12,
        "layers": 126,
        "hidden": 16384,
        "heads": 128,
        "seq_len": 8192,
        # the final batch, from 2.87T tokens on: "16M" = 128 data-parallel groups x 16
        # sequences of 8,192 (section 3.4.1, table 4); the first is walls.BATCH_TOKENS, 4M
        "batch_tokens": 16 * 1024 * 1024,
        "reported_flops": 3.8e25,
        "source": "Grattafiori et al. 2024, sections 1 and 3",
    },
}
