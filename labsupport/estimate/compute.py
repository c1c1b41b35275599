"""A layer's compute time from its matrix multiplications' shapes, against the roofline.

Each GEMM ``(m × k) @ (k × n)`` (``batch`` of them in one call) costs ``2·m·k·n`` FLOPs
and moves ``2·(m·k + k·n + m·n)`` bytes (16-bit); the roofline gives the longer of the two
(Williams et al. 2009, :mod:`labsupport.estimate.roofline`), and the efficiency model
(:class:`Efficiency`) two things the roofline leaves out:

* ``gemm``: the share of the dense peak a GEMM reaches (tiles, clocks, tails);
* ``passes``: how many times, over the forward and backward passes, each byte of the
  activations a layer produces (:meth:`~labsupport.estimate.architecture.Transformer.
  activation_bytes`) crosses memory in the kernels that are not GEMMs (norms, GELU,
  dropout, softmax, residual additions): memory-bound time, ``passes · bytes / bandwidth``.

The two numbers are fitted once, on the training runs of
:mod:`labsupport.estimate.calibration`, and used for every layout and every run.

GPU memory is what the device reports (:data:`REPORTED_MEMORY`), not the datasheet's
decimal gigabytes.
"""

from __future__ import annotations

from dataclasses import dataclass

from labsupport.estimate.datasheets import DEVICES, device_spec
from labsupport.estimate.units import MiB


@dataclass(frozen=True)
class Efficiency:
    """The efficiency model's parameters (see the module's docstring)."""

    gemm: float
    passes: float


FITTED = Efficiency(gemm=0.641, passes=6.48)
"""The parameters :func:`labsupport.estimate.calibration.fit` finds on its training runs
(:data:`labsupport.estimate.runs.TRAINING`, four rows of Narayanan et al. 2021's table 1),
rounded; one set for every device, model and layout: GEMMs at 64 % of the dense peak,
each activation byte through memory 6.5 times in the kernels that are not GEMMs."""

REPORTED_MEMORY = {
    "A100 SXM 80GB": 81920 * MiB,
    "H100 SXM": 81559 * MiB,
    "H800 SXM": 81559 * MiB,
}
"""Bytes of GPU memory as ``nvidia-smi`` reports them (``memory.total``): 81,920 MiB for
an A100 80GB (85.9·10⁹ bytes, 80.0 GiB), 81,559 MiB for an H100 80GB HBM3 (85.5·10⁹
bytes, 79.6 GiB), as listed for Modal's GPUs in modal-labs/modal-client pull request
#2797 (January 2025). The H800 carries the H100's 80 GB of HBM3 (assumed to report the
same). CUDA's context and PyTorch's allocator take some of it: the planner lets a layout
fill :data:`labsupport.estimate.planner.USABLE_MEMORY` of this."""

H800 = DEVICES["H100 SXM"] | {
    "name": "H800 SXM",
    "datasheet": "the H100 SXM's compute and memory; NVLink 400 GB/s bidirectional",
    "source": "https://arxiv.org/abs/2412.19437 (DeepSeek-V3, section 3.1)",
}
"""The H800, the export variant of the H100 SXM DeepSeek-V3 was trained on: the H100's
tensor cores and memory, NVLink cut to 400 GB/s (DeepSeek-AI 2024, section 3.1)."""


def gpu_spec(name: str) -> dict:
    """:func:`labsupport.estimate.datasheets.device_spec`, and the H800."""
    return H800 if name == H800["name"] else device_spec(name)


FP8_PEAK = {"H100 SXM": 1979e12, "H800 SXM": 1979e12}
"""Dense FP8 tensor-core FLOP/s (NVIDIA's H100 datasheet lists 3,958 with sparsity)."""


def gemm_seconds(m, k, n, peak, bandwidth, eff: Efficiency, batch: int = 1) -> float:
    """One GEMM call: the roofline's time, its compute at ``eff.gemm`` of ``peak``."""
    flops = 2 * m * k * n * batch
    moved = 2 * batch * (m * k + k * n + m * n)
    return max(flops / (eff.gemm * peak), moved / bandwidth)


