"""Parallel training strategies, one module per strategy (chapters 9 to 16).

* :mod:`~labsupport.parallel.parameter_server`: server and worker ranks, synchronous,
  asynchronous and stale-synchronous (chapter 9);
* :mod:`~labsupport.parallel.data_parallel`: data parallelism from scratch, naive and
  bucketed with overlap (PyTorch's ``DistributedDataParallel``; chapter 10);
* :mod:`~labsupport.parallel.schedules` and :mod:`~labsupport.parallel.pipeline_parallel`:
  pipeline schedules as data (naive, GPipe, 1F1B, interleaved, breadth-first, and in
  :mod:`~labsupport.parallel.zero_bubble` ZB-H1, ZB-V and DualPipeV, whose backward
  :mod:`~labsupport.parallel.split_backward` splits), checked by
  :mod:`~labsupport.parallel.simulator`, and the executor that runs any of them on the
  course GPT's stages (chapter 11);
* :mod:`~labsupport.parallel.tensor_parallel` and
  :mod:`~labsupport.parallel.tensor_parallel_model`: Megatron's column- and row-parallel
  layers, the f/g operators, sequence parallelism, the vocabulary-parallel embedding and
  loss, and the course GPT split over ranks; grouped-query attention split by heads
  (:mod:`~labsupport.parallel.tensor_parallel_gqa`) and the all-gather overlapped with its
  matrix products (:mod:`~labsupport.parallel.tensor_parallel_overlap`) (chapter 12);
* :mod:`~labsupport.parallel.parallel_state` and :mod:`~labsupport.parallel.hybrid`: the
  mesh of tensor-, pipeline- and data-parallel groups, and the GPT trained 3D (chapter 13);
* :mod:`~labsupport.parallel.zero`: ZeRO stages 1, 2 and 3 from scratch, flat buffers
  sharded over the data-parallel ranks, stage 3 with prefetching (chapter 14);
* :mod:`~labsupport.parallel.checkpoint`: sharded checkpoints with
  ``torch.distributed.checkpoint`` that resume exactly and reshard (chapter 16).

Each runs unchanged under :func:`labsupport.launch` and under ``torchrun``, on gloo or
NCCL, takes an explicit ``group=`` where a process group matters, and is checked in the
unit tests against PyTorch's own implementation.
"""
