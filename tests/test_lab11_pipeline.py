"""Lab 11, pipeline parallelism: the lab's steps on real ranks (gradients, the activations
each rank holds, timelines), its measurements and model, and the exercises' checkers.
(The schedules and the executor are tested in tests/test_parallel_pipeline.py.)"""

from __future__ import annotations

import math

import pytest
import torch
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.labs import lab11_exercises as exercises
from labsupport.labs import lab11_pipeline as lab
from labsupport.labs import lab11_stages as stages
from labsupport.parallel import schedules

LAB = "11-pipeline-parallel.ipynb"
CASES = [("gpipe", 5, 1), ("1f1b", 6, 1), ("1f1b", 3, 1), ("interleaved", 4, 2)]


@pytest.fixture(scope="module")
def steps():
    per_rank = launch(lab.pipeline_steps, 4, args=(CASES,), kwargs={"gradients": True})
    return lab.by_case(per_rank)


def test_every_case_gives_the_gradients_of_one_process(steps):
    for (_, m, _), results in zip(CASES, steps, strict=True):
        assert lab.gradients_match(results, m)
        assert sorted(results[3]["losses"]) == list(range(m))


def test_a_wrong_gradient_is_caught(steps):
    results = [dict(r, gradients=dict(r["gradients"])) for r in steps[0]]
    name = next(iter(results[1]["gradients"]))
    results[1]["gradients"][name] = results[1]["gradients"][name] * 5  # loss not divided by m
    assert not lab.gradients_match(results, 5)


