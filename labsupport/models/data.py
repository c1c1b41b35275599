"""Training data made in code: no download, the same on every machine for a seed, and
each data-parallel rank's share of a batch.

Each function draws from its own ``torch.Generator`` on the CPU, so the data do not
depend on the global random state, on the device, or on how many threads run; move the
result to :func:`labsupport.launch.runtime.device` where it is used.
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


def batch_share(n: int, rank: int, world: int) -> slice:
    """The rows of a global batch of ``n`` that data-parallel rank ``rank`` of ``world``
    trains on: ``rank·n//world`` up to ``(rank+1)·n//world``. The shares are contiguous,
    in rank order, differ in size by one at most and together are the whole batch, as
    Megatron-LM's ``MegatronPretrainingSampler`` (``data_samplers.py``) hands each
    data-parallel rank a contiguous slice. Use: ``idx[batch_share(len(idx), rank, world)]``."""
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} is not one of the {world} ranks 0 to {world - 1}")
    return slice(rank * n // world, (rank + 1) * n // world)
