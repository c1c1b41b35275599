"""The compute wall: FLOPs of training, and days on a number of GPUs.

Training a dense transformer of N parameters on D tokens takes about 6·N·D
floating-point operations (Kaplan et al. 2020, "Scaling Laws for Neural Language
Models", section 2.1): 2·N per token in the forward pass, 4·N in the backward pass.
:func:`transformer_training_flops` counts every matrix multiplication, attention
included (Korthikanti et al. 2022, appendix A; Narayanan et al. 2021 with recomputation).
:mod:`labsupport.measure.flops` counts the same FLOPs on a real model, for the lab to hold
against these.
"""

from __future__ import annotations

from labsupport.estimate.datasheets import ASSUMED_MFU
from labsupport.models.recompute import RECOMPUTE

SECONDS_PER_DAY = 86_400
FORWARD_FLOPS_PER_PARAM = 2  # one multiply and one add per weight and token
BACKWARD_FLOPS_PER_PARAM = 4  # the gradient for the input and the gradient for the weight


def training_flops(num_params, num_tokens):
    """FLOPs to train a dense model of ``num_params`` parameters on ``num_tokens`` tokens.

    C ≈ 6·N·D (Kaplan et al. 2020, "Scaling Laws for Neural Language Models", section
    2.1): every weight does one multiply-add (2 FLOPs) per token in the forward pass, and
    twice that in the backward pass (one product for the gradient of the layer's input,
    one for the gradient of the weight). It leaves out attention's s×s products (see
    :func:`transformer_training_flops`) and recomputation.
    """
    return (FORWARD_FLOPS_PER_PARAM + BACKWARD_FLOPS_PER_PARAM) * num_params * num_tokens


def transformer_training_flops(num_tokens, layers, hidden, seq_len, vocab, recompute="none"):
    """Every matrix multiplication of training a GPT for ``num_tokens`` tokens, in FLOPs.

    Per token and layer, the forward pass multiplies by 12·h² weights (QKV 3h², output
    projection h², MLP 8h²) and computes two s×s attention products (Q·Kᵀ and the
    scores times V, 2·s·h FLOPs each per token); the output layer multiplies by h·V.
    Backward is twice forward. Korthikanti et al. 2022 ("Reducing Activation Recomputation
    in Large Transformer Models", appendix A) give the same count per batch of B
    sequences, the model FLOPs: 72·B·s·l·h²·(1 + s/(6h) + V/(12·l·h)).
    ``recompute="full"`` runs every layer's forward once more in the backward pass
    (Narayanan et al. 2021, "Efficient Large-Scale Language Model Training on GPU Clusters
    Using Megatron-LM", appendix: 96·B·s·l·h²·(1 + s/(6h) + V/(16·l·h))); ``"selective"``
    reruns only the two attention products.
    Biases, layer norms and softmax are not counted.
    """
    if recompute not in RECOMPUTE:
        raise ValueError(f"recompute must be one of {', '.join(RECOMPUTE)}")
    weights, attention = 2 * 12 * hidden**2, 4 * seq_len * hidden  # forward, per token
    per_layer = 3 * (weights + attention)
    if recompute == "full":
        per_layer += weights + attention
    elif recompute == "selective":
        per_layer += attention
    output_layer = 3 * 2 * hidden * vocab
    return num_tokens * (layers * per_layer + output_layer)


def training_days(flops, num_gpus, peak_flops, mfu=ASSUMED_MFU):
    """Days of training for ``flops`` on ``num_gpus`` GPUs at model FLOPs utilization ``mfu``.

    MFU (Chowdhery et al. 2022, PaLM, section 4.1) is the share of the GPUs' peak FLOP/s
    that goes into the model's own FLOPs (PaLM's appendix B: 6·N plus attention's 12·l·H·Q·s
    per token, for l layers of H heads of dimension Q and sequences of s tokens;
    recomputation not counted).
    The course counts 6·N·D, which leaves attention out.
    """
    return flops / (num_gpus * peak_flops * mfu) / SECONDS_PER_DAY
