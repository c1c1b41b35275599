"""Lab 10, the tools around a DDP run: a ``torch.profiler`` trace of one step read back,
``DistributedSampler`` on real ranks, averaging against summing, and the checkers of
exercises 1 to 3. The lab's model, data and timeline are in
:mod:`labsupport.labs.lab10_data_parallel`; exercise 4's checker is in
:mod:`labsupport.labs.lab10_exercises`.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile

import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DistributedSampler

from labsupport.labs.cells import exercise
from labsupport.labs.lab10_data_parallel import BATCH, LR, global_batch, make_gpt, my_share
from labsupport.launch.launcher import launch
from labsupport.launch.runtime import device
from labsupport.parallel.data_parallel import all_reduce_gradients, make_buckets

#: Where the ranks write their traces (one JSON file per rank; open one in Perfetto).
TRACE_DIR = os.path.join(tempfile.gettempdir(), "labsupport-lab10")


@contextlib.contextmanager
def _quiet_stderr():
    """The profiler's C++ side logs a line when it starts and stops; keep it out."""
    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(null)


def profile_torch_ddp(bucket_cap_mb: float = 0.25) -> dict | None:
    """On every rank: one warm-up step of ``torch.nn.parallel.DistributedDataParallel``,
    then one step under ``torch.profiler``, exported as a Chrome trace in
    :data:`TRACE_DIR`. Rank 0 returns the trace's file name and its events (name,
    thread, start and duration in ms from the step's start); ``None`` elsewhere."""
    from torch.profiler import ProfilerActivity, profile

    rank, world = dist.get_rank(), dist.get_world_size()
    model = make_gpt().to(device())
    ddp = nn.parallel.DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    idx, targets = (
        t[rank * BATCH : (rank + 1) * BATCH].to(device()) for t in global_batch(0, world)
    )
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if idx.is_cuda else [])
    profiler = profile(activities=activities)
    for step in range(2):
        if step:
            with _quiet_stderr():
                profiler.start()
        optimizer.zero_grad()
        ddp(idx, targets)[1].backward()
        optimizer.step()
    with _quiet_stderr():
        profiler.stop()
    os.makedirs(TRACE_DIR, exist_ok=True)
    path = os.path.join(TRACE_DIR, f"ddp-step-rank{rank}.json")
    profiler.export_chrome_trace(path)
    if rank:
        return None
    with open(path) as f:  # operators ("X" events) of the process's threads
        spans = [
            e
            for e in json.load(f)["traceEvents"]
            if e.get("ph") == "X" and isinstance(e["tid"], int)
        ]
    start = min(e["ts"] for e in spans)
    main = next(e["tid"] for e in spans if e["name"] == "DistributedDataParallel.forward")
    events = [
        {
            "name": e["name"],
            "main": e["tid"] == main,
            "start": (e["ts"] - start) / 1e3,
            "ms": e["dur"] / 1e3,
        }
        for e in sorted(spans, key=lambda e: e["ts"])
    ]
    return {"path": path, "events": events}


def trace_summary(events: list[dict]) -> list[dict]:
    """The step's phases from a trace's events: forward, the backward's autograd ops,
    each bucket's all-reduce as launched on the main thread (``c10d::allreduce_``) and
    as run by gloo's threads (``gloo:all_reduce``), the wait that copies the averages
    into ``.grad``, and the optimizer step."""

    def span(label, chosen):
        chosen = list(chosen)
        start = min(e["start"] for e in chosen)
        end = max(e["start"] + e["ms"] for e in chosen)
        return {"phase": label, "events": len(chosen), "start (ms)": start, "end (ms)": end}

    rows = [span("forward", (e for e in events if e["name"] == "DistributedDataParallel.forward"))]
    rows.append(span("backward", (e for e in events if e["name"].startswith("autograd::engine"))))
    launched = [e for e in events if e["name"] == "c10d::allreduce_"]
    ran = [
        e
        for e in events
        if e["name"].startswith("gloo:all_reduce") or "nccl:all_reduce" in e["name"]
    ]
    rows += [span(f"all-reduce {i} launched", [e]) for i, e in enumerate(launched)]
    rows += [span(f"all-reduce {i} runs (comm thread)", [e]) for i, e in enumerate(ran)]
    rows.append(
        span("copy averages to .grad", (e for e in events if "copy_bucket_to_grad" in e["name"]))
    )
    rows.append(
        span("optimizer step", (e for e in events if e["name"].startswith("Optimizer.step")))
    )
    return sorted(rows, key=lambda r: r["start (ms)"])


# --------------------------------------------------------------------------- sampler


def sampler_epochs(n: int, epochs: int = 2, set_epoch: bool = True, shuffle: bool = True) -> list:
    """On every rank: the indices ``DistributedSampler`` gives this rank in each epoch,
    for a data set of ``n`` items (rank and world size come from the process group)."""
    sampler = DistributedSampler(range(n), shuffle=shuffle, seed=0)
    out = []
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        out.append(list(sampler))
    return out


# --------------------------------------------------------------------------- sum vs mean


