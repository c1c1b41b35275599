"""Data parallelism from scratch: every rank holds the model, gradients are averaged.

1. :func:`all_reduce_gradients`, the naive version: after ``backward()``, all-reduce
   every gradient and divide by the world size; every rank takes the same step.
2. :class:`DistributedDataParallel`, PyTorch's (Li et al. 2020, "PyTorch Distributed",
   VLDB; ``torch/csrc/distributed/c10d/reducer.cpp``): gradients in buckets by torch's
   rule, the last parameters in bucket 0; a hook per parameter copies its gradient into
   its bucket; buckets are all-reduced asynchronously during backward, **strictly in
   bucket order** on every rank (``Reducer::mark_bucket_ready``), then waited for and
   their averages written to ``.grad``. Also as torch's: ``no_sync`` (decided in
   forward), ``find_unused_parameters`` (a parameter no rank used keeps its ``.grad``),
   ``register_comm_hook``, rank 0's state broadcast, tied weights once, frozen ones out.

Where it differs: torch, unless ``find_unused_parameters=True``, uses one bucket in its
first iteration, then rebuilds its buckets in the order gradients arrived; this one keeps
the buckets torch builds with ``find_unused_parameters=True``. A parameter without a
gradient (and without ``find_unused_parameters``) is named in an error at the end of
backward (torch raises at the next forward). Collectives go through ``comm.traced``.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_leaves

from labsupport.comm import traced
from labsupport.comm.flat import spans

#: torch's defaults: ``bucket_cap_mb=None`` is 25 MiB with the first bucket (the first
#: parameters registered) capped at 1 MiB (``dist._DEFAULT_FIRST_BUCKET_BYTES``).
DEFAULT_BUCKET_CAP_MB, DEFAULT_FIRST_BUCKET_BYTES = 25, 2**20


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
            traced.broadcast(t, src, group)


def compute_bucket_assignment_by_size(tensors: list, limits: list[int]) -> list[list[int]]:
    """torch's ``compute_bucket_assignment_by_size``: the tensors' indices, in buckets.

    The tensors go in the order given into one open bucket per (dtype, device), which
    closes once its bytes **reach or pass** its limit (a tensor is never split): the first
    bucket of a kind has ``limits[0]``, the next ``limits[1]``, the last limit repeating.
    Buckets come sorted by their smallest index."""
    done, open_, nth = [], {}, {}
    for i, t in enumerate(tensors):
        key = (t.dtype, t.device)
        indices, size = open_.get(key, ([], 0))
        indices.append(i)
        open_[key] = (indices, size + t.numel() * t.element_size())
        k = nth.setdefault(key, 0)
        if open_[key][1] >= limits[k]:
            done.append(open_.pop(key)[0])
            nth[key] = min(k + 1, len(limits) - 1)
    return sorted(done + [indices for indices, _ in open_.values()], key=min)


class Bucket:
    """Parameters whose gradients travel together, in one flat buffer.

    To a communication hook it is torch's ``GradBucket`` (:meth:`index`, :meth:`buffer`,
    :meth:`gradients`, :meth:`parameters`, :meth:`is_last`, :meth:`set_buffer`, so that
    torch's hooks, PowerSGD's included, run on it); it runs its own state in picotron's shape
    (``picotron/data_parallel/bucket.py``): :meth:`mark_param_as_ready` until every
    gradient is in, :meth:`launch`, :meth:`wait`, :meth:`reset`.
    """

    def __init__(self, index: int, params: list[nn.Parameter], last: bool):
        self._index, self.params, self._last = index, params, last
        places = spans(p.numel() for p in params)
        self.slices = {id(p): s for p, s in zip(params, places, strict=True)}
        numel = self.slices[id(params[-1])].stop
        self.grad_data = torch.zeros(numel, dtype=params[0].dtype, device=params[0].device)
        self.reset()

    def index(self) -> int:
        return self._index

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, tensor: torch.Tensor) -> None:  # what buffer() gives, this step
        self._buffer = tensor

    def gradients(self) -> list[torch.Tensor]:
        """Each parameter's gradient: a view of the flat buffer in its shape."""
        return [self.grad_data[self.slices[id(p)]].view_as(p) for p in self.params]

    def parameters(self) -> list[nn.Parameter]:
        return list(self.params)

    def is_last(self) -> bool:
        return self._last

    @property
    def nbytes(self) -> int:
        return self.grad_data.numel() * self.grad_data.element_size()

    @property
    def ready(self) -> bool:
        return not self.pending

    def reset(self) -> None:  # before a backward pass: every gradient pending
        self.pending = {id(p) for p in self.params}
        self.future, self._buffer = None, self.grad_data

    def mark_param_as_ready(self, p: nn.Parameter, scale: float) -> bool:
        """Copy ``p.grad * scale`` into its place in the buffer (zeros if ``p`` has no
        gradient; torch's ``mark_variable_ready_dense``); whether the bucket is complete."""
        view = self.grad_data[self.slices[id(p)]]
        if p.grad is None:
            view.zero_()
        else:
            torch.mul(p.grad.reshape(-1), scale, out=view)
        self.pending.discard(id(p))
        return self.ready

    def launch(self, hook, state) -> None:  # hook(state, self) returns a Future
        self.future = hook(state, self)

    def wait(self) -> torch.Tensor:  # the reduced flat gradients, in the buffer's dtype
        result = self.future.wait()
        return (result[0] if isinstance(result, list) else result).to(self.grad_data.dtype)


