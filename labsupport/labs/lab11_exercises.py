"""Lab 11's schedule exercises: GPipe, then 1F1B, written by the learner as data (each
rank's ordered list of :class:`~labsupport.parallel.schedules.Action`).

:func:`check_gpipe_schedule` plays the learner's GPipe in the simulator.
:func:`check_1f1b_schedule` goes further, on real ranks: the simulator plays the lists
on 1 to 8 stages (no deadlock, 1F1B's bubble, at most ``p - rank`` micro-batches held),
then the course's executor (:func:`labsupport.parallel.pipeline_parallel.run`) runs them
on 2 and 4 ranks, ``m`` not a multiple of ``p`` and ``m < p`` too, and the gradients
must be one process's and those of ``torch.distributed.pipelining``'s ``Schedule1F1B``.
The learner's function only ever runs on the ranks, under a timeout: one that never
returns is reported as such rather than hanging the notebook.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from labsupport.labs.cells import exercise, expect_close, launch_answer
from labsupport.labs.lab11_pipeline import pipeline_steps
from labsupport.labs.lab11_stages import reference_gradients
from labsupport.labs.lab11_zero_bubble import TORCH_SCHEDULES, torch_pipelining_step
from labsupport.parallel import schedules, simulator


@exercise
def check_gpipe_schedule(fn) -> str:
    """Exercise 3: ``fn(p, m, rank)``, GPipe's list of actions for one rank, must run
    (no deadlock in :func:`~labsupport.parallel.simulator.simulate`), receive before it
    computes and send what it computed, and hold ``m`` micro-batches at its peak."""
    for p, m in [(4, 8), (2, 3), (3, 1), (1, 2)]:
        lists = [fn(p, m, rank) for rank in range(p)]
        for rank, acts in enumerate(lists):
            _check_actions(acts, p, m, rank)
        try:
            timeline = simulator.simulate(lists)
        except RuntimeError as exc:
            raise AssertionError(f"p={p}, m={m}: {exc}") from None
        held = [_peak_held(acts) for acts in lists]
        if held != [m] * p:
            raise AssertionError(
                f"p={p}, m={m}: ranks hold {held} micro-batches at their peak; GPipe runs "
                "every forward before the first backward, so each holds all m"
            )
        bubble = simulator.measured_bubble(timeline)
        if not math.isclose(bubble, schedules.bubble_fraction(p, m)["of_total"]):
            raise AssertionError(f"p={p}, m={m}: a bubble of {bubble:.3f}, not GPipe's")
    return "GPipe as data: it runs on 1 to 4 stages, holds m micro-batches, has the bubble"


#: What must come before each action, for the same micro-batch.
NEEDS = dict(forward="recv_act", send_act="forward", backward="recv_grad", send_grad="backward")


def _check_actions(acts, p: int, m: int, rank: int) -> None:
    if not isinstance(acts, list) or not all(isinstance(a, schedules.Action) for a in acts):
        raise AssertionError(f"rank {rank}: return a list of schedules.Action")
    done: set = set()
    for a in acts:
        if a.kind in ("recv_act", "send_grad") and rank == 0:
            raise AssertionError("rank 0 is the first stage: no stage comes before it")
        if a.kind in ("send_act", "recv_grad") and rank == p - 1:
            raise AssertionError(f"rank {p - 1} is the last stage: no stage comes after it")
        if a.kind == "backward" and ("forward", a.microbatch) not in done:
            raise AssertionError(
                f"rank {rank}: backward {a.microbatch} before forward {a.microbatch}: a "
                "backward needs the activations its forward kept"
            )
        edge = (a.kind == "forward" and rank == 0) or (a.kind == "backward" and rank == p - 1)
        need = NEEDS.get(a.kind)
        if need and not edge and (need, a.microbatch) not in done:
            raise AssertionError(
                f"rank {rank}: {a.kind} {a.microbatch} before {need} {a.microbatch}"
            )
        done.add((a.kind, a.microbatch))
    computed = sorted((a.kind, a.microbatch) for a in acts if a.kind in ("forward", "backward"))
    if computed != sorted((k, mb) for k in ("forward", "backward") for mb in range(m)):
        raise AssertionError(f"rank {rank}: each micro-batch needs one forward and one backward")


def _peak_held(acts) -> int:
    """The most micro-batches a rank holds at once: from each forward to its backward
    (or to its W, when the backward is split)."""
    held = peak = 0
    for a in acts:
        held += {"forward": 1, "backward": -1, "backward_weight": -1}.get(a.kind, 0)
        peak = max(peak, held)
    return peak


# --------------------------------------------------------------------------- 1F1B, ZB-H1

#: (p, m) the simulator plays; the executor runs the first two on 4 ranks (m not a
#: multiple of p, m < p), the third on 2; torch's schedule the first.
SIMULATED = [(4, 6), (4, 3), (2, 3), (4, 8), (2, 5), (3, 1), (8, 5), (1, 2)]
RUN = {4: (6, 3), 2: (3,)}
TORCH_M = 6
LETTER = {"forward": "F", "backward": "B", "backward_input": "I", "backward_weight": "W"}


def warm_up(acts) -> int:
    """The forwards a rank's list runs before its first backward (or B)."""
    kinds = [a.kind for a in acts if a.kind in ("forward", "backward", "backward_input")]
    return next((i for i, k in enumerate(kinds) if k != "forward"), len(kinds))


