"""The models the labs train, built locally (no downloads), and data made in code.

* :mod:`~labsupport.models.gpt`: the course's one GPT (nanoGPT's GPT-2);
* :mod:`~labsupport.models.mlp`: an MLP, and the residual MLP stack of chapter 4;
* :mod:`~labsupport.models.cnn`: a LeNet-style CNN;
* :mod:`~labsupport.models.data`: random tokens and regression data from a seed, and a
  data-parallel rank's share of a batch;
* :mod:`~labsupport.models.reference`: the one-process training loop every parallel run
  is checked against;
* :mod:`~labsupport.models.moe`: a mixture-of-experts FFN (router, experts, balancing).
* :mod:`~labsupport.models.fp8`: FP8 quantization (per tensor, per block, delayed) and the
  scaled matmul a linear layer trained in FP8 computes;
* :mod:`~labsupport.models.recompute`: the recomputation policies and checkpointing's
  unit, as constants without torch (for the calculators).
"""

from labsupport.models.cnn import SmallCNN
from labsupport.models.data import batch_share, random_tokens, regression_data
from labsupport.models.gpt import (
    GPT,
    GPT2_LARGE,
    GPT2_MEDIUM,
    GPT2_SMALL,
    GPT2_XL,
    GPTConfig,
    tiny_gpt,
)
from labsupport.models.mlp import MLP, MLPStack
from labsupport.models.moe import MoE, MoEConfig
from labsupport.models.reference import gpt_loss, mse_loss, train_one_process

__all__ = [
    "GPT",
    "GPT2_LARGE",
    "GPT2_MEDIUM",
    "GPT2_SMALL",
    "GPT2_XL",
    "MLP",
    "GPTConfig",
    "MLPStack",
    "MoE",
    "MoEConfig",
    "SmallCNN",
    "batch_share",
    "gpt_loss",
    "mse_loss",
    "random_tokens",
    "regression_data",
    "tiny_gpt",
    "train_one_process",
]
