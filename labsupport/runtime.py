"""What a rank needs to know about itself: its device and its process group.

The same code runs under :func:`labsupport.launch` and under ``torchrun``: both give
each rank the environment that torchrun documents (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), and
:func:`init_process_group` reads it through ``init_method="env://"``.

Reference: https://pytorch.org/docs/stable/elastic/run.html#environment-variables
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist


def local_rank() -> int:
    """This rank's index on its node (``LOCAL_RANK``, 0 outside a launch)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def gpus_visible() -> int:
    """How many CUDA devices this process can see (0 on a machine without GPUs)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def resolve_backend(backend: str, ranks_per_node: int) -> str:
    """Turn ``"auto"`` into ``"nccl"`` or ``"gloo"``, and refuse nccl without the GPUs.

    ``"auto"`` picks nccl when every rank on this node can have a GPU of its own (NCCL
    does not support two ranks on one device) and gloo, which runs on CPU tensors,
    otherwise.
    """
    gpus = gpus_visible()
    if backend == "auto":
        return "nccl" if gpus >= ranks_per_node else "gloo"
    if backend == "nccl" and gpus < ranks_per_node:
        raise ValueError(
            f"backend='nccl' needs one GPU per rank: {ranks_per_node} ranks on this node "
            f"but {gpus} GPU(s) visible. Use backend='gloo' (CPU tensors) or "
            f"backend='auto', or ask for at most {gpus} ranks per node."
        )
    if backend not in ("gloo", "nccl", "mpi", "ucc", "xccl"):
        raise ValueError(f"unknown backend {backend!r}: use 'auto', 'gloo' or 'nccl'")
    return backend


def device() -> torch.device:
    """The device this rank computes on.

    ``cuda:LOCAL_RANK`` when the process group uses nccl (one GPU per rank, as
    torchrun's examples do); with gloo, CPU, unless ``LABSUPPORT_DEVICE=cuda`` asks for
    CUDA tensors over gloo.
    """
    if dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.device("cuda", local_rank())
    if os.environ.get("LABSUPPORT_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", local_rank() % max(1, gpus_visible()))
    return torch.device("cpu")


def init_process_group(backend: str = "auto", timeout: float = 300.0) -> str:
    """Initialise the default process group from the torchrun environment.

    Returns the backend used. With nccl, the rank's GPU is made current first, so that
    collectives and ``device()`` agree.
    """
    backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    if backend == "nccl":
        torch.cuda.set_device(local_rank())
    dist.init_process_group(
        backend=backend, init_method="env://", timeout=timedelta(seconds=timeout)
    )
    return backend