def _deadlock(exc, p: int, m: int, name: str, counts: str, orders=None) -> str:
    """The simulator's deadlock, each stage's place an index of the learner's list (of
    ``orders``, its computations, for ZB-H1, whose messages the checker adds)."""
    waits = "; ".join(
        f"stage {r} stops at {name}({p}, {m}, {r})[{orders[r].index(a) if orders else i}]"
        f", {LETTER[a.kind]}{a.microbatch} at time slot {slot}, waiting for the "
        f"{'activation' if a.kind == 'forward' else 'gradient'} of micro-batch {a.microbatch} "
        f"from stage {r - 1 if a.kind == 'forward' else r + 1}"
        for r, i, a, slot in exc.stuck
    )
    return (
        f"p={p}, m={m}: the stages deadlock: {waits}. A stage's first backward waits for the "
        f"next stage's, which comes after that stage's own warm-up forwards ({counts})"
    )


def one_f_one_b_problem(lists: list, p: int, m: int, name: str = "fn") -> str | None:
    """What is wrong with ``lists`` (every rank's, from the learner's function ``name``)
    as 1F1B for ``p`` stages and ``m`` micro-batches, or ``None``: the actions, then the
    simulator, the bubble, the peak."""
    try:
        for rank, acts in enumerate(lists):
            _check_actions(acts, p, m, rank)
    except AssertionError as exc:
        return f"p={p}, m={m}: {exc}"
    counts = f"forwards before the first backward, stage by stage: {[warm_up(a) for a in lists]}"
    try:
        timeline = simulator.simulate(lists)
    except simulator.Deadlock as exc:
        return _deadlock(exc, p, m, name, counts)
    except RuntimeError as exc:
        return f"p={p}, m={m}: {exc}"
    bubble, want = simulator.measured_bubble(timeline), schedules.bubble_fraction(p, m)
    if not math.isclose(bubble, want["of_total"]):
        return (
            f"p={p}, m={m}: it runs, but the stages idle {bubble:.3f} of the step in the "
            f"simulator, where 1F1B idles (p-1)/(m+p-1) = {want['of_total']:.3f}: some stage "
            f"waits for a gradient while it could run a forward ({counts})"
        )
    held, most = [_peak_held(acts) for acts in lists], [min(p - r, m) for r in range(p)]
    if held != most:
        gpipe = " (GPipe's order: every forward before the first backward)" * (held == [m] * p)
        return (
            f"p={p}, m={m}: the bubble is 1F1B's, but the stages hold {held} micro-batches' "
            f"activations at their peak{gpipe}; 1F1B holds at most p - rank: {most}"
        )
    return None


