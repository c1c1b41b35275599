"""Training data made in code: no download, the same on every machine for a seed.

Each function draws from its own ``torch.Generator`` on the CPU, so the data do not
depend on the global random state, on the device, or on how many threads run; move the
result to :func:`labsupport.launch.runtime` where it is used.
"""

from __future__ import annotations

import torch


def random_tokens(batch: int, block_size: int, vocab_size: int, seed: int = 0):
    """``batch`` sequences of ``block_size`` random token ids and their next-token
    targets (the same sequences shifted by one): ``(idx, targets)``, int64."""
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(vocab_size, (batch, block_size + 1), generator=generator)
    return tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()


def regression_data(n: int = 64, d_in: int = 16, d_out: int = 4, seed: int = 1):
    """``n`` Gaussian inputs of ``d_in`` features and ``d_out`` Gaussian targets: ``(x, y)``."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(n, d_in, generator=generator), torch.randn(n, d_out, generator=generator)