def make_buckets(params: list, cap_bytes: int, first_cap_bytes: int | None = None) -> list:
    """DDP's buckets for ``params`` (in registration order), as torch's constructor makes
    them with ``find_unused_parameters=True``: assigned in registration order with the
    limits ``[first_cap_bytes, cap_bytes]`` (``[cap_bytes]`` if no smaller first cap), then
    reversed, so that the last parameters, whose gradients backward produces first, are
    in bucket 0."""
    first = cap_bytes if first_cap_bytes is None else first_cap_bytes
    limits = [first, cap_bytes] if first < cap_bytes else [cap_bytes]
    groups = compute_bucket_assignment_by_size(params, limits)[::-1]
    return [
        Bucket(i, [params[j] for j in group], i == len(groups) - 1)
        for i, group in enumerate(groups)
    ]


def _allreduce_by_sum(group, bucket: Bucket) -> torch.futures.Future:
    """DDP without a hook (torch's ``_AllReduceBySumCommHook``): the gradients were
    divided by the world size on their way into the bucket; sum them."""
    return traced.all_reduce(bucket.buffer(), group, async_op=True).get_future()


def reachable_leaves(outputs) -> set[int]:
    """The ids of the leaf tensors that ``outputs``' autograd graph reaches (torch's
    ``Reducer::search_unused_parameters``): their gradient accumulators are in the graph."""
    tensors = [t for t in tree_leaves(outputs) if isinstance(t, torch.Tensor)]
    stack = [t.grad_fn for t in tensors if t.grad_fn is not None]
    seen, leaves = set(stack), set()
    while stack:
        for node, _ in stack.pop().next_functions:
            if node is not None and node not in seen:
                seen.add(node)
                stack.append(node)
                if hasattr(node, "variable"):  # an AccumulateGrad node
                    leaves.add(id(node.variable))
    return leaves