def _split_order_problem(order, m: int) -> str | None:
    """What is wrong with one rank's order of F, B (``backward_input``) and W."""
    if not isinstance(order, list) or not all(isinstance(a, schedules.Action) for a in order):
        return "return a list of schedules.Action"
    done: set = set()
    for a in order:
        if a.kind == "backward":
            return f"backward {a.microbatch} is whole: split it into backward_input and W"
        if a.kind not in LETTER:
            return f"{a.kind}: the computations only (the checker adds the messages)"
        need = {"backward_input": "forward", "backward_weight": "backward_input"}.get(a.kind)
        if need and (need, a.microbatch) not in done:
            return f"{a.kind} {a.microbatch} before {need} {a.microbatch}"
        done.add((a.kind, a.microbatch))
    if sorted((a.kind, a.microbatch) for a in order) != sorted(
        (k, mb) for k in ("forward", "backward_input", "backward_weight") for mb in range(m)
    ):
        return "each micro-batch needs one forward, one backward_input and one backward_weight"
    return None


def zb_h1_problem(orders: list, p: int, m: int, name: str = "fn") -> str | None:
    """What is wrong with ``orders`` (every rank's computations) as ZB-H1, or ``None``:
    the orders, then the simulator (F, B and W a slot each), the peak, the bubble, against
    the library's :func:`~labsupport.parallel.zero_bubble.zb_h1`."""
    for rank, order in enumerate(orders):
        problem = _split_order_problem(order, m)
        if problem:
            return f"p={p}, m={m}, rank {rank}: {problem}"
    lists = [schedules.with_messages(orders, r) for r in range(p)]
    counts = f"forwards before the first B, stage by stage: {[warm_up(a) for a in orders]}"
    try:
        timeline = simulator.simulate(lists, durations=simulator.SPLIT)
    except simulator.Deadlock as exc:
        return _deadlock(exc, p, m, name, counts, orders)
    held, most = [_peak_held(order) for order in orders], [min(p, m)] * p
    if any(h > w for h, w in zip(held, most, strict=True)):
        return (
            f"p={p}, m={m}: the stages hold {held} micro-batches' activations at their peak "
            f"(each until its W); ZB-H1 holds at most {most}: a W held back keeps its "
            "micro-batch's activations"
        )
    library = simulator.simulate(schedules.build("zb-h1", p, m), durations=simulator.SPLIT)
    bubble = simulator.measured_bubble(timeline, simulator.SPLIT)
    want = simulator.measured_bubble(library, simulator.SPLIT)
    if bubble > want + 1e-9:
        pairs = all(o[o.index(a) + 1].kind == "backward_weight" for o in orders for a in o
                    if a.kind == "backward_input")  # fmt: skip
        return (
            f"p={p}, m={m}: it runs, but the stages idle {bubble:.3f} of the step in the "
            f"simulator (F, B and W a slot each), where ZB-H1 idles {want:.3f}"
            + (": every W right after its B is 1F1B's bubble" if pairs else "")
            + ". Where does a stage wait, and which of its computations needs no message?"
        )
    return None


#: Per exercise: the problem finder, this rank's list with its messages, the most
#: micro-batches each rank holds.
KINDS = {
    "1f1b": (one_f_one_b_problem, lambda lists, r: lists[r], lambda p, m, r: min(p - r, m)),
    "zb-h1": (zb_h1_problem, schedules.with_messages, lambda p, m, r: min(p, m)),
}


