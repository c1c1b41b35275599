"""Lab 10, data parallelism: the notebook's training loop with the three wrappers against
one process, one step's timeline,
its bytes counted, the overlap model, the profiler trace read back, the sampler, averaging
against summing, the drawings, and the exercises' checkers against the notebook's
solutions and common mistakes. (The DDP itself is tested in tests/test_parallel_data.py.)"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import nbformat
import pytest
import torch
import torch.distributed as dist
from notebook_solutions import LABS
from test_lab07_collectives import checks
from torch.utils.data import DistributedSampler

from labsupport import launch
from labsupport.estimate.overlap import overlap_schedule
from labsupport.labs import lab10_data_parallel as lab
from labsupport.labs import lab10_tools as tools
from labsupport.viz import data_parallel as draw

matplotlib.use("Agg")
LAB = "10-data-parallel.ipynb"


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def notebook_loop() -> dict:
    """The namespace of the lab's imports and of its cell that defines the training loop,
    ``train(kind, steps)``, run here as the notebook runs them."""
    cells = [
        c.source for c in nbformat.read(LABS / LAB, as_version=4).cells if c.cell_type == "code"
    ]
    namespace: dict = {}
    for source in (cells[0], next(s for s in cells if "\ndef train(" in s)):
        exec(compile(source, f"<{LAB}>", "exec"), namespace)
    return namespace


def test_the_notebooks_loop_trains_as_one_process_on_the_whole_batch():
    reference, reference_losses = lab.single_process(2, 2)
    tolerance = 2 * lab.LR * (2 * lab.BATCH * lab.CONFIG["block_size"]) * 2**-24  # as the lab
    loop = notebook_loop()
    assert list(loop["WRAPPERS"]) == ["naive", "ours", "torch"]
    for kind in loop["WRAPPERS"]:
        (first, losses0), (second, losses1) = launch(loop["train"], 2, args=(kind, 2), timeout=120)
        assert lab.max_difference(first, second) == 0
        assert lab.max_difference(first, reference) <= tolerance
        for mine, theirs, one in zip(losses0, losses1, reference_losses, strict=True):
            assert (mine + theirs) / 2 == pytest.approx(one, abs=1e-5)


def test_step_timeline_records_every_bucket_in_order():
    per_rank = launch(lab.step_timeline, 2, kwargs={"bucket_cap_mb": 0.5}, timeout=120)
    for events in per_rank:
        order = [what for what, _ in events]
        assert order[0] == "forward" and order[-1] == "step"
        assert [t for _, t in events] == sorted(t for _, t in events)
        for b in range(7):
            start = order.index(f"all-reduce start bucket {b}")
            assert start < order.index(f"all-reduce finished bucket {b}")
    lanes = draw.step_lanes(per_rank)
    assert list(lanes) == [
        "rank 0 compute",
        "rank 0 all-reduce",
        "rank 1 compute",
        "rank 1 all-reduce",
    ]
    assert len(lanes["rank 0 all-reduce"]) == 7
    fig = draw.draw_lanes({"step": lanes})
    assert len(fig.axes[0].patches) >= 2 * 3  # every rank's forward, backward and step at least


def test_bytes_per_step_are_the_rings_on_every_bucket():
    for r in launch(lab.bytes_per_step, 3, kwargs={"bucket_cap_mb": 0.5}, timeout=120):
        assert r["buckets"] == 7
        assert r["counted"] == r["formula"]  # exact, uneven chunks included
        # 2(N-1)/N of the gradient, give or take one float32 per chunk sent (3 ranks
        # cut a bucket into chunks that differ by one element)
        assert abs(r["counted"] - 2 * 2 * r["gradient bytes"] / 3) <= 4 * 4 * r["buckets"]
        assert r["gradient bytes"] == 4 * 842_496  # the tied weight once


def test_overlap_schedule_by_hand():
    # backward 0.1 s after a forward of 0.05 s, two buckets of 100 and 300 bytes
    buckets, step = overlap_schedule([100, 300], 0.05, 0.1, a=0.01, b=1e-4)
    assert buckets[0] == pytest.approx((0.075, 0.075, 0.095))  # ready after a quarter
    assert buckets[1] == pytest.approx((0.15, 0.15, 0.19))
    assert step == pytest.approx(0.19)
    naive, later = overlap_schedule([100, 300], 0.05, 0.1, a=0.01, b=1e-4, overlap=False)
    assert naive[0][1] == pytest.approx(0.15) and later == pytest.approx(0.15 + 0.02 + 0.04)


def test_overlap_figure_models_gpt2_small():
    fig = draw.overlap_figure()
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles[0].startswith("naive: one all-reduce per parameter") and "42.0 ms" in titles[0]
    assert "25 MiB" in titles[1] and "1 MiB" in titles[2]


def test_bucket_sweep_times_every_cap_on_rank_zero_only():
    first, second = launch(lab.bucket_sweep, 2, args=([0.5, 4],), kwargs={"rounds": 1}, timeout=120)
    assert second is None
    assert set(first["ratio"]) == {"compute only", 0.5, 4}
    fig = draw.draw_bucket_sweep(
        [0.5, 4], [first[0.5], first[4]], [0.1, 0.1], first["compute only"]
    )
    assert len(fig.axes[0].lines) == 3


def test_the_profiler_trace_shows_all_reduces_launched_during_backward():
    trace = launch(tools.profile_torch_ddp, 2, kwargs={"bucket_cap_mb": 0.5}, timeout=120)[0]
    names = {e["name"] for e in trace["events"]}
    assert {"DistributedDataParallel.forward", "c10d::allreduce_"} <= names
    phases = [row["phase"] for row in tools.trace_summary(trace["events"])]
    assert phases[0] == "forward" and phases[-1] == "optimizer step"
    assert "all-reduce 0 launched" in phases and "backward" in phases


def test_trace_summary_of_made_up_events():
    events = [
        {"name": "DistributedDataParallel.forward", "main": True, "start": 0.0, "ms": 2.0},
        {"name": "autograd::engine::evaluate_function: A", "main": True, "start": 2.0, "ms": 1.0},
        {"name": "c10d::allreduce_", "main": True, "start": 2.5, "ms": 0.1},
        {"name": "gloo:all_reduce", "main": False, "start": 2.6, "ms": 1.0},
        {"name": "autograd::engine::evaluate_function: B", "main": True, "start": 3.0, "ms": 1.0},
        {
            "name": "torch.distributed.ddp.reducer::copy_bucket_to_grad",
            "main": True,
            "start": 4.0,
            "ms": 0.1,
        },
        {"name": "Optimizer.step#SGD.step", "main": True, "start": 4.2, "ms": 0.3},
    ]
    rows = {row["phase"]: row for row in tools.trace_summary(events)}
    assert rows["backward"]["events"] == 2 and rows["backward"]["end (ms)"] == 4.0
    assert rows["all-reduce 0 runs (comm thread)"]["start (ms)"] == 2.6


def test_sampler_epochs_are_distributed_samplers():
    per_rank = launch(tools.sampler_epochs, 3, args=(10,), timeout=60)
    for rank, epochs in enumerate(per_rank):
        for epoch, indices in enumerate(epochs):
            sampler = DistributedSampler(range(10), 3, rank, shuffle=True, seed=0)
            sampler.set_epoch(epoch)
            assert indices == list(sampler)


def test_summing_with_lr_over_n_is_averaging_for_sgd_and_hardly_matters_to_adam():
    cases = [
        ("sgd", "mean", 0.1),
        ("sgd", "sum", 0.05),
        ("adam", "mean", 1e-3),
        ("adam", "sum", 1e-3),
    ]
    runs = launch(tools.summing_runs, 2, args=(cases,), timeout=120)[0]
    mean, summed = runs[cases[0]]["params"], runs[cases[1]]["params"]
    assert torch.allclose(mean, summed, rtol=0, atol=1e-6)
    start = torch.nn.utils.parameters_to_vector(lab.make_gpt().parameters()).detach()
    adam_mean, adam_sum = runs[cases[2]], runs[cases[3]]
    moved = (adam_mean["params"] - start).norm()
    assert (adam_sum["params"] - adam_mean["params"]).norm() < 0.01 * moved
    # what clipping compares with its threshold: exactly N times larger
    assert adam_sum["norms"][0] == 2 * adam_mean["norms"][0]


# --------------------------------------------------------------------------- exercises


def forward_order(numels, cap_bytes):
    """torch's buckets, not reversed: the first layer's, whose gradients come last, first."""
    buckets, current, size = [], [], 0
    for i in range(len(numels)):
        current.append(i)
        size += 4 * numels[i]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def empty_first(numels, cap_bytes):
    """Closes the current bucket before adding, without checking that it holds anything."""
    buckets, current, size = [], [], 0
    for i in range(len(numels)):
        if size + 4 * numels[i] > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += 4 * numels[i]
    return (buckets + [current])[::-1]


def before_the_cap(numels, cap_bytes):
    """Never lets a bucket pass the cap (the course's rule before it followed torch)."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        if current and size + 4 * numels[i] > cap_bytes:
            buckets.append(current)
            current, size = [], 0
        current.append(i)
        size += 4 * numels[i]
    return buckets + [current]


def filled_from_the_end(numels, cap_bytes):
    """Torch's closing rule, but filled from the last parameter: the leftover bucket
    ends up last instead of first."""
    buckets, current, size = [], [], 0
    for i in reversed(range(len(numels))):
        current.append(i)
        size += 4 * numels[i]
        if size >= cap_bytes:
            buckets.append(current)
            current, size = [], 0
    return buckets + ([current] if current else [])


def test_check_buckets(capsys):
    mistakes = [
        (forward_order, "last layer's gradients first: reverse the buckets"),
        (empty_first, "a bucket is never empty"),
        (before_the_cap, "sizes \\[50, 300, 50\\].*reaches or passes the cap"),
        (filled_from_the_end, "sizes \\[50, 300, 50\\].*in registration order"),
        (lambda numels, cap: None, "should return a list of lists"),
    ]
    checks(capsys, tools.check_buckets, LAB, "my_buckets", "DDP's buckets", mistakes)


def sums(model):
    grads = [p.grad for p in model.parameters()]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat)
    start = 0
    for g in grads:
        g.copy_(flat[start : start + g.numel()].view_as(g))
        start += g.numel()


def forgets_to_copy_back(model):
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    dist.all_reduce(flat)
    flat /= dist.get_world_size()


def test_check_all_reduce_flat(capsys):
    mistakes = [
        (sums, "it is the sum"),
        (forgets_to_copy_back, "the gradient is not the average"),
    ]
    verified = "every gradient averaged over the ranks"
    checks(capsys, tools.check_all_reduce_flat, LAB, "all_reduce_flat", verified, mistakes)


def test_check_shard_indices(capsys):
    mistakes = [
        (lambda n, w, r: list(range(n))[r::w], "pads with the first ones"),
        (lambda n, w, r: list(range(r * -(-n // w), (r + 1) * -(-n // w))), "in turn"),
        (lambda n, w, r: None, "n=12, world_size=4, rank 0: got None"),
    ]
    verified = "DistributedSampler's indices"
    checks(capsys, tools.check_shard_indices, LAB, "shard_indices", verified, mistakes)