def test_activations_held_are_what_the_schedules_say(steps):
    per_block = stages.activation_bytes_per_block()
    for (name, m, v), results in zip(CASES, steps, strict=True):
        for r in results:
            rank = r["rank"]
            want = {
                "gpipe": m,
                "1f1b": min(4 - rank, m),
                "interleaved": min(2 * (3 - rank) + (v - 1) * 4 + 1, m * v),
            }[name]
            assert r["peak_microbatches"] == want, (name, rank)
            assert r["peak_bytes"] == want * per_block * (8 // (4 * v)), (name, rank)


def test_each_rank_ran_its_schedule_in_order(steps):
    for (name, m, v), results in zip(CASES, steps, strict=True):
        for r in results:
            want = [
                tuple(b[0]) for b in schedules.batches(schedules.build(name, 4, m, v)[r["rank"]])
            ]
            assert [e[:3] for e in r["events"]] == want
            assert all(start <= end for *_, start, end in r["events"])


def test_the_waiting_gpt_waits_in_both_passes():
    fast, slow = stages.build(), stages.build(forward_s=0.02, backward_s=0.04)
    x = torch.zeros(2, 16, 32, requires_grad=True)
    assert torch.equal(fast.h[0](x), slow.h[0](x))
    import time

    start = time.perf_counter()
    y = slow.h[0](x)
    middle = time.perf_counter()
    y.sum().backward()
    assert middle - start >= 0.02 and time.perf_counter() - middle >= 0.04


def fake(events_per_rank):
    return [{"events": [(k, 0, 0, s, e) for k, s, e in events]} for events in events_per_rank]


def test_measured_bubble_and_step_from_timestamps():
    # 2 ranks: rank 0 works [0, 1] and [2, 3], rank 1 works [1, 2]: span 3, busy 3 of 6
    results = fake(
        [
            [("forward", 10, 11), ("send_act", 11, 11), ("backward", 12, 13)],
            [("forward", 11, 12), ("backward", 12, 12)],
        ]
    )
    assert lab.measured_bubble(results) == pytest.approx(0.5)
    assert lab.step_seconds(results) == pytest.approx(3)
    assert lab.median_durations(results) == {"forward": 1, "backward": 1}


def test_the_step_time_model():
    # v = 1: (m + p - 1)(t_f + t_b) + 2(p - 1) messages
    assert lab.step_time_model(4, 8, 1.0, 2.0, 0.5) == pytest.approx(11 * 3 + 6 * 0.5)
    # v = 2: chunk times, (m v + p - 1) slots, 2(p v - 1) messages
    assert lab.step_time_model(4, 8, 0.5, 1.0, 0.5, v=2) == pytest.approx(19 * 1.5 + 14 * 0.5)


def test_describe_is_short():
    assert lab.describe(schedules.one_f_one_b(2, 2, 1)) == "<a0 F0 B0 [>g0 <a1] F1 B1 >g1"
    assert "F1.1" in lab.describe(schedules.interleaved_1f1b(2, 2, 0, 2))


# --------------------------------------------------------------------------- exercises


def test_check_bubble(capsys):
    mistakes = [
        (lambda p, m, v: (p - 1) / (v * m), "over the ideal"),
        (lambda p, m, v: (p - 1) / (m + p - 1), "as without chunks"),
        (lambda p, m, v: p / (v * m + p), "more idle time"),
        (lambda p, m, v: "a lot", "should return a fraction"),
    ]
    verified = "the bubble over the total time"
    checks(capsys, lab.check_bubble, LAB, "bubble", verified, mistakes)


def test_check_fewest_microbatches(capsys):
    def over_ideal(p, target, v):
        m = math.ceil((p - 1) / (target * v))
        return math.ceil(m / p) * p if v > 1 else m

    def ignores_groups(p, target, v):
        return math.ceil((p - 1) * (1 - target) / (target * v) - 1e-9)

    mistakes = [
        (over_ideal, "over the ideal time"),
        (lambda p, target, v: 2 * p, "its bubble is above the target"),
        (ignores_groups, "multiple of p"),
        (lambda p, target, v: 10_000, "fewer micro-batches already"),
    ]
    verified = "the fewest micro-batches"
    check = lab.check_fewest_microbatches
    checks(capsys, check, LAB, "fewest_microbatches", verified, mistakes)


def test_check_gpipe_schedule(capsys):
    def one_f_one_b(p, m, rank):  # a fine schedule, but not GPipe
        return schedules.one_f_one_b(p, m, rank)

    def backwards_in_forward_order(p, m, rank):  # fine too: any order the ranks agree on
        acts = schedules.gpipe(p, m, rank)
        forwards = [a for a in acts if a.kind in ("forward", "recv_act", "send_act")]
        return forwards + [a for k in range(m) for a in acts[len(forwards) :] if a.microbatch == k]

    def sends_before_computing(p, m, rank):
        acts = schedules.gpipe(p, m, rank)
        i = next(i for i, a in enumerate(acts) if a.kind == "send_act") if rank < p - 1 else None
        if i is not None:
            acts[i - 1], acts[i] = acts[i], acts[i - 1]
        return acts

    def first_stage_receives(p, m, rank):
        return [schedules.Action("recv_act", 0, 0), *schedules.gpipe(p, m, rank)]

    def mixed_orders(p, m, rank):  # rank 0 takes its gradients in the other order
        acts = schedules.gpipe(p, m, rank)
        return acts if rank else backwards_in_forward_order(p, m, rank)

    assert exercises.check_gpipe_schedule(backwards_in_forward_order)
    mistakes = [
        (one_f_one_b, "hold .* micro-batches at their peak"),
        (sends_before_computing, "send_act 0 before forward 0"),
        (first_stage_receives, "rank 0 is the first stage"),
        (mixed_orders, "the lists do not match"),
        (lambda p, m, rank: None, "return a list of schedules.Action"),
    ]
    verified = "GPipe as data"
    checks(capsys, exercises.check_gpipe_schedule, LAB, "my_gpipe", verified, mistakes)


def one_f_one_b_with(warmup, backward_first=False):
    """1F1B written out, with ``warmup(p, rank)`` forwards before the steady state (and,
    with ``backward_first``, each backward before its forward in the steady state)."""

    def my_1f1b(p, m, rank):
        A, first, last = schedules.Action, rank == 0, rank == p - 1

        def forward(k):
            return (
                [A("recv_act", k, 0)] * (not first)
                + [A("forward", k, 0)]
                + [A("send_act", k, 0)] * (not last)
            )

        def backward(k):
            return (
                [A("recv_grad", k, 0)] * (not last)
                + [A("backward", k, 0)]
                + [A("send_grad", k, 0)] * (not first)
            )

        w = max(0, min(warmup(p, rank), m))
        actions = [a for k in range(w) for a in forward(k)]
        for k in range(m - w):
            pair = (
                (backward(k), forward(w + k)) if backward_first else (forward(w + k), backward(k))
            )
            actions += pair[0] + pair[1]
        return actions + [a for k in range(m - w, m) for a in backward(k)]

    return my_1f1b


def never_returns_unless_m_divides(p, m, rank):
    """Walks the micro-batches in groups of p: never reaches m = 6 with p = 4."""
    k = 0
    while k != m:
        k += p
    return schedules.one_f_one_b(p, m, rank)


def test_check_1f1b_schedule(capsys):
    gpipe = schedules.gpipe
    mistakes = [
        (gpipe, r"p=4, m=6: the bubble is 1F1B's, but the stages hold \[6, 6, 6, 6\] micro-"
         r"batches' activations at their peak \(GPipe's order.*\[4, 3, 2, 1\]"),
        (one_f_one_b_with(lambda p, r: p - r), r"hold \[5, 4, 3, 2\] micro-batches'"),
        (one_f_one_b_with(lambda p, r: p - r - 2), r"p=4, m=6: it runs, but the stages idle "
         r"0.571 of the step in the simulator, where 1F1B idles \(p-1\)/\(m\+p-1\) = 0.333"),
        (one_f_one_b_with(lambda p, r: r), r"p=4, m=6: the stages deadlock: stage 0 stops at "
         r"my_1f1b\(4, 6, 0\)\[3\], B0 at time slot 1, waiting for the gradient of "
         r"micro-batch 0 from stage 1; stage 1 stops at my_1f1b\(4, 6, 1\)\[4\], F1 at time "
         r"slot 2.*stage by stage: \[1, 2, 3, 4\]"),
        (one_f_one_b_with(lambda p, r: p - r - 1, backward_first=True),
         "rank 3: backward 0 before forward 0"),
    ]  # fmt: skip
    verified = "1F1B as data: the simulator plays it"
    checks(capsys, exercises.check_1f1b_schedule, LAB, "my_1f1b", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s") as info:
        exercises.check_1f1b_schedule(never_returns_unless_m_divides, timeout=10)
    assert "m not a multiple of p" in str(info.value)


def zb_h1_then(change):
    """ZB-H1's computations (the library's order), changed by ``change(order, m)``."""

    def my_zb_h1(p, m, rank):
        order = [a for a in schedules.build("zb-h1", p, m)[rank] if a.kind not in schedules.COMM]
        return change(order, m)

    return my_zb_h1


def each_w_after_its_b(order, m):
    out = []
    for a in order:
        if a.kind != "backward_weight":
            out.append(a)
        if a.kind == "backward_input":
            out.append(a._replace(kind="backward_weight"))
    return out


def every_w_at_the_end(order, m):
    return [a for a in order if a.kind != "backward_weight"] + [
        schedules.Action("backward_weight", k, 0) for k in range(m)
    ]


def w_before_its_b(order, m):
    first_w = next(i for i, a in enumerate(order) if a.kind == "backward_weight")
    w = order.pop(first_w)
    return [w, *order]


def test_check_zb_h1_schedule(capsys):
    mistakes = [
        (zb_h1_then(each_w_after_its_b), r"p=4, m=6: it runs, but the stages idle 0.250 of "
         r"the step .*where ZB-H1 idles 0.143: every W right after its B is 1F1B's bubble"),
        (zb_h1_then(every_w_at_the_end), r"p=4, m=6: the stages hold \[6, 6, 6, 6\] micro-"
         r"batches' activations at their peak \(each until its W\); ZB-H1 holds at most "
         r"\[4, 4, 4, 4\]"),
        (zb_h1_then(w_before_its_b), "p=4, m=6, rank 0: backward_weight 0 before "
         "backward_input 0"),
        (schedules.one_f_one_b, "rank 0: send_act: the computations only"),
        (zb_h1_then(lambda order, m: [a._replace(kind="backward") if a.kind ==
                                      "backward_input" else a for a in order]),
         "backward 0 is whole: split it"),
    ]  # fmt: skip
    verified = "ZB-H1 as data: the simulator plays it"
    checks(capsys, exercises.check_zb_h1_schedule, LAB, "my_zb_h1", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s"):
        exercises.check_zb_h1_schedule(never_returns_unless_m_divides, timeout=10)


def test_zero_bubble_steps_and_torchs_schedule_give_one_process_gradients():
    """The lab's zero-bubble runs (its GPT on 2 ranks: 2 stages of 4 blocks, or a V of 4
    stages of 2) and torch's ScheduleDualPipeV on the same stages, the tied embedding's
    two copies added as the course's executor adds them."""
    from labsupport.labs import lab11_zero_bubble as zb

    cases = [("zb-h1", 3, 1), ("zbv", 3, 2), ("dualpipev", 4, 2)]
    per_rank = launch(zb.zero_bubble_steps, 2, args=(cases, ("dualpipev", 4)), timeout=300)
    for (_, m, _), results in zip(cases, lab.by_case([r["ours"] for r in per_rank]), strict=True):
        assert lab.gradients_match(results, m)
    assert lab.gradients_match([r["torch"] for r in per_rank], 4)


def test_chunk_runs_counts_stretches_of_one_chunk():
    from labsupport.labs import lab11_zero_bubble as zb

    assert zb.chunk_runs(schedules.build("1f1b", 2, 4)[0]) == 1
    assert zb.chunk_runs(schedules.build("looped-bfs", 4, 8, 2)[0]) == 3
    assert zb.chunk_runs(schedules.build("interleaved", 4, 8, 2)[0]) > 3