def schedule_case(fn, kind: str) -> dict:
    """On every rank: the learner's ``fn(p, m, rank)`` for every rank of each of
    :data:`SIMULATED`, played by the simulator; if they pass, the executor runs this
    rank's lists on this launch's ranks (:data:`RUN`), gradients kept, and on 4 ranks
    torch's schedule (``Schedule1F1B``, ``ScheduleInterleavedZeroBubble``) the same step."""
    world, (problem_of, lists_of, _) = dist.get_world_size(), KINDS[kind]
    made = {(p, m): [fn(p, m, r) for r in range(p)] for p, m in SIMULATED}
    for (p, m), each in made.items():
        problem = problem_of(each, p, m, getattr(fn, "__name__", "fn"))
        if problem:
            return {"problem": problem}

    def yours(p, m, rank):  # noqa: E306 - the lists already made
        return lists_of(made[p, m], rank)

    ours = pipeline_steps([(yours, m, 1) for m in RUN[world]], gradients=True, bar=False)
    theirs = torch_pipelining_step(kind, TORCH_M) if world == 4 else None
    return {"problem": None, "ours": ours, "torch": theirs}


def _same_gradients(case: list[dict], want: dict, where: str, against: str) -> None:
    """Every rank's gradients in ``case`` against ``want`` (by the model's names), or each
    rank's own in ``want[rank]``: a verdict that names the rank and the parameter."""
    for r in case:
        mine = want[r["rank"]] if isinstance(want, list) else want
        for name, grad in r["gradients"].items():
            tied = "wte.weight" if name == "lm_head.weight" and name not in mine else name
            what = f"the gradient of {name} ({where})"
            expect_close(grad, mine[tied], what, r["rank"], against, rtol=1e-5, atol=1e-6)


def _check_schedule(fn, kind: str, timeout: float) -> None:
    """Run :func:`schedule_case` on 4 and 2 ranks: its problem, or the executor's runs
    against one process and torch."""
    hint = (
        f"Did {getattr(fn, '__name__', 'your function')} return, for every stage and every "
        "m (m not a multiple of p, m < p)? A loop that never ends keeps every rank waiting."
    )
    for world, ms in RUN.items():
        results = launch_answer(schedule_case, world, hint, timeout, args=(fn, kind))
        if results[0]["problem"]:
            raise AssertionError(results[0]["problem"])
        for m, case in zip(ms, zip(*(r["ours"] for r in results), strict=True), strict=True):
            held = [r["peak_microbatches"] for r in case]
            if held != [KINDS[kind][2](world, m, r) for r in range(world)]:
                raise AssertionError(f"run on {world} ranks with m={m}, the ranks held {held}")
            where = f"p={world}, m={m}"
            _same_gradients(case, reference_gradients(m), where, "against one process")
            if world == 4 and m == TORCH_M:
                torch = [r["torch"]["gradients"] for r in results]
                _same_gradients(case, torch, where, f"against torch's {TORCH_SCHEDULES[kind]}")


@exercise
def check_1f1b_schedule(fn, timeout: float = 240) -> str:
    """Exercise 4: ``fn(p, m, rank)``, 1F1B's list of actions for one rank: played by the
    simulator on 1 to 8 stages, then run by the executor on 4 and 2 real ranks."""
    _check_schedule(fn, "1f1b", timeout)
    return (
        "1F1B as data: the simulator plays it on 1 to 8 stages without deadlock, with the "
        "bubble (p-1)/(m+p-1) and at most p - rank micro-batches held; run on 4 and 2 ranks "
        "(m = 6, 3 and 3) it gives one process's gradients, and torch's Schedule1F1B's"
    )


@exercise
def check_zb_h1_schedule(fn, timeout: float = 240) -> str:
    """Exercise 5: ``fn(p, m, rank)``, ZB-H1's computations for one rank (F, B and W), the
    messages placed by :func:`~labsupport.parallel.schedules.with_messages`."""
    _check_schedule(fn, "zb-h1", timeout)
    return (
        "ZB-H1 as data: the simulator plays it on 1 to 8 stages without deadlock, with "
        "ZB-H1's bubble and at most p micro-batches held; run on 4 and 2 ranks it gives one "
        "process's gradients, and torch's ScheduleInterleavedZeroBubble's"
    )
