"""What tensor parallelism costs per layer: the compute split over ``t`` GPUs against the
all-reduces that stay whole (chapter 12).

A Megatron layer split over ``t`` GPUs divides its matrix multiplications by ``t``, and
adds 4 all-reduces of one activation per micro-batch (2 in the forward pass, 2 in the
backward pass; Shoeybi et al. 2019, section 3), whose bytes per GPU tend to ``2·s·h``
values each as ``t`` grows. :func:`layer_costs` puts the two side by side, over NVLink
and over InfiniBand: a model, not a measurement.
"""

from __future__ import annotations

from labsupport.comm.cost import all_reduce_time
from labsupport.estimate.datasheets import ASSUMED_ALPHA, ASSUMED_MFU, MODELS, beta, device_spec
from labsupport.estimate.flops import transformer_training_flops

LINKS = ("NVLink 4 (H100)", "InfiniBand NDR")


def layer_costs(t_values=(2, 4, 8, 16), model: str = "GPT-3 175B", gpu: str = "H100 SXM"):
    """Modelled seconds per layer and micro-batch of one sequence, per GPU: the forward and
    backward compute (3 forwards' worth, at :data:`~labsupport.estimate.datasheets.
    ASSUMED_MFU` of the GPU's 16-bit peak), and the 4 ring all-reduces of ``2·s·h`` bytes
    (one bf16 activation) over NVLink 4 or one 400 Gb/s InfiniBand port per GPU, with
    :data:`~labsupport.estimate.datasheets.ASSUMED_ALPHA`. One row per size ``t``."""
    m = MODELS[model]
    s, h = m["seq_len"], m["hidden"]
    flops = transformer_training_flops(s, 1, h, s, 0)  # one layer, one sequence
    peak = device_spec(gpu)["tensor"] * ASSUMED_MFU
    nbytes = 2 * s * h  # one bf16 activation
    rows = []
    for t in t_values:
        row = {"t": t, "compute": flops / t / peak}
        for link in LINKS:
            row[link] = 4 * float(all_reduce_time("ring", t, nbytes, ASSUMED_ALPHA, beta(link)))
        rows.append(row)
    return rows
