"""Lab 11, pipeline parallelism: the course GPT run through every schedule on real ranks,
every action timed and the activations each rank holds counted, and the checkers of
the formula exercises (the schedules the learner writes are checked in
:mod:`labsupport.labs.lab11_exercises`).

The schedules and their simulator are in :mod:`labsupport.parallel.schedules`, the
executor in :mod:`labsupport.parallel.pipeline_parallel`, the model the lab runs in
:mod:`labsupport.labs.lab11_stages`, the drawings in :mod:`labsupport.viz.pipeline`.
"""

from __future__ import annotations

import math
import time

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise, number
from labsupport.labs.lab11_stages import (
    LAB_GPT,
    MICRO_BATCH,
    build,
    micro_batches,
    reference_gradients,
    warm_up,
)
from labsupport.launch.progress import progress
from labsupport.launch.runtime import device
from labsupport.measure.memory import SavedBytes
from labsupport.parallel import pipeline_parallel as pp
from labsupport.parallel import schedules
from labsupport.parallel.parallel_state import Mesh


def pipeline_steps(
    cases: list,
    forward_s: float = 0.0,
    backward_s: float = 0.0,
    gradients: bool = False,
    bar: bool = True,
) -> list[dict]:
    """One training step of the lab's GPT per ``(schedule, m, v)`` of ``cases``, one
    after another (run on every rank); returns this rank's result for each case.
    ``schedule`` names one of :func:`~labsupport.parallel.schedules.build`'s, or is a
    function ``(p, m, rank)`` that gives a rank's actions (a learner's, ``v = 1``).

    For each case, every rank builds the same GPT, keeps its stages
    (:func:`~labsupport.parallel.pipeline_parallel.stage_modules`) and runs its list of
    actions (:func:`~labsupport.parallel.schedules.build`) with the executor
    (:func:`~labsupport.parallel.pipeline_parallel.run`) over the mesh's groups. A result
    holds this rank's actions, each with its start and end on ``time.perf_counter`` (one
    clock for every process of a machine), the most micro-batches it held at once, the
    peak bytes its blocks kept (:class:`~labsupport.measure.memory.SavedBytes`), the
    losses (last rank) and, with ``gradients``, its gradients by the model's names.
    ``bar=False`` leaves out the progress bar (a checker's verdict stands alone).
    """
    p, rank = dist.get_world_size(), dist.get_rank()
    groups = Mesh(dp=1, tp=1, pp=p).process_groups()
    results = []
    for schedule, m, v in progress(cases, "cases") if bar else cases:
        named = isinstance(schedule, str)
        style = schedules.style(schedule) if named else "loop"
        model = build(forward_s, backward_s).to(device())
        chunks = pp.stage_modules(model, p, rank, v, style)
        actions = schedules.build(schedule, p, m, v)[rank] if named else schedule(p, m, rank)
        inputs, targets = micro_batches(m)
        shape = (MICRO_BATCH, LAB_GPT["block_size"], LAB_GPT["n_embd"])
        warm_up(model, shape)
        held = SavedBytes(exclude=model)
        held.watch(model.h)  # this rank runs its own stages' blocks only
        dist.barrier()
        clock = time.perf_counter()
        out = pp.run(chunks, actions, inputs, targets, shape, groups["pp"], groups.get("embedding"),
                     style=style)  # fmt: skip
        result = {
            "rank": rank,
            "case": (schedule if named else schedule.__name__, m, v),
            "events": [(a.kind, *a[1:], clock + s, clock + e) for a, s, e in out["events"]],
            "peak_microbatches": out["peak_microbatches"],
            "peak_bytes": held.peak,
            "losses": out["losses"],
        }
        if gradients:
            result["gradients"] = _stage_gradients(chunks, model)
        results.append(result)
    return results


def by_case(per_rank: list[list[dict]]) -> list[list[dict]]:
    """:func:`pipeline_steps`' results per rank and case, turned per case and rank."""
    return [list(case) for case in zip(*per_rank, strict=True)]


def gradients_match(results: list[dict], m: int) -> bool:
    """Whether the gradients the ranks hold (the tied output weight's copy on the last
    rank included) are one process's for the whole batch (:func:`reference_gradients`).

    float32: a pipeline adds each parameter's gradient over the micro-batches in the
    same order as one process, but takes each micro-batch's mean loss and divides by
    ``m`` separately, a few roundings of 2^-24 relative each: the tolerance, 1e-5
    relative (and 1e-6 absolute for gradients near zero), leaves a wide margin over
    them, and is far below what a wrong loss scaling changes (a factor of ``m``).
    """
    want = reference_gradients(m)
    seen = set()
    for r in results:
        for name, grad in r["gradients"].items():
            name = "wte.weight" if name == "lm_head.weight" else name  # the tied copy
            seen.add(name)
            if not torch.allclose(grad, want[name], rtol=1e-5, atol=1e-6):
                return False
    return seen == set(want) - {"lm_head.weight"}


def describe(actions: list) -> str:
    """A rank's actions in short: ``F3`` and ``B3`` compute micro-batch 3 (``F3.1``:
    its chunk 1), ``I3`` and ``W3`` the two halves of a split backward (torch's letters),
    ``>a3``/``<a3`` send/receive its activation, ``>g3``/``<g3`` its gradient; messages
    posted together are bracketed."""
    short = {"send_act": ">a", "recv_act": "<a", "send_grad": ">g", "recv_grad": "<g",
             "backward_input": "I", "backward_weight": "W"}  # fmt: skip
    words = []
    for batch in schedules.batches(actions):
        names = []
        for a in batch:
            tag = short.get(a.kind, a.kind[0].upper())
            names.append(f"{tag}{a.microbatch}" + (f".{a.chunk}" if a.chunk else ""))
        words.append(names[0] if len(names) == 1 else "[" + " ".join(names) + "]")
    return " ".join(words)


