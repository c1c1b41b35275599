"""``make bench``'s shared parts: the one statistic (the median of paired ratios), runs in
turns, the floors, the target line and the JSON record; and each bench's record, built
from made-up measurements (the benches themselves run in ``make bench``, not here)."""

from __future__ import annotations

import json

import pytest

import bench.__main__ as driver
from bench import (
    allreduce,
    compare,
    context_parallel,
    ddp,
    expert_parallel,
    floors,
    launch,
    report,
    three_d,
    zero_memory,
)
from labsupport.labs.lab11_pipeline import step_time_model


def test_paired_is_the_median_of_the_pairs_ratios_with_their_spread():
    ratio = report.paired([2.0, 3.0, 10.0], [1.0, 2.0, 4.0])
    assert (ratio.median, ratio.low, ratio.high, ratio.n) == (2.0, 1.5, 2.5, 3)
    assert str(ratio) == "2.00x (1.50-2.50, 3 pairs)"


def test_paired_is_not_the_ratio_of_the_medians():
    """The DDP bench's old table (ratio of medians) and target line (median of ratios)
    disagreed on the same runs; these runs show how: one statistic must be chosen."""
    ours, torch_ = [1.0, 1.2, 0.9, 1.5, 1.1], [1.1, 1.0, 1.0, 1.4, 1.2]
    of_medians = sorted(ours)[2] / sorted(torch_)[2]
    assert report.paired(ours, torch_).median != pytest.approx(of_medians)


def test_paired_refuses_unpaired_or_empty_runs():
    with pytest.raises(ValueError, match="pairs"):
        report.paired([1.0, 2.0], [1.0])
    with pytest.raises(ValueError, match="positive"):
        report.paired([1.0], [0.0])
    with pytest.raises(ValueError, match="at least one round"):
        report.ratios([])


def test_in_turns_alternates_in_both_orders_and_drops_the_warm_up():
    calls = []
    runs = {name: (lambda name=name: calls.append(name) or len(calls)) for name in "ab"}
    times = report.in_turns(runs, rounds=2, warmup=1)
    assert calls == ["a", "b", "b", "a", "a", "b"]
    assert times == {"a": [4, 5], "b": [3, 6]}
    with pytest.raises(ValueError, match="at least 1"):
        report.in_turns(runs, rounds=0)


def test_a_target_says_met_or_missed_and_record_writes_the_json(tmp_path, monkeypatch, capsys):
    met, missed = report.target("x", "1.0x", True), report.target("y", "2.0x", False)
    assert met["text"] == "target: x -> 1.0x (met)" and missed["text"].endswith("(MISSED)")
    path = tmp_path / "rec.json"
    monkeypatch.setenv(report.RECORD_ENV, str(path))
    assert report.record("demo", {"n": 1}, [], [met]) == 0
    assert report.record("demo", {"n": 1}, [], [met, missed]) == 1
    assert json.loads(path.read_text())["targets"][1]["met"] is False
    assert "(MISSED)" in capsys.readouterr().out


def test_a_line_needs_its_floor_with_its_ratio():
    ratio = report.ratios([1.0])
    with pytest.raises(ValueError):
        report.line("x", 1.0, "s", of_floor=ratio)
    with pytest.raises(ValueError):
        report.line("x", 1.0, "s", floor="a copy")


def test_ring_floor_is_2_n_minus_1_over_n_copies():
    assert floors.ring_floor_seconds(2**20, 4, 0.01) == pytest.approx(0.015)
    assert floors.ring_floor_seconds(2**20, 2, 0.01) == pytest.approx(0.01)
    with pytest.raises(ValueError):
        floors.ring_floor_seconds(2**20, 4, 0.0)


def test_ddp_floor_is_the_compute_plus_the_last_bucket_when_backward_hides_the_rest():
    # backward long enough to hide every bucket but the last: f + b + a + b x last + opt
    got = floors.ddp_floor_seconds([1000, 1000, 500], 1.0, 10.0, 0.5, a=0.1, b=1e-3)
    assert got == pytest.approx(1.0 + 10.0 + 0.1 + 0.5 + 0.5)
    # communication that outlasts backward queues up: more than the last bucket
    slow = floors.ddp_floor_seconds([1000, 1000, 500], 1.0, 0.1, 0.0, a=0.1, b=1e-2)
    assert slow > 1.0 + 0.1 + 0.1 + 5.0
    with pytest.raises(ValueError):
        floors.ddp_floor_seconds([], 1.0, 1.0, 0.0, 0.0, 0.0)