def average_or_sum(op: str, lr: float, steps: int = 2, optimizer: str = "sgd") -> dict:
    """On every rank: ``steps`` of SGD (or Adam, ``optimizer="adam"``) on the lab's GPT
    with the gradients all-reduced and averaged (``op="mean"``) or only summed
    (``op="sum"``). Returns the parameters after, and each step's gradient norm (what
    ``clip_grad_norm_`` would compare with its threshold)."""
    model = make_gpt().to(device())
    kind = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
    optimizer, norms = kind(model.parameters(), lr=lr), []
    for step in range(steps):
        optimizer.zero_grad()
        model(*my_share(step))[1].backward()
        if op == "mean":
            all_reduce_gradients(model)
        else:
            for p in model.parameters():
                dist.all_reduce(p.grad)
        norms.append(nn.utils.get_total_norm([p.grad for p in model.parameters()]).item())
        optimizer.step()
    return {
        "params": nn.utils.parameters_to_vector(model.parameters()).detach().cpu(),
        "norms": norms,
    }


def summing_runs(cases: list) -> dict:
    """On every rank: :func:`average_or_sum` for each ``(optimizer, op, lr)`` of
    ``cases``, in one launch; ``{case: result}``."""
    return {(opt, op, lr): average_or_sum(op, lr, 2, opt) for opt, op, lr in cases}


# --------------------------------------------------------------------------- exercises


@exercise
def check_buckets(fn) -> str:
    """Exercise 1: ``fn(numels, cap_bytes)`` must group float32 parameters of the given
    sizes (in registration order) into buckets as DDP does (torch's rule): a list of
    buckets, each a list of parameter indices, in the order their all-reduces start."""
    cases = [
        ([5], 4),
        ([10, 20, 30], 400),
        ([100, 1, 100, 1], 404),
        ([50, 300, 50], 400),
        ([8] * 6, 64),
    ]
    for numels, cap in cases:
        params = [nn.Parameter(torch.zeros(n)) for n in numels]
        index = {id(p): i for i, p in enumerate(params)}
        want = [sorted(index[id(p)] for p in b.params) for b in make_buckets(params, cap)]
        got = fn(list(numels), cap)
        if not (isinstance(got, list) and all(isinstance(b, list) for b in got)):
            raise AssertionError(
                f"your function returned {got!r}: it should return a list of lists"
            )
        if [sorted(b) for b in got] == want:
            continue
        where = f"sizes {numels} (float32), cap {cap} bytes: got {got}, want {want}"
        if any(not b for b in got):
            where += "; a bucket is never empty"
        elif [sorted(b) for b in got] == want[::-1]:
            where += "; backward produces the last layer's gradients first: reverse the buckets"
        else:
            where += (
                "; fill the buckets in registration order, each until it reaches or passes "
                "the cap (it may pass it), then reverse the list"
            )
        raise AssertionError(where)
    return "DDP's buckets: filled in registration order up to or past the cap, then reversed"


def _flat_trial(fn, seed: int = 0):
    rank = dist.get_rank()
    models = []
    for average in (fn, all_reduce_gradients):
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 3)).to(device())
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(rank)).to(device())
        model(x).pow(2).mean().backward()
        average(model)
        models.append([p.grad.detach().cpu() for p in model.parameters()])
    return models


@exercise
def check_all_reduce_flat(fn, world_sizes=(2, 3)) -> str:
    """Exercise 2: ``fn(model)``, run on every rank after backward, must leave every
    gradient averaged over the ranks, as ``all_reduce_gradients`` does."""
    for world in world_sizes:
        for rank, (got, want) in enumerate(launch(_flat_trial, world, args=(fn,), timeout=60)):
            for i, (g, w) in enumerate(zip(got, want, strict=True)):
                # float32: the same sums of `world` terms, maybe in another order
                if torch.allclose(g, w, rtol=1e-6 * world, atol=1e-7):
                    continue
                where = (
                    f"{world} ranks, rank {rank}, parameter {i}: the gradient is not the average"
                )
                if torch.allclose(g, w * world, rtol=1e-5, atol=1e-6):
                    where += "; it is the sum: divide by the number of ranks"
                elif not torch.allclose(g, w, rtol=0.5):
                    where += "; did the averages get back into each parameter's .grad?"
                raise AssertionError(where)
    return f"every gradient averaged over the ranks, on {' and '.join(map(str, world_sizes))} ranks"


@exercise
def check_shard_indices(fn) -> str:
    """Exercise 3: ``fn(n, world_size, rank)`` must give the indices that
    ``DistributedSampler(shuffle=False)`` gives rank ``rank`` of ``world_size``."""
    for n, world in [(12, 4), (10, 4), (7, 3), (3, 4), (100, 8)]:
        for rank in range(world):
            want = list(DistributedSampler(range(n), world, rank, shuffle=False))
            got = fn(n, world, rank)
            if list(got or []) == want:
                continue
            where = f"n={n}, world_size={world}, rank {rank}: got {got}, want {want}"
            if got and len(got) < len(want):
                where += "; every rank gets as many indices: the sampler pads with the first ones"
            elif got and sorted(got) == list(range(rank * len(want), (rank + 1) * len(want))):
                where += "; the sampler deals the indices out in turn (rank, rank + N, ...)"
            raise AssertionError(where)
    return "DistributedSampler's indices, padded and dealt out, for 5 data sets on 3 to 8 ranks"
