"""Numbers every rank computes, combined over the ranks: the loss of the whole batch.

torchtitan logs its loss the same way (``dist_mean`` in ``torchtitan/distributed/utils.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def mean_over_ranks(value: torch.Tensor, group=None) -> float:
    """The mean over the ranks of ``group`` of ``value``, a one-element tensor (every
    rank calls it and gets the same number): with equal shares of a batch, each rank's
    loss averaged is the loss of the whole batch."""
    total = value.detach().clone()
    dist.all_reduce(total, group=group)
    return total.item() / dist.get_world_size(group)
