"""What a rank needs to know about itself: its backend, its device, its process group.

The same code runs under :func:`labsupport.launch` and under ``torchrun``: both give
each rank the environment that torchrun documents (``RANK``, ``LOCAL_RANK``,
``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``MASTER_ADDR``, ``MASTER_PORT``), and
:func:`init_process_group` reads it through ``init_method="env://"``.

On a machine with a GPU for every rank, ``backend="auto"`` initialises *two* backends
in one process group, ``"cpu:gloo,cuda:nccl"``: CUDA tensors go through NCCL and CPU
tensors through gloo, so a lab that sums a CPU tensor still works on a GPU box
(``torch.distributed`` picks the backend by the tensor's device; see "Backends" in
https://pytorch.org/docs/stable/distributed.html). :func:`device` then returns this
rank's GPU, and every distributed function of the course puts its tensors there.

Reference: https://pytorch.org/docs/stable/elastic/run.html#environment-variables
"""

from __future__ import annotations

import os
from datetime import timedelta

import torch
import torch.distributed as dist

from labsupport.launch import loopback

#: The backend ``"auto"`` picks when every rank on the node can have a GPU of its own.
GPU_BACKEND = "cpu:gloo,cuda:nccl"
_KNOWN = ("gloo", "nccl", "mpi", "ucc", "xccl", GPU_BACKEND)


def local_rank() -> int:
    """This rank's index on its node (``LOCAL_RANK``, 0 outside a launch)."""
    return int(os.environ.get("LOCAL_RANK", "0"))


def gpus_visible() -> int:
    """How many CUDA devices this process can see (0 on a machine without GPUs)."""
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def uses_nccl(backend: str) -> bool:
    """Whether a backend string (``"nccl"``, ``"cpu:gloo,cuda:nccl"``) includes NCCL."""
    return "nccl" in backend


def resolve_backend(backend: str, ranks_per_node: int) -> str:
    """Turn ``"auto"`` into a backend, and refuse NCCL without the GPUs it needs.

    ``"auto"`` gives :data:`GPU_BACKEND` (gloo for CPU tensors, NCCL for CUDA tensors)
    when every rank on this node can have a GPU of its own, and gloo otherwise. NCCL
    does not support two ranks on one GPU, so ``"nccl"`` with fewer GPUs than ranks
    per node is an error that says what to do.
    """
    gpus = gpus_visible()
    if backend == "auto":
        return GPU_BACKEND if gpus >= ranks_per_node else "gloo"
    if backend not in _KNOWN:
        raise ValueError(
            f"unknown backend {backend!r}: use 'auto', 'gloo', 'nccl' or {GPU_BACKEND!r}"
        )
    if uses_nccl(backend) and gpus < ranks_per_node:
        raise ValueError(
            f"backend={backend!r} needs one GPU per rank: {ranks_per_node} ranks on this node "
            f"but {gpus} GPU(s) visible. Use backend='gloo' (CPU tensors) or "
            f"backend='auto', or ask for at most {gpus} ranks per node."
        )
    return backend


def _gpu_index() -> int:
    """This rank's GPU: ``LOCAL_RANK`` modulo the GPUs it sees.

    With one GPU per rank visible (torchrun, this launcher) that is ``LOCAL_RANK``; a
    scheduler that gives every task only its own GPU (Slurm's ``--gpus-per-task=1``)
    leaves one device visible, index 0.
    """
    return local_rank() % max(1, gpus_visible())


def device() -> torch.device:
    """The device this rank computes on.

    This rank's GPU when its process group uses NCCL (or ``LABSUPPORT_DEVICE=cuda``
    asks for CUDA tensors over gloo); the CPU otherwise.
    """
    nccl = dist.is_initialized() and uses_nccl(str(dist.get_backend()))
    if nccl or os.environ.get("LABSUPPORT_DEVICE", "cpu") == "cuda":
        return torch.device("cuda", _gpu_index())
    return torch.device("cpu")


def synchronize(where=None) -> None:
    """Wait for the GPU's queued work, so a clock read afterwards includes it.

    CUDA kernels and NCCL collectives return before they finish; a timer that does not
    synchronise measures only the launch. No-op for CPU devices.
    """
    where = device() if where is None else torch.device(where)
    if where.type == "cuda":
        torch.cuda.synchronize(where)


def init_process_group(backend: str = "auto", timeout: float = 300.0) -> str:
    """Initialise the default process group from the torchrun environment.

    Returns the backend used. With NCCL, the rank's GPU is made current first, so that
    collectives and :func:`device` agree. ``timeout`` bounds every collective: a rank
    whose peers never arrive fails after it rather than waiting forever. A store this
    rank hosts for a loopback ``MASTER_ADDR`` listens on loopback only
    (:func:`~labsupport.launch.loopback.host_env_store`).
    """
    backend = resolve_backend(backend, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    # Every rank waits, at the end of setup, until all have connected (a barrier on the
    # rendezvous store). Without it a fast rank can finish, tear its group down and exit
    # while a slow one is still connecting to it, which then fails with "Connection
    # closed by peer". PyTorch made this barrier optional in 2023, as it costs time on
    # thousands of ranks (see _is_barrier_after_init in distributed_c10d.py).
    os.environ.setdefault("TORCH_DIST_INIT_BARRIER", "1")
    kwargs = {}
    if uses_nccl(backend):
        torch.cuda.set_device(_gpu_index())
        kwargs["device_id"] = torch.device("cuda", _gpu_index())
    server = loopback.host_env_store()  # noqa: F841 - kept until the group holds the store
    dist.init_process_group(
        backend=backend, init_method="env://", timeout=timedelta(seconds=timeout), **kwargs
    )
    return backend
