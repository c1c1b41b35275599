"""The memory wall: bytes of model state and of activations, per device.

* Model states: mixed-precision training with Adam keeps 16 bytes per parameter
  (Rajbhandari et al. 2020, ZeRO, section 3.1), before activations:
  :func:`training_memory`.
* Activations of a transformer layer follow Korthikanti et al. 2022, section 4:
  :func:`activation_memory`.
* Activation checkpointing (Chen et al. 2016) on chapter 4's stack of residual MLP
  blocks (:class:`labsupport.models.MLPStack`): :func:`checkpoint_saved_bytes` and
  :func:`checkpoint_peak_bytes`.

:mod:`labsupport.measure.memory` measures the same bytes on real tensors.
"""

from __future__ import annotations

import math

from labsupport.models.recompute import BLOCK_UNITS, RECOMPUTE

BYTES_PER_PARAM = {
    # ZeRO (Rajbhandari et al. 2020), section 3.1: fp16 weights and gradients, and an fp32
    # copy of the weights, momentum and variance that the optimizer updates: 2 + 2 + 12.
    "mixed": {
        "weights": 2,
        "gradients": 2,
        "master weights": 4,
        "momentum": 4,
        "variance": 4,
    },
    # plain fp32 training with Adam: no separate master copy, the weights are fp32.
    "fp32": {"weights": 4, "gradients": 4, "master weights": 0, "momentum": 4, "variance": 4},
}


def training_memory(
    num_params, precision: str = "mixed", zero_stage: int = 0, dp_size: int = 1
) -> dict:
    """Bytes of model state per device to train ``num_params`` parameters with Adam, per part.

    ``precision="mixed"`` is mixed-precision training as the ZeRO paper counts it
    (Rajbhandari et al. 2020, section 3.1): fp16 (or bf16) weights and gradients, 2
    bytes each, plus the optimizer's fp32 master weights, momentum and variance, 4 bytes
    each: 16 bytes per parameter; their example is 7.5 billion parameters, 120 GB.
    ``precision="fp32"`` is plain fp32 Adam: 4 + 4 + 4 + 4, also 16. Activations,
    temporary buffers and fragmentation come on top (:func:`activation_memory`).

    ``zero_stage`` shards over ``dp_size`` data-parallel devices (ZeRO, section 5):
    stage 1 the optimizer states (master weights, momentum, variance), stage 2 also the
    gradients, stage 3 also the weights. The paper's figure 1, 7.5 B parameters on 64
    devices: 120, 31.4, 16.6 and 1.9 GB for stages 0 to 3.
    """
    if precision not in BYTES_PER_PARAM:
        raise ValueError(f"precision must be one of {', '.join(BYTES_PER_PARAM)}")
    if zero_stage not in (0, 1, 2, 3) or dp_size < 1:
        raise ValueError(f"zero_stage must be 0 to 3 and dp_size >= 1, got {zero_stage}, {dp_size}")
    sharded_from = {"weights": 3, "gradients": 2, "master weights": 1, "momentum": 1, "variance": 1}
    return {
        part: size * num_params / dp_size if zero_stage >= sharded_from[part] else size * num_params
        for part, size in BYTES_PER_PARAM[precision].items()
    }


def activation_memory(
    seq_len,
    batch,
    hidden,
    heads,
    layers,
    recompute: str = "none",
    bytes_per_value: int = 2,
    mask_bytes: int = 1,
    tensor_parallel: int = 1,
    sequence_parallel: bool = False,
):
    """Bytes of activations a GPT keeps for the backward pass, summed over ``layers``.

    Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer
    Models", section 4) count, per layer, with s = ``seq_len``, b = ``batch``,
    h = ``hidden``, a = ``heads``, 16-bit activations and 1-byte dropout masks:

    * no recomputation: s·b·h·(34 + 5·a·s/h) bytes. 34 = 16 tensors of s·b·h values at
      2 bytes (layer-norm inputs 2, attention 5, MLP 9) plus 2 dropout masks; 5·a·s/h =
      the softmax output and its dropout output (2 bytes) and mask (1 byte), a·s² each;
    * selective recomputation (the attention core recomputed): 34·s·b·h;
    * full recomputation (only each layer's input kept): 2·s·b·h, divided by t under
      sequence parallelism, where that input is split along the sequence (Megatron
      checkpoints the sequence-parallel hidden state).

    ``bytes_per_value`` and ``mask_bytes`` generalise the counts (34 = 16·2 + 2·1 and
    5 = 2·2 + 1) to other dtypes. ``tensor_parallel`` = t divides the tensors that
    tensor parallelism splits (s·b·h·(10 + 24/t + 5·a·s/(h·t)) at 2 bytes), and
    ``sequence_parallel`` splits the rest too (s·b·h·(34/t + 5·a·s/(h·t))), as in the
    paper's table 2.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}")
    p, m, t = bytes_per_value, mask_bytes, tensor_parallel
    sbh = seq_len * batch * hidden
    if recompute == "full":
        return layers * sbh * p / (t if sequence_parallel else 1)
    split = 12 * p  # Q, K, V, attention output, the MLP's 4h input and output
    unsplit = 4 * p + 2 * m  # two layer-norm inputs, QKV and MLP inputs, two masks
    per_token = (split + unsplit) / t if sequence_parallel else split / t + unsplit
    per_layer = sbh * per_token
    if recompute == "none":
        per_layer += heads * seq_len**2 * batch * (2 * p + m) / t
    return layers * per_layer


# --------------------------------------------------------------------------- checkpointing


def checkpoint_saved_bytes(layers: int, batch: int, d: int, segment=None, itemsize=4) -> int:
    """Saved activations: ``9·L·b·d`` elements without checkpointing, ``(L/c)·b·d`` with
    segments of ``c`` blocks (each segment's input, ``ceil(L/c)`` of them)."""
    units = BLOCK_UNITS * layers if segment is None else math.ceil(layers / segment)
    return units * batch * d * itemsize


def checkpoint_peak_bytes(layers: int, batch: int, d: int, segment=None, itemsize=4) -> int:
    """Chen et al.'s estimate of the peak: kept segment inputs plus one segment recomputed.

    ``(L/c + 9·c)·b·d`` elements with segments of ``c`` blocks, ``9·L·b·d`` without. The
    minimum over ``c`` is at ``c = sqrt(L/9)``, ``6·sqrt(L)·b·d``: ``O(sqrt(L))`` memory holds
    for segments of ``sqrt(L/9)`` blocks; one checkpoint per block (``c = 1``) keeps
    ``L + 9`` units, ``O(L)``.
    """
    if segment is None:
        units = BLOCK_UNITS * layers
    else:
        units = math.ceil(layers / segment) + BLOCK_UNITS * segment
    return units * batch * d * itemsize
