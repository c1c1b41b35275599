"""Data parallelism from scratch: every rank holds the model, gradients are averaged.

Two versions, as chapter 10 builds them:

1. :func:`all_reduce_gradients`, the naive one: after ``backward()``, all-reduce every
   gradient, one at a time, and divide by the world size. Every rank then takes the same
   optimizer step, so the replicas stay identical.
2. :class:`DistributedDataParallel`, the one ``torch.nn.parallel.DistributedDataParallel``
   is (Li et al. 2020, "PyTorch Distributed: Experiences on Accelerating Data Parallel
   Training", VLDB): gradients grouped into *buckets* of about ``bucket_cap_mb``, in the
   reverse order of registration (roughly the order backward produces them); a bucket is
   all-reduced asynchronously as soon as its last gradient is ready
   (``register_post_accumulate_grad_hook``), so communication overlaps the rest of the
   backward pass; at the end of backward (an autograd engine callback, as torch's
   ``Reducer::finalize_backward``) every bucket is waited for and its averages written to
   ``.grad``. Also as torch's: parameters and buffers broadcast from rank 0 when the model
   is wrapped, :meth:`~DistributedDataParallel.no_sync` for gradient accumulation,
   ``find_unused_parameters`` for parameters that get no gradient in a step (without it,
   a clear error names them), tied weights counted once, frozen parameters left out.

Every event (a gradient ready, a bucket's all-reduce started and finished) is
timestamped, for the lab's timeline.
"""

from __future__ import annotations

import contextlib
import time

import torch
import torch.distributed as dist
from torch import nn


def all_reduce_gradients(model: nn.Module, group=None) -> None:
    """The naive data-parallel step: average every gradient over the ranks, in place."""
    world = dist.get_world_size(group)
    for p in model.parameters():
        if p.grad is not None:
            dist.all_reduce(p.grad, group=group)
            p.grad /= world


def broadcast_state(module: nn.Module, src: int = 0, group=None) -> None:
    """Copy rank ``src``'s parameters and buffers into every rank's ``module``."""
    with torch.no_grad():
        for t in [*module.parameters(), *module.buffers()]:
            dist.broadcast(t, src=src, group=group)


class Bucket:
    """Parameters whose gradients travel together, in one flat buffer."""

    def __init__(self, index: int, params: list[nn.Parameter]):
        self.index = index
        self.params = params
        self.buffer = torch.zeros(
            sum(p.numel() for p in params), dtype=params[0].dtype, device=params[0].device
        )
        self.slices, start = {}, 0
        for p in params:
            self.slices[id(p)] = slice(start, start + p.numel())
            start += p.numel()
        self.pending: set[int] = set()
        self.work = None

    @property
    def nbytes(self) -> int:
        return self.buffer.numel() * self.buffer.element_size()


def make_buckets(params: list[nn.Parameter], cap_bytes: int) -> list[Bucket]:
    """Fill buckets of at most ``cap_bytes`` with ``params`` in reverse order (the last
    layer's gradients are ready first); a parameter larger than the cap gets a bucket of
    its own, and a parameter is never split. Buckets hold one dtype and device each."""
    buckets, current, size = [], [], 0
    for p in reversed(params):
        nbytes = p.numel() * p.element_size()
        same_kind = not current or (p.dtype, p.device) == (current[0].dtype, current[0].device)
        if current and (size + nbytes > cap_bytes or not same_kind):
            buckets.append(Bucket(len(buckets), current))
            current, size = [], 0
        current.append(p)
        size += nbytes
    if current:
        buckets.append(Bucket(len(buckets), current))
    return buckets


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over the ranks.

    ``bucket_cap_mb`` is the bucket size in MiB (torch's default: 25). ``group`` is the
    data-parallel process group (``None``: every rank). After construction every rank
    holds rank 0's parameters and buffers.
    """

    def __init__(
        self,
        module: nn.Module,
        bucket_cap_mb: float = 25,
        group=None,
        find_unused_parameters: bool = False,
    ):
        super().__init__()
        self.module = module
        self.group = group
        self.world_size = dist.get_world_size(group)
        self.find_unused_parameters = find_unused_parameters
        src = dist.get_global_rank(group, 0) if group is not None else 0
        broadcast_state(module, src=src, group=group)
        self.names = {id(p): n for n, p in module.named_parameters()}
        params = [p for p in module.parameters() if p.requires_grad]  # tied: once
        self.buckets = make_buckets(params, int(bucket_cap_mb * 2**20))
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.require_sync = True
        self.in_backward = False
        self.events: list[tuple[str, float]] = []  # (what, time.perf_counter())
        for p in params:
            p.register_post_accumulate_grad_hook(self._grad_ready)

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, backward only accumulates local gradients (gradient accumulation); the
        first backward after it averages everything accumulated."""
        self.require_sync = False
        try:
            yield
        finally:
            self.require_sync = True

    # ----------------------------------------------------------------------- backward

    def _grad_ready(self, p: nn.Parameter) -> None:
        if not self.require_sync:
            return
        if not self.in_backward:  # the first gradient of this backward pass
            self.in_backward = True
            for bucket in self.buckets:
                bucket.pending = {id(q) for q in bucket.params}
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
        bucket = self.bucket_of[id(p)]
        bucket.buffer[bucket.slices[id(p)]].copy_(p.grad.reshape(-1))
        bucket.pending.discard(id(p))
        self.events.append((f"grad {self.names[id(p)]}", time.perf_counter()))
        if not bucket.pending:
            self._launch(bucket)

    def _launch(self, bucket: Bucket) -> None:
        self.events.append((f"all-reduce start bucket {bucket.index}", time.perf_counter()))
        bucket.work = dist.all_reduce(bucket.buffer, group=self.group, async_op=True)

    def _finalize(self) -> None:
        """End of backward: launch what is left, wait for every bucket, write averages."""
        self.in_backward = False
        unused = [q for b in self.buckets for q in b.params if id(q) in b.pending]
        if unused and not self.find_unused_parameters:
            names = ", ".join(self.names[id(q)] for q in unused)
            raise RuntimeError(
                f"parameters got no gradient in this backward pass: {names}. Every rank "
                "must all-reduce every bucket, so a bucket waiting for them would never be "
                "sent. Pass find_unused_parameters=True (their gradient counts as zero), "
                "or freeze them (requires_grad=False)."
            )
        for bucket in self.buckets:
            if bucket.pending:  # unused parameters contribute zero
                for q in bucket.params:
                    if id(q) in bucket.pending:
                        bucket.buffer[bucket.slices[id(q)]].zero_()
                bucket.pending.clear()
                self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            self.events.append((f"all-reduce done bucket {bucket.index}", time.perf_counter()))
            bucket.buffer /= self.world_size
            for q in bucket.params:
                view = bucket.buffer[bucket.slices[id(q)]].view_as(q)
                if q.grad is None:
                    q.grad = view.clone()
                else:
                    q.grad.copy_(view)
            bucket.work = None