def layer_gemms(model, tokens: float, tp: int = 1, ep: int = 1, moe: bool = False) -> dict:
    """The forward GEMMs of one layer on one GPU, by kind: ``{"linear": [...], "core":
    [...]}``, each ``(m, k, n, batch)``. ``tokens`` is what the GPU holds of the
    micro-batch (``b·s/cp``); tensor parallelism splits the heads and the FFN's width;
    each of the ``n_expert/ep`` routed experts a GPU holds gets ``tokens·ep·top_k/n_expert``
    tokens (balanced routing)."""
    h, w, t = model.hidden, model.widths, tp
    d = model.head_dim or h // model.heads
    qkv = (model.attention_params() - w["o"] * h) / h  # MLA's low-rank chain as one GEMM
    linear = [(tokens, h, qkv / t, 1), (tokens, w["o"] / t, h, 1)]
    core = [
        (tokens, d, model.seq_len, model.heads / t),
        (tokens, model.seq_len, w["o"] / model.heads, model.heads / t),
    ]
    if not moe:
        ffn = model.ffn or 4 * h
        up = 2 * ffn if model.family == "llama" else ffn
        linear += [(tokens, h, up / t, 1), (tokens, ffn / t, h, 1)]
        return {"linear": linear, "core": core}
    fe, shared = model.expert_ffn, model.n_shared
    linear.append((tokens, h, model.n_expert, 1))  # the router
    if shared:
        linear += [(tokens, h, 2 * shared * fe / t, 1), (tokens, shared * fe / t, h, 1)]
    per_expert = tokens * ep * model.top_k / model.n_expert
    local = model.n_expert / ep
    linear += [(per_expert, h, 2 * fe, local), (per_expert, fe, h, local)]
    return {"linear": linear, "core": core}


def layer_seconds(model, tokens, spec, eff: Efficiency, *, tp=1, ep=1, moe=False, **run):
    """Seconds of one layer's forward and backward on one GPU: ``"forward"`` (one forward
    pass, what recomputation reruns), ``"total"`` (forward, backward at twice the forward's
    GEMMs, recomputation, the memory-bound kernels).

    ``run``: ``recompute``, ``sequence_parallel``, ``fused_attention`` and ``fp8`` (the
    linear layers' GEMMs at :data:`FP8_PEAK`, attention's products in 16 bits, as
    DeepSeek-V3)."""
    recompute = run.get("recompute", "selective")
    fused = run.get("fused_attention", False)
    peak = spec["tensor"]
    linear_peak = FP8_PEAK[spec["name"]] if run.get("fp8") else peak
    gemms = layer_gemms(model, tokens, tp, ep, moe)
    bw = spec["bandwidth"]
    linear = sum(gemm_seconds(m, k, n, linear_peak, bw, eff, b) for m, k, n, b in gemms["linear"])
    core = sum(gemm_seconds(m, k, n, peak, bw, eff, b) for m, k, n, b in gemms["core"])
    if fused:  # FlashAttention: the scores stay on chip, one kernel forward, two backward
        flops = sum(2 * m * k * n * b for m, k, n, b in gemms["core"])
        core = flops / (eff.gemm * peak)
    kept = model.activation_bytes("none", tp, run.get("sequence_parallel", False), fused, moe)
    memory_bound = eff.passes * kept * tokens / bw
    forward = linear + core
    extra = {"none": 0.0, "selective": core, "full": forward}[recompute]
    return {"forward": forward, "total": 3 * forward + extra + memory_bound}


def output_layer_seconds(model, tokens, spec, eff: Efficiency, tp: int = 1) -> float:
    """The output layer's GEMM, forward and backward, on one GPU of the last stage."""
    one = gemm_seconds(
        tokens, model.hidden, model.vocab / tp, spec["tensor"], spec["bandwidth"], eff
    )
    return 3 * one