@pytest.mark.parametrize("p, m", [(2, 2), (4, 8), (3, 5)])
def test_pipeline_floor_is_lab_11s_model_with_free_messages(p, m):
    assert floors.pipeline_floor_seconds(m, [0.01] * p, [0.02] * p) == pytest.approx(
        step_time_model(p, m, 0.01, 0.02, 0.0)
    )


def test_pipeline_floor_waits_for_the_slowest_stage():
    even = floors.pipeline_floor_seconds(4, [1.0, 1.0], [2.0, 2.0])
    assert floors.pipeline_floor_seconds(4, [1.0, 2.0], [2.0, 4.0]) > even
    with pytest.raises(ValueError):
        floors.pipeline_floor_seconds(2, [1.0], [1.0, 2.0])


def test_zero_traffic_is_2_psi_or_3_psi_of_the_shares_sent():
    assert floors.zero_traffic_bytes(1000, 1, 4) == 2 * 1000 * 4 * 3 / 4
    assert floors.zero_traffic_bytes(1000, 2, 4) == floors.zero_traffic_bytes(1000, 1, 4)
    assert floors.zero_traffic_bytes(1000, 3, 4) == 3 * 1000 * 4 * 3 / 4
    with pytest.raises(ValueError, match="stages"):
        floors.zero_traffic_bytes(1000, 0, 4)


def test_against_floor_pairs_the_step_with_its_floor_and_the_launches_medians():
    """Over its floor: the pairs timed in turns in a launch; against one process: the
    pairs of the two launches' medians, round by round (not the medians of all)."""
    launches = [
        {"step": [2.0, 4.0], "floor": [1.0, 1.0]},
        {"step": [6.0, 6.0], "floor": [1.0, 4.0]},
    ]
    peers = [[1.0, 2.0, 3.0], [3.0, 3.0, 9.0]]
    one, step = report.against_floor(("one", "step"), launches, peers, "no messages")
    assert one["value"] == 3.0 and one["of_floor"] is None  # the median of all its times
    assert step["value"] == 5.0
    assert (step["of_floor"]["median"], step["of_floor"]["n"]) == (3.0, 4)  # 2, 4, 6, 1.5
    assert (step["of_floor"]["low"], step["of_floor"]["high"]) == (1.5, 6.0)
    assert (step["vs"]["median"], step["vs"]["n"]) == (1.75, 2)  # 3 / 2 and 6 / 3
    assert step["floor"] == "no messages; median 1000.0 ms"


@pytest.mark.parametrize("cp", [2, 3])
def test_the_ring_floor_computes_each_ranks_share_of_the_ring_with_no_messages(cp):
    """Every rank's output and query gradient, as one process's attention gives them:
    the floor runs the ring's whole compute on the right K/V copies, and no process
    group exists here to send anything over."""
    import torch
    import torch.nn.functional as F

    from labsupport.parallel.blockwise_attention import count_work
    from labsupport.parallel.context_parallel import Layout

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 12 * cp, 8, generator=g, requires_grad=True) for _ in range(3))
    F.scaled_dot_product_attention(q, k, v, is_causal=True).sum().backward()
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True).detach()
    lay = Layout.zigzag(cp)
    at = [lay.positions(r, q.size(2)) for r in range(cp)]
    kvs = [torch.stack([k, v]).detach().index_select(3, i) for i in at]
    for rank in range(cp):
        with count_work() as work:
            out, dq = context_parallel.local_ring(q.detach()[..., at[rank], :], kvs, rank, lay)
        assert torch.allclose(out, want[..., at[rank], :], atol=1e-6)
        assert torch.allclose(dq, q.grad[..., at[rank], :], atol=1e-6)
        assert work.scores("forward") == work.scores("backward") > 0


