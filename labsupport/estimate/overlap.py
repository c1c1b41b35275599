"""How much of a data-parallel step's communication hides behind its backward pass.

Chapter 10's model of one DDP step (Li et al. 2020, "PyTorch Distributed", VLDB, section
3.2: gradients bucketed in reverse order, each bucket all-reduced while backward goes
on). :func:`overlap_schedule` places every bucket's all-reduce on a timeline, given the
forward and backward times and the alpha-beta cost of one all-reduce (chapter 5); the
chapter's figure (:func:`labsupport.viz.data_parallel.overlap_figure`) and lab 10's sweep
of the bucket size both use it.
"""

from __future__ import annotations


def overlap_schedule(
    bucket_bytes: list[int], forward_s: float, backward_s: float, a: float, b: float, overlap=True
):
    """When each bucket's all-reduce runs, in a model of one DDP step.

    Backward produces the gradients at an even rate in bytes, last layer first, so a
    bucket is ready when backward has produced every byte up to its end (with
    ``overlap=False``, as in the naive version, every bucket waits for the end of
    backward). The all-reduces run one after another, each taking ``a + b * bytes``
    (the alpha-beta cost of one all-reduce, fitted on this machine or taken from a
    datasheet). Returns ``(buckets, step)``: per bucket ``(ready, start, end)`` in
    seconds since the step started, and the step's time, the later of the backward's
    end and the last all-reduce's end.
    """
    total, done, free, out = sum(bucket_bytes), 0, 0.0, []
    for nbytes in bucket_bytes:
        done += nbytes
        ready = forward_s + backward_s * (done / total if overlap else 1.0)
        start = max(ready, free)
        free = start + a + b * nbytes
        out.append((ready, start, free))
    return out, max(forward_s + backward_s, free)