class DistributedDataParallel(nn.Module):
    """Wrap ``module`` so that ``loss.backward()`` leaves gradients averaged over the ranks.

    ``bucket_cap_mb`` is the bucket size in MiB (``None``: torch's default, 25 MiB with a
    first bucket of 1 MiB). ``group`` is the data-parallel process group (``None``: every
    rank). After construction every rank holds rank 0's parameters and buffers.
    """

    def __init__(
        self, module: nn.Module, bucket_cap_mb=None, group=None, find_unused_parameters=False
    ):
        super().__init__()
        self.module, self.group = module, group
        self.world_size = dist.get_world_size(group)
        self.find_unused_parameters = find_unused_parameters
        self.params = [p for p in module.parameters() if p.requires_grad]  # tied: once
        if not self.params:
            raise ValueError("DistributedDataParallel needs a parameter that requires grad")
        src = 0 if group is None else dist.get_global_rank(group, 0)
        broadcast_state(module, src=src, group=group)
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.position = {id(p): i for i, p in enumerate(self.params)}
        cap = DEFAULT_BUCKET_CAP_MB if bucket_cap_mb is None else bucket_cap_mb
        first = DEFAULT_FIRST_BUCKET_BYTES if bucket_cap_mb is None else None
        self.buckets = make_buckets(self.params, int(cap * 2**20), first)
        self.bucket_of = {id(p): b for b in self.buckets for p in b.params}
        self.require_backward_grad_sync = True
        self.comm_hook, self.comm_state = _allreduce_by_sum, group
        self.locally_used: set[int] = set()  # positions used since the last all-reduce
        self._expect_hooks = self._started = False
        self._next_bucket, self._unused = 0, []
        for p in self.params:
            p.register_post_accumulate_grad_hook(self._autograd_hook)

    def register_comm_hook(self, state, hook) -> None:
        """torch's API: each bucket is reduced by ``hook(state, bucket)``, which returns a
        ``torch.futures.Future`` of the bucket's reduced tensor; DDP then no longer
        divides by the world size (the hook does). Once, before training."""
        if self.comm_hook is not _allreduce_by_sum:
            raise RuntimeError("register_comm_hook can only be called once")
        self.comm_hook, self.comm_state = hook, state

    def forward(self, *args, **kwargs):
        output = self.module(*args, **kwargs)
        if torch.is_grad_enabled() and self.require_backward_grad_sync:
            self._prepare_for_backward(output)
        return output

    @contextlib.contextmanager
    def no_sync(self):
        """Inside, forward and backward only accumulate local gradients; the next forward
        and backward outside it average everything accumulated."""
        old, self.require_backward_grad_sync = self.require_backward_grad_sync, False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    # ----------------------------------------------------------------------- backward

    def _prepare_for_backward(self, output) -> None:
        self._expect_hooks, self._started, self._next_bucket = True, False, 0
        for bucket in self.buckets:
            bucket.reset()
        if self.find_unused_parameters:
            reached = reachable_leaves(output)
            self._unused = [p for p in self.params if id(p) not in reached]

    def _autograd_hook(self, p: nn.Parameter) -> None:
        if self.find_unused_parameters:  # also inside no_sync, as torch's local_used_map
            self.locally_used.add(self.position[id(p)])
        if not self._expect_hooks:
            return
        if not self._started:  # the first gradient of this backward pass
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize_backward)
            for q in self._unused:
                self._mark_ready(q)
        self._mark_ready(p)

    def _mark_ready(self, p: nn.Parameter) -> None:
        scale = 1 / self.world_size if self.comm_hook is _allreduce_by_sum else 1.0
        if self.bucket_of[id(p)].mark_param_as_ready(p, scale):
            self._launch_ready_buckets()

    def _launch_ready_buckets(self) -> None:
        """Buckets go strictly in order: launch the next one while it is complete."""
        while self._next_bucket < len(self.buckets) and self.buckets[self._next_bucket].ready:
            self.buckets[self._next_bucket].launch(self.comm_hook, self.comm_state)
            self._next_bucket += 1
        if self._next_bucket == len(self.buckets) and self.find_unused_parameters:
            used = torch.zeros(len(self.params), dtype=torch.int32)
            used[sorted(self.locally_used)] = 1  # then summed: how many ranks used each
            self._used = used.to(self.params[0].device)
            self._used_work = traced.all_reduce(self._used, self.group, async_op=True)

    def _finalize_backward(self) -> None:
        """End of backward: wait for every bucket, write the averages into ``.grad``."""
        self._expect_hooks = False
        missing = [p for b in self.buckets for p in b.params if id(p) in b.pending]
        if missing and not self.find_unused_parameters:
            names = ", ".join(self.names[id(q)] for q in missing)
            raise RuntimeError(
                f"parameters got no gradient in this backward pass: {names}. Every rank "
                "must all-reduce every bucket, so a bucket waiting for them would never be "
                "sent. Pass find_unused_parameters=True, or freeze them "
                "(requires_grad=False)."
            )
        for p in missing:  # reached by the graph but given no gradient: unused
            self._mark_ready(p)
        used = None
        if self.find_unused_parameters:
            self._used_work.wait()
            used, self.locally_used = self._used.cpu(), set()
        for bucket in self.buckets:
            reduced = bucket.wait()
            for p in bucket.params:
                if used is not None and not used[self.position[id(p)]]:
                    continue  # no rank used it: its .grad stays as it was
                view = reduced[bucket.slices[id(p)]].view_as(p)
                p.grad = view.clone() if p.grad is None else p.grad.copy_(view)