def _stage_gradients(chunks: dict, model) -> dict:
    """This rank's gradients by the model's names (the tied copy: ``lm_head.weight``)."""
    names = {id(q): n for n, q in model.named_parameters()}
    params = [(n, q) for stage in chunks.values() for n, q in stage.named_parameters()]
    return {names.get(id(q), n): q.grad.cpu().clone() for n, q in params if q.grad is not None}


# --------------------------------------------------------------------------- timelines


COMPUTE = ("forward", "backward", "backward_input", "backward_weight")  # what computes


def compute_events(results: list[dict]) -> list[list[tuple]]:
    """Each rank's computing actions as ``(kind, micro-batch, chunk, start, end)``, in
    seconds from the first one's start on any rank."""
    first = min(e[3] for r in results for e in r["events"] if e[0] in COMPUTE)
    return [
        [(k, mb, c, s - first, e - first) for k, mb, c, s, e in r["events"] if k in COMPUTE]
        for r in results
    ]


def measured_bubble(results: list[dict]) -> float:
    """The idle share of the step, measured: 1 - (time computing, summed over the
    ranks) / (ranks x the step's span), as :func:`~labsupport.parallel.simulator.
    measured_bubble` counts it on the simulated slots. Time in messages counts as idle."""
    timeline = compute_events(results)
    span = max(e for rank in timeline for *_, e in rank)
    busy = sum(e - s for rank in timeline for *_, s, e in rank)
    return 1 - busy / (len(timeline) * span)


def step_seconds(results: list[dict]) -> float:
    """From the first forward on any rank to the last backward on any rank."""
    return max(e for rank in compute_events(results) for *_, e in rank)


def median_durations(results: list[dict]) -> dict:
    """The median seconds of each kind of computing action, over every rank."""
    timeline = compute_events(results)
    out = {}
    for kind in COMPUTE:
        times = sorted(e - s for rank in timeline for k, *_, s, e in rank if k == kind)
        if times:
            out[kind] = times[len(times) // 2]
    return out


def step_time_model(p: int, m: int, forward: float, backward: float, message: float, v=1):
    """Predicted seconds of one step. ``forward`` and ``backward`` are one action's time
    (one chunk of ``1/v`` stage), ``message`` one message's, ``alpha + beta * n``.

    Each rank computes ``m v`` forwards and backwards, and waits ``p - 1`` slots of a
    forward and a backward in the bubble: ``(m v + p - 1)(t_f + t_b)``. On top come the
    messages that nothing overlaps: the first activation goes down through the
    ``p v`` stages and the last gradient back up, ``2 (p v - 1)`` messages.
    """
    return (m * v + p - 1) * (forward + backward) + 2 * (p * v - 1) * message


# --------------------------------------------------------------------------- exercises


@exercise
def check_bubble(fn) -> str:
    """Exercise 1: ``fn(p, m, v)`` must give the idle share of the total time."""
    for p, m, v in [(4, 8, 1), (8, 32, 1), (2, 1, 1), (4, 8, 2), (8, 64, 4), (1, 4, 1)]:
        got = number(fn(p, m, v), "a fraction between 0 and 1")
        want = schedules.bubble_fraction(p, m, v)["of_total"]
        if math.isclose(got, want, rel_tol=1e-12, abs_tol=1e-15):
            continue
        where = f"p={p}, m={m}, v={v}: got {got:.6g}, "
        if math.isclose(got, schedules.bubble_fraction(p, m, v)["of_ideal"], rel_tol=1e-12):
            hint = "the idle time over the ideal (busy) time; divide by the total time instead"
        elif v > 1 and math.isclose(got, schedules.bubble_fraction(p, m)["of_total"]):
            hint = "as without chunks: with v chunks per rank, a slot of the bubble lasts 1/v"
        else:
            side = "more" if got > want else "less"
            hint = f"{side} idle time than the pipeline has: count the slots idle on one rank"
        raise AssertionError(where + hint)
    return "the bubble over the total time, with and without chunks, on 1 to 8 stages"


@exercise
def check_fewest_microbatches(fn) -> str:
    """Exercise 2: ``fn(p, target, v)``, the fewest micro-batches whose bubble (over the
    total) is at most ``target``, a multiple of ``p`` when ``v > 1``."""
    for p, target, v in [(4, 0.2, 1), (8, 0.1, 1), (64, 0.1, 1), (4, 0.2, 2), (8, 0.05, 4)]:
        got = fn(p, target, v)
        want = _fewest(p, target, v)
        if got == want:
            continue
        where = f"p={p}, target={target}, v={v}: got {got!r}, "
        if got == _fewest(p, target, v, over="of_ideal"):
            hint = "that meets the target over the ideal time; the target is over the total"
        elif not isinstance(got, int):
            hint = "it should be a whole number of micro-batches"
        elif schedules.bubble_fraction(p, got, v)["of_total"] > target:
            hint = "its bubble is above the target"
        elif v > 1 and got % p:
            hint = "the interleaved schedule needs a multiple of p micro-batches"
        else:
            hint = "fewer micro-batches already meet the target"
        raise AssertionError(where + hint)
    return "the fewest micro-batches for a bubble target, with and without chunks"


def _fewest(p: int, target: float, v: int, over: str = "of_total") -> int:
    step = p if v > 1 else 1
    m = step
    while schedules.bubble_fraction(p, m, v)[over] > target:
        m += step
    return m
