"""Parallel training strategies, one module per strategy (chapters 9 to 16).

* :mod:`~labsupport.parallel.parameter_server`: server and worker ranks, synchronous,
  asynchronous and stale-synchronous (chapter 9);
* :mod:`~labsupport.parallel.data_parallel`: data parallelism from scratch, naive and
  bucketed with overlap (PyTorch's ``DistributedDataParallel``; chapter 10).

Each runs unchanged under :func:`labsupport.launch` and under ``torchrun``, on gloo or
NCCL, takes an explicit ``group=`` where a process group matters, and is checked in the
unit tests against PyTorch's own implementation.
"""
