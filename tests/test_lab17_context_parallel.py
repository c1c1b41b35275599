"""Lab 17, context parallelism: the lab's runs on 3 ranks (the notebook runs them on 4),
its drawings, and the exercises' checkers against the worked solutions and wrong answers,
one of which hangs the ranks and must come back as a timeout. (The attention itself is
tested in tests/test_parallel_context.py.)"""

from __future__ import annotations

import math

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
from matplotlib.patches import Polygon, Rectangle
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.estimate import context_parallel as est
from labsupport.labs import lab17_context_parallel as lab
from labsupport.labs import lab17_exercises as exercises
from labsupport.parallel import context_parallel as cp
from labsupport.viz import context_parallel as draw
from labsupport.viz.style import rank_color

matplotlib.use("Agg")
LAB = "17-context-parallel.ipynb"


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def lab_runs() -> dict:
    return {
        "ring": lab.ring_steps(12, "contiguous"),
        "work": lab.causal_work(96, 2, 8),
        "traffic": lab.traffic(24, 6),
    }


def test_the_labs_runs_on_three_ranks():
    ranks = launch(lab_runs, 3, timeout=300)
    schedule = cp.ring_schedule(cp.Layout.contiguous(3))
    for r in ranks:
        assert r["ring"]["equal"]
        for s in r["ring"]["steps"]:
            assert math.isclose(s["lse"], s["max"] + math.log(s["sum"]), abs_tol=1e-5)
            assert s["blocks"] == schedule[s["step"]][s["rank"]][1]
            assert s["K/V of rank"] == schedule[s["step"]][s["rank"]][0]
        for row in r["traffic"]:
            want = lab.traffic_formula(row, seq_len=24, heads=6, cp_size=3)
            assert (row["forward"], row["total"]) == (want["forward"], want["total"])
            assert row["messages"] == want["messages"]
    for layout in ("contiguous", "zigzag"):
        assert [r["work"][layout]["blocks"] for r in ranks] == est.score_blocks(3, layout)
        assert all(r["work"][layout]["cpu_s"] > 0 for r in ranks)


# --------------------------------------------------------------------------- drawings


def test_the_blocks_are_drawn_in_the_colour_of_the_rank_that_computes_them():
    fig = draw.ring_steps_figure(cp.ring_schedule(cp.Layout.zigzag(2)), 4)
    step0 = fig.axes[0]
    squares = [p for p in step0.patches if isinstance(p, Rectangle)]
    triangles = [p for p in step0.patches if isinstance(p, Polygon)]
    # step 0: each rank its two diagonal blocks (a square, pale, and a triangle) and one full
    assert len(squares) == 6 and len(triangles) == 4
    full = [p for p in squares if p.get_alpha() == 1.0]
    assert sorted((p.get_x(), p.get_y()) for p in full) == [(0.0, 0.75), (0.25, 0.5)]
    colours = {matplotlib.colors.to_hex(p.get_facecolor()) for p in triangles}
    assert colours == {rank_color(0).lower(), rank_color(1).lower()}
    assert "rank←K/V of rank: 0←1, 1←0" in fig.axes[1].get_title()


def test_the_balance_figure_counts_what_the_formula_says():
    fig = draw.balance_figure(4)
    bars = [p.get_height() for p in fig.axes[2].patches]
    assert bars == est.score_blocks(4, "contiguous") + est.score_blocks(4, "zigzag")


def test_the_variants_figure_stops_ulysses_where_cp_exceeds_the_kv_heads():
    fig = draw.variants_figure(cps=[2, 4, 8, 16])
    mha, gqa = fig.axes
    assert [len(line.get_xdata()) for line in mha.lines] == [4, 4, 4]
    assert [len(line.get_xdata()) for line in gqa.lines] == [4, 4, 3]
    ring = est.bytes_per_rank("ring", 1, 131072, 32, 8, 128, 2, 2, 2)["total"] / 1e9
    assert gqa.lines[0].get_ydata()[0] == pytest.approx(ring)


def test_the_memory_figure_draws_the_calculator():
    fig = draw.memory_figure()
    flash = fig.axes[0].lines[1].get_ydata()
    layer = est.activation_per_gpu(131072, 1, 16384, 128, 1, 8, 1) / 1e9
    assert flash[0] == pytest.approx(7 * layer) and flash[-1] == pytest.approx(7 * layer / 16)


def test_the_activations_figure_draws_one_bar_per_rank_and_the_share_line():
    rows = [{"cp": 1, "rank": 0, "bytes": 4000}, {"cp": 2, "rank": 0, "bytes": 2000}]
    ax = draw.activations_figure(rows).axes[0]
    assert [p.get_height() for p in ax.patches] == [4.0, 2.0]
    assert list(ax.lines[1].get_ydata()) == [2.0, 2.0]


# --------------------------------------------------------------------------- exercises


def averaged(out, lse, block_out, block_lse):
    """Gives both blocks the same weight."""
    return (out + block_out) / 2, torch.logaddexp(lse, block_lse)


def keeps_the_old_lse(out, lse, block_out, block_lse):
    """Weights the outputs right, but returns the first block's lse."""
    new = torch.logaddexp(lse, block_lse)
    w, bw = (lse - new).exp().unsqueeze(-1), (block_lse - new).exp().unsqueeze(-1)
    return w * out + bw * block_out, lse


def overflows(out, lse, block_out, block_lse):
    """Right in exact arithmetic; exp() of large log-sum-exps overflows float32."""
    a, b = lse.exp(), block_lse.exp()
    return (a / (a + b)).unsqueeze(-1) * out + (b / (a + b)).unsqueeze(-1) * block_out, (
        a + b
    ).log()


def synchronises_the_max(out, lse, block_out, block_lse):
    """Makes the merged lse the same on every rank: ranks merge different numbers of
    times, so the all-reduces never pair up (and the result would be wrong anyway)."""
    new = torch.logaddexp(lse, block_lse)
    dist.all_reduce(new, op=dist.ReduceOp.MAX)
    w, bw = (lse - new).exp().unsqueeze(-1), (block_lse - new).exp().unsqueeze(-1)
    return w * out + bw * block_out, new


def test_check_merge(capsys):
    mistakes = [
        (averaged, "plain average"),
        (keeps_the_old_lse, "the output is right but the merged lse is not"),
        (overflows, "with scores in the hundreds"),
        (lambda out, lse, block_out, block_lse: out, "return a pair"),
    ]
    checks(capsys, exercises.check_merge, LAB, "merge", "inside ring attention", mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s") as info:
        exercises.check_merge(synchronises_the_max, timeout=10)
    assert "needs no message" in str(info.value)


def contiguous_pairs(rank, cp):
    return 2 * rank, 2 * rank + 1


def mirrored_in_cp(rank, cp):
    return rank, cp - 1 - rank


def never_returns(rank, cp):
    chunk = rank
    while chunk < 2 * cp:  # forgets to move on
        pass
    return chunk, 2 * cp - 1 - chunk


def test_check_zigzag(capsys):
    mistakes = [
        (contiguous_pairs, r"the work is uneven: score blocks per rank \[3, 7, 11, 15\]"),
        (mirrored_in_cp, "chunks held by no rank: \\[2, 3\\]"),
        (lambda rank, cp: (rank,), "each rank gets 2 of the 2·cp chunks"),
    ]
    checks(capsys, exercises.check_zigzag, LAB, "zigzag_chunks", "every rank holds 2", mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 10 s"):
        exercises.check_zigzag(never_returns, timeout=10)