def test_the_expert_parallel_floor_runs_each_expert_on_the_rows_the_routing_sends_it():
    """Rank r's floor runs its experts on as many rows as the same experts get in one
    process from every rank's tokens, and returns one row per token of its own (3 ranks
    of 2 experts)."""
    import torch

    from labsupport.models import MoE, MoEConfig

    torch.manual_seed(0)
    moe = MoE(16, MoEConfig(6, 2))
    batches = [torch.randn(5 + r, 16, generator=torch.Generator().manual_seed(r)) for r in range(3)]
    rows = {}  # expert -> rows it computed

    def counted(expert, args, output):
        rows[expert] = rows.get(expert, 0) + len(args[0])

    for expert in moe.experts:
        expert.register_forward_hook(counted)
    for x in batches:
        moe(x)
    whole = rows.copy()
    rows.clear()
    for rank, x in enumerate(batches):
        received = expert_parallel.arrivals(moe.router, batches, rank)
        y = expert_parallel.LocalExperts(moe, rank, received)(x.requires_grad_(True))
        y.square().mean().backward()
        assert y.shape == x.shape and x.grad is not None
    assert rows == whole


# --------------------------------------------------------------------------- records

R = [1.0, 1.2, 1.1]  # three rounds of made-up seconds


def _three_d():
    return {
        "3d": [{"step": s, "forward": [0.1, 0.12], "backward": [0.2, 0.25]} for s in R],
        "single": [0.5 * s for s in R],
    }


def _zero():
    rank = {
        s: {"held": 100 // s, "sent": 60, "numel": 10, "padded": 10, "largest_unit": 8}
        for s in (1, 2, 3)
    }
    return [rank] * 4


def _parallel():
    """Three rounds of a parallel launch (the step and its floor in turns) and one
    process's launch."""
    return [{"step": [s, s], "floor": [0.5 * s, 0.6 * s]} for s in R], [{"step": [s]} for s in R]


LINES = {
    "launch": lambda: launch.summarise(
        {launch.FORK: R, launch.WARM: R, launch.STEP: R},
        {launch.FORK: R, launch.WARM: R, "torchrun": [10 * s for s in R]},
    ),
    "allreduce": lambda: allreduce.summarise({"ring": R, "torch": R, "copy": [0.1] * 3}),
    "ddp": lambda: ddp.summarise(
        {
            "ours": R,
            "torch": R,
            "parts": [[0.1, 0.2, 0.05]] * 3,
            "buckets": [10**6, 5 * 10**5],
            "a": 1e-4,
            "b": 1e-9,
        }  # fmt: skip
    ),
    "three_d": lambda: three_d.summarise(_three_d()),
    "zero_memory": lambda: zero_memory.summarise(_zero()),
    "context_parallel": lambda: context_parallel.summarise(*_parallel(), 400, [110] * 4),
    "expert_parallel": lambda: expert_parallel.summarise(
        *_parallel(), [{"bytes": 10, "formula": 10}] * 4
    ),
}


def test_every_bench_make_bench_runs_has_a_record_here():
    assert set(LINES) == set(driver.BENCHES)


@pytest.mark.parametrize("bench", sorted(LINES))
def test_a_bench_record_has_one_ratio_and_its_floor_per_line(bench):
    lines = json.loads(json.dumps(LINES[bench]()))  # what the JSON file holds
    assert lines
    compared = 0
    for ln in lines:
        assert set(ln) == {"name", "value", "unit", "vs", "of_floor", "floor", "detail"}
        if ln["of_floor"] is None:  # the peer's own line, the reference
            assert ln["vs"] is None and ln["floor"] is None
            continue
        compared += 1
        assert set(ln["of_floor"]) == set(report.FIELDS) and ln["floor"]
        assert ln["of_floor"]["low"] <= ln["of_floor"]["median"] <= ln["of_floor"]["high"]
        if ln["vs"] is not None:
            assert set(ln["vs"]) == {"peer", *report.FIELDS}
    assert compared >= 1


def test_compare_matches_two_runs_lines_by_name(capsys):
    def run(value, floor):
        line = report.line("ring", value, "s", report.ratios([floor]), "a copy", detail="1 GB/s")
        machine = {"cpu_model": "c", "cores": 2, "load_average_before": [1.0]}
        return {"started": "t", "seconds": 1, "machine": machine,
                "benches": {"allreduce": {"lines": [line]}}}  # fmt: skip

    old, new = run(2.0, 4.0), run(1.0, 2.0)
    assert compare.rows(old, new) == [("allreduce", "ring", 2.0, 1.0, 4.0, 2.0)]
    new["benches"]["ddp"] = {"lines": [report.line("ours", 3.0, "s")]}
    assert compare.rows(old, new)[1] == ("ddp", "ours", None, 3.0, None, None)
