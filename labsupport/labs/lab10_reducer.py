"""Lab 10's scaffold for exercise 4, the DDP gradient hook and the end-of-backward wait
that the learner writes: a :class:`Reducer` that holds the buckets and calls them, and
the watch the checker (:mod:`labsupport.labs.lab10_exercises`) keeps on it.

:class:`Reducer` is the bookkeeping of PyTorch's C++ reducer
(``torch/csrc/distributed/c10d/reducer.cpp``) and nothing else: the buckets (the rule of
:func:`~labsupport.parallel.data_parallel.make_buckets`), a flat buffer per bucket, how
many of its gradients are still to come (``pending``), the next bucket to launch
(``next_bucket``), and a post-accumulate-grad hook on every parameter that calls the
learner's ``autograd_hook(reducer, param)``; at the end of backward it calls the
learner's ``finalize_backward(reducer)``. A parameter that this rank's forward did not
reach comes to the hook at the start of backward with ``.grad`` ``None``, as PyTorch's
reducer marks it ready with ``find_unused_parameters=True``.

While the checker runs, ``dist.all_reduce`` is watched (:func:`watched_all_reduce`): each
call is recorded in order with the gradient hooks, a bucket launched out of bucket order
is refused, and an asynchronous all-reduce of a bucket hands its result to the bucket
when its work is waited for, not before, so that a copy made before the wait is wrong
every time rather than when the timing is unlucky.
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from torch import nn

from labsupport.comm.flat import spans
from labsupport.parallel.data_parallel import compute_bucket_assignment_by_size, reachable_leaves


class Bucket:
    """Parameters whose gradients travel together: ``params``, the flat ``buffer``,
    ``view(param)`` (the parameter's place in it, in its shape), ``pending`` (how many of
    its gradients are still to come, this backward pass) and ``work`` (``None`` until its
    all-reduce is launched)."""

    def __init__(self, index: int, params: list):
        self.index, self.params = index, params
        places = spans(p.numel() for p in params)
        self._slices = {id(p): s for p, s in zip(params, places, strict=True)}
        self.buffer = torch.zeros(places[-1].stop, dtype=params[0].dtype, device=params[0].device)
        self.pending, self.work = len(params), None

    def view(self, param: nn.Parameter) -> torch.Tensor:
        return self.buffer[self._slices[id(param)]].view_as(param)


class Reducer(nn.Module):
    """``module`` with DDP's buckets and a gradient hook on every parameter that calls
    ``autograd_hook(reducer, param)``; ``finalize_backward(reducer)`` runs when backward
    ends. Buckets of ``cap_bytes`` by PyTorch's rule, bucket 0 holding the last layers.
    What the two functions use: ``buckets``, ``bucket_of(param)``, ``next_bucket`` and
    ``world_size``; ``events`` records, in order, each gradient hook and what watches it."""

    def __init__(self, module: nn.Module, cap_bytes: int, autograd_hook, finalize_backward):
        super().__init__()
        self.module, self.world_size = module, dist.get_world_size()
        self.hook, self.finalize = autograd_hook, finalize_backward
        params = [p for p in module.parameters() if p.requires_grad]  # tied: once
        groups = compute_bucket_assignment_by_size(params, [cap_bytes])[::-1]
        self.buckets = [Bucket(i, [params[j] for j in g]) for i, g in enumerate(groups)]
        self._bucket = {id(p): b for b in self.buckets for p in b.params}
        self.names = {id(p): n for n, p in module.named_parameters()}
        self.events, self.next_bucket, self._unused = [], 0, []
        for p in params:
            p.register_post_accumulate_grad_hook(self._on_gradient)

    def bucket_of(self, param: nn.Parameter) -> Bucket:
        return self._bucket[id(param)]

    def forward(self, *args):
        output = self.module(*args)
        reached = reachable_leaves(output)
        self._unused = [p for b in self.buckets for p in b.params if id(p) not in reached]
        for bucket in self.buckets:
            bucket.pending, bucket.work = len(bucket.params), None
        self.next_bucket, self._started = 0, False
        return output

    def _on_gradient(self, param: nn.Parameter) -> None:
        if not self._started:  # the first gradient: the end of backward, then the unused
            self._started = True
            torch.autograd.Variable._execution_engine.queue_callback(self._finalize)
            for p in self._unused:
                self._call_hook(p)
        self._call_hook(param)

    def _call_hook(self, param: nn.Parameter) -> None:
        self.events.append(("hook", self.names[id(param)]))
        self.hook(self, param)

    def _finalize(self) -> None:
        self.events.append(("finalize", None))
        self.finalize(self)


# --------------------------------------------------------------------------- watching

#: The message of a bucket launched out of order, which the checker turns into a verdict.
OUT_OF_ORDER = "launched bucket {} before bucket {}"


class _Deferred:
    """The work of a bucket's asynchronous all-reduce, run on a copy of the buffer:
    :meth:`wait` waits for it, then writes the sum into the bucket."""

    def __init__(self, work, result: torch.Tensor, buffer: torch.Tensor):
        self._work, self._result, self._buffer = work, result, buffer

    def wait(self, timeout=None) -> bool:
        self._work.wait()
        self._buffer.copy_(self._result)
        return True

    def get_future(self) -> torch.futures.Future:
        return self._work.get_future().then(lambda f: self._buffer.copy_(self._result))

    def is_completed(self) -> bool:
        return self._work.is_completed()


@contextlib.contextmanager
def watched_all_reduce(reducer: Reducer):
    """``dist.all_reduce`` recorded in ``reducer.events`` as ``("all-reduce", bucket
    index or None, async_op)``; a bucket launched before a bucket with a smaller index
    raises (before any rank posts it); a bucket's asynchronous all-reduce is deferred as
    :class:`_Deferred` says. Restored on the way out."""
    original, launched = dist.all_reduce, []
    signature = inspect.signature(original)

    def all_reduce(tensor, *args, **kwargs):
        call = signature.bind(tensor, *args, **kwargs)
        call.apply_defaults()
        async_op = bool(call.arguments["async_op"])
        which = next((b for b in reducer.buckets if b.buffer.data_ptr() == tensor.data_ptr()), None)
        reducer.events.append(("all-reduce", None if which is None else which.index, async_op))
        if which is None:
            return original(*call.args, **call.kwargs)
        _in_order(which.index)
        if not async_op:
            return original(*call.args, **call.kwargs)
        result = call.arguments["tensor"] = tensor.clone()
        return _Deferred(original(*call.args, **call.kwargs), result, tensor)

    def _in_order(index: int) -> None:
        expected = next(i for i in range(len(reducer.buckets) + 1) if i not in launched)
        if index > expected:
            raise RuntimeError(OUT_OF_ORDER.format(index, expected))
        launched.append(index)

    dist.all_reduce = all_reduce
    try:
        yield
    finally:
        dist.all_reduce = original
