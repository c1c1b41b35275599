"""Lab 10's exercise 4, the DDP gradient hook and the end-of-backward wait: the checker
against the notebook's worked solution, the stubs, typical wrong answers with their
verdicts, and one that leaves a rank waiting for an all-reduce no other rank starts."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.labs import lab10_exercises as exercises
from labsupport.labs.lab10_reducer import Reducer
from labsupport.parallel.data_parallel import make_buckets

LAB = "10-data-parallel.ipynb"
HOOK, FINALIZE = (solution(LAB, name) for name in ("autograd_hook", "finalize_backward"))


def copy_in(reducer, param, scale=1.0):
    bucket = reducer.bucket_of(param)
    if param.grad is None:
        bucket.view(param).zero_()
    else:
        bucket.view(param).copy_(param.grad * scale)
    bucket.pending -= 1
    return bucket


def launch_ready(reducer, **kwargs):
    while reducer.next_bucket < len(reducer.buckets):
        bucket = reducer.buckets[reducer.next_bucket]
        if bucket.pending:
            break
        bucket.work = dist.all_reduce(bucket.buffer, **kwargs)
        reducer.next_bucket += 1


def scales_on_the_way_in(reducer, param):
    """Divides by the world size in the hook, as PyTorch does (then the solution's
    finalize_backward divides again)."""
    copy_in(reducer, param, 1 / reducer.world_size)
    launch_ready(reducer, async_op=True)


def never_divides(reducer):
    for bucket in reducer.buckets:
        bucket.work.wait()
        for p in bucket.params:
            p.grad = bucket.view(p).clone()


def only_copies(reducer, param):
    copy_in(reducer, param)


def reduces_at_the_end(reducer):
    """The naive way inside the reducer: right gradients, nothing overlapped."""
    for bucket in reducer.buckets:
        dist.all_reduce(bucket.buffer)
        bucket.buffer /= reducer.world_size
        for p in bucket.params:
            p.grad = bucket.view(p).clone()


def synchronous(reducer, param):
    copy_in(reducer, param)
    launch_ready(reducer)  # async_op=False: backward waits for each bucket


def waits_for_what_was_launched(reducer):
    for bucket in reducer.buckets:
        if bucket.work is not None:
            bucket.work.wait()
        bucket.buffer /= reducer.world_size
        for p in bucket.params:
            p.grad = bucket.view(p).clone()


def copies_before_waiting(reducer):
    for bucket in reducer.buckets:
        for p in bucket.params:
            p.grad = bucket.view(p).clone() / reducer.world_size
        bucket.work.wait()


def per_parameter(reducer, param):
    """The naive all-reduce of each .grad, from the hook."""
    if param.grad is not None:
        dist.all_reduce(param.grad)
        param.grad /= reducer.world_size


def as_they_fill(reducer, param):
    """Launches each bucket once it is complete, whatever the buckets before it."""
    bucket = copy_in(reducer, param)
    if bucket.pending == 0:
        bucket.work = dist.all_reduce(bucket.buffer, async_op=True)


def skips_unused(reducer, param):
    """Leaves out a parameter without a gradient: on a rank whose forward skipped it, its
    bucket never becomes complete, and is never launched."""
    if param.grad is not None:
        copy_in(reducer, param)
        launch_ready(reducer, async_op=True)


def test_dividing_on_the_way_in_as_pytorch_does_passes_too(capsys):
    assert exercises.check_ddp_hook(scales_on_the_way_in, never_divides)
    assert capsys.readouterr().out.startswith("Correct:")


def test_the_worked_solution_passes_and_the_stubs_are_not_attempted(capsys):
    assert exercises.check_ddp_hook(HOOK, FINALIZE)
    assert capsys.readouterr().out.startswith("Correct: torch DDP's gradients on 2 and 3 ranks")
    assert not exercises.check_ddp_hook(stub("autograd_hook"), stub("finalize_backward"))
    out = capsys.readouterr().out
    assert out.startswith("Not attempted yet: write autograd_hook()")
    with pytest.raises(AssertionError, match=r"finalize_backward\(\) still raises"):
        exercises.check_ddp_hook(HOOK, stub("finalize_backward"))


@pytest.mark.parametrize(
    "hook, finalize, verdict",
    [
        (
            scales_on_the_way_in,
            FINALIZE,
            r"rank 0: the gradient of wte.weight \(the course GPT, its output layer tied to its "
            r"embedding, 2 ranks\) differs at \[0, 0\].*\(the average divided by the world "
            r"size again: divide once\)",
        ),
        (HOOK, never_divides, r"it is the sum over the ranks: divide by the world size\)"),
        (HOOK, copies_before_waiting, r"this rank's own gradient, not the ranks' sum"),
        (
            only_copies,
            reduces_at_the_end,
            r"right gradients, but on rank 0 all 4 all-reduces started after backward's last "
            r"gradient hook, so none of them overlaps",
        ),
        (synchronous, waits_for_what_was_launched, r"on rank 0 synchronously"),
        (only_copies, waits_for_what_was_launched, r"never all-reduced bucket\(s\) \[0, 1, 2, 3\]"),
        (per_parameter, waits_for_what_was_launched, r"a tensor that is no bucket's buffer"),
        (
            as_they_fill,
            FINALIZE,
            r"rank [12] launched bucket 2's all-reduce before bucket 0's \(its buckets complete "
            r"in another order",
        ),
    ],
    ids=lambda v: getattr(v, "__name__", "")[:20] or None,
)
def test_a_wrong_answer_gets_its_verdict(hook, finalize, verdict):
    with pytest.raises(AssertionError, match=verdict):
        exercises.check_ddp_hook(hook, finalize)


def test_a_rank_left_waiting_is_a_timeout_with_a_hint():
    with pytest.raises(AssertionError, match="did not all finish within 20 s") as info:
        exercises.check_ddp_hook(skips_unused, waits_for_what_was_launched, timeout=20)
    assert "another rank never started" in str(info.value)


def scaffold_buckets() -> list:
    model = exercises.Branch()
    reducer = Reducer(model, 2176, lambda r, p: None, lambda r: None)
    theirs = make_buckets(list(model.parameters()), 2176)
    return [[id(p) for p in b.params] for b in reducer.buckets] == [
        [id(p) for p in b.params] for b in theirs
    ], [[reducer.names[id(p)] for p in b.params] for b in reducer.buckets]


def test_the_scaffolds_buckets_are_ddps():
    same, names = launch(scaffold_buckets, 2, timeout=60)[0]
    assert same
    assert names[2] == ["a.weight"]  # a bucket alone: a rank skipping a completes it first
