"""labsupport.viz: each drawing shows the data it is given (positions, heights, labels),
and the chapters' committed figures are what tools.figures draws today."""

from __future__ import annotations

from pathlib import Path

import matplotlib
import matplotlib.pyplot as plt
import numpy as np
import pytest
import torch
from matplotlib.colors import to_hex
from matplotlib.patches import FancyBboxPatch, Rectangle
from matplotlib.testing.compare import compare_images
from matplotlib.text import Text

from labsupport.comm.cost import p2p_time
from labsupport.estimate import datasheets, reliability
from labsupport.estimate.memory import checkpoint_peak_bytes, checkpoint_saved_bytes
from labsupport.estimate.roofline import roofline
from labsupport.estimate.walls import crossover_devices
from labsupport.viz import clusters, collectives, dtypes, one_device, ranks, style, walls
from labsupport.viz import reliability as reliability_figures
from labsupport.viz import roofline as roofline_figures
from tools import figures

matplotlib.use("Agg")


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(artist) -> list[str]:
    """Every piece of text drawn in a figure or axes (titles, labels, annotations)."""
    return [t.get_text() for t in artist.findobj(Text) if t.get_text()]


def facecolors(ax, kind=Rectangle) -> list[str]:
    return [to_hex(p.get_facecolor()) for p in ax.patches if isinstance(p, kind)]


# --------------------------------------------------------------------------- ranks


def test_each_rank_has_one_colour_everywhere():
    assert len(set(style.RANK_COLORS)) == len(style.RANK_COLORS) == 8
    assert style.rank_color(0) != style.rank_color(1)
    assert style.rank_color(len(style.RANK_COLORS)) == style.rank_color(0)


def test_draw_ranks_puts_each_process_on_its_node_in_its_colour():
    infos = [{"rank": r, "local_rank": r % 2, "node_rank": r // 2} for r in range(4)]
    ax = ranks.draw_ranks(infos, title="two nodes")
    labels = texts(ax)
    assert {"node 0", "node 1", "two nodes"} <= set(labels)
    assert [label for label in labels if label.startswith("rank")] == [
        f"rank {r}\nlocal {r % 2}\nnode {r // 2}" for r in range(4)
    ]
    # two node boxes, then one box per process in its rank's colour
    assert facecolors(ax, FancyBboxPatch)[2:] == [style.rank_color(r).lower() for r in range(4)]


# --------------------------------------------------------------------------- collectives


def test_draw_collective_colours_values_by_the_rank_they_came_from():
    # all_reduce on 3 ranks, on chapter 7's example in the shape
    # lab07_collectives.run_primitive returns: rank r holds [1, 2, 3] x 10^r, and every rank
    # ends with the sums [111, 222, 333]
    before = [torch.tensor([1.0, 2.0, 3.0]) * 10**r for r in range(3)]
    results = [{"before": b, "ours": torch.tensor([111.0, 222.0, 333.0])} for b in before]
    ax = collectives.draw_collective(results, "all_reduce")
    assert {"rank 0", "rank 2", "before", "after", "all_reduce"} <= set(texts(ax))
    values = [t for t in texts(ax) if t.isdigit()]  # rank by rank: before, then after
    sums = ["111", "222", "333"]
    assert values == ["1", "2", "3", *sums, "10", "20", "30", *sums, "100", "200", "300", *sums]
    colours = facecolors(ax)
    for rank in range(3):  # per rank: its three values, then the three sums
        mine = colours[6 * rank : 6 * rank + 6]
        assert mine == [style.rank_color(rank).lower()] * 3 + [collectives.COMBINED] * 3


def test_a_collective_drawn_below_puts_the_result_under_the_input():
    before = [torch.tensor([1.0, 2.0]) * 10**r for r in range(2)]
    results = [{"before": b, "ours": torch.tensor([11.0, 22.0])} for b in before]
    ax = collectives.draw_collective(results, "all_reduce", below=True, labels=False)
    boxes = [p for p in ax.patches if isinstance(p, Rectangle)]
    assert [(p.get_x(), p.get_y()) for p in boxes] == [
        (0, 1), (1, 1), (0, -2), (1, -2),  # rank 0: [1, 2] on the top row, its sums below
        (0, 0), (1, 0), (0, -3), (1, -3),  # rank 1
    ]  # fmt: skip
    assert not [t for t in texts(ax) if t.startswith("rank") or t in ("before", "after")]


def test_the_collectives_figure_names_the_ranks_once_per_row_of_panels():
    before = [torch.tensor([1.0, 2.0]) * 10**r for r in range(2)]
    results = [{"before": b, "ours": torch.tensor([11.0, 22.0])} for b in before]
    runs = {name: results for name in ("a", "b", "c", "d")}
    fig = collectives.collectives_figure(runs, columns=3)
    titles = [ax.get_title(loc="left") for ax in fig.axes]
    assert titles == ["a", "b", "c", "d", "", ""]  # a key, then an empty cell
    named = [ax.get_title(loc="left") for ax in fig.axes if "rank 0" in texts(ax)]
    assert named == ["a", "d"]
    assert "combined from\nseveral ranks" in texts(fig.axes[4])


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_ring_schedule_completes_each_chunk_where_the_code_says(world):
    steps = collectives.ring_states(world)
    assert len(steps) == 1 + 2 * (world - 1)
    after_reduce_scatter = steps[world - 1][2]
    for rank in range(world):  # rank r owns the fully reduced chunk r
        assert after_reduce_scatter[rank][rank] == set(range(world))
    assert all(who == set(range(world)) for row in steps[-1][2] for who in row)
    assert steps[1][1] == [(r, (r + 1) % world, (r - 1) % world) for r in range(world)]


def test_draw_ring_allreduce_shows_every_step():
    fig = collectives.draw_ring_allreduce(3)
    titles = [ax.get_title() for ax in fig.axes if ax.get_title()]
    assert titles == ["start", "reduce-scatter step 1", "reduce-scatter step 2",
                      "all-gather step 1", "all-gather step 2"]  # fmt: skip
    left = {ax.get_title(): ax.get_position().x0 for ax in fig.axes if ax.get_title()}
    assert left["start"] == left["reduce-scatter step 2"] < left["all-gather step 1"]
    assert fig.axes[1].get_position().y0 > fig.axes[2].get_position().y0  # step 1 above 2
    assert fig.get_suptitle().startswith("Ring all-reduce on 3 ranks")
    last = next(ax for ax in fig.axes if ax.get_title() == "all-gather step 2")
    assert texts(last).count("Σ") == 3 * 3  # every chunk complete on every rank
    first = fig.axes[0]
    assert texts(first).count("Σ") == 0 and {"0", "1", "2"} <= set(texts(first))


# --------------------------------------------------------------------------- chapter 1


def test_draw_roofline_draws_each_roof_and_places_the_kernels():
    ceilings = [{"label": "a", "peak_flops": 1e12, "bandwidth": 1e11}]
    kernels = [
        {"label": "add", "intensity": 1 / 12, "flop_per_s": 5e9},
        {"label": "copy", "intensity": 0.0, "flop_per_s": 0.0},  # no place on a log axis
    ]
    ax = roofline_figures.draw_roofline(ceilings, kernels, title="t")
    roof, ridge, add = ax.lines
    np.testing.assert_allclose(roof.get_ydata(), roofline(1e12, 1e11, roof.get_xdata()) / 1e9)
    assert (ridge.get_xdata()[0], ridge.get_ydata()[0]) == (10.0, 1000.0)  # 1e12 / 1e11
    assert (add.get_xdata()[0], add.get_ydata()[0]) == (1 / 12, 5.0)
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["a", "add"]


def test_datasheet_rooflines_draw_one_roof_per_device():
    left, right = roofline_figures.datasheet_rooflines().axes
    names = list(datasheets.DEVICES)
    assert [t.get_text() for t in left.get_legend().get_texts()] == names
    assert [t.get_text() for t in right.get_legend().get_texts()] == names[:-1]  # no CPU tensor
    assert "matmul 1024³\n171 FLOP/B" in texts(left)  # 2·1024³ / (4 · 3 · 1024²)
    assert "matmul 1024³\n341 FLOP/B" in texts(right)  # the same in 2-byte elements


def test_memory_hierarchy_draws_one_bar_per_level():
    fig = roofline_figures.memory_hierarchy()
    for ax, (device, levels) in zip(fig.axes, datasheets.HIERARCHY.items(), strict=True):
        assert ax.get_title() == device
        names = {round(t.get_position()[1]): t.get_text() for t in ax.get_yticklabels()}
        heights = [bar.get_y() + bar.get_height() / 2 for bar in ax.patches]
        assert heights == sorted(heights, reverse=True), "the fastest level at the top"
        for bar, y, (name, size, _) in zip(ax.patches, heights, levels, strict=True):
            assert (names[round(y)], bar.get_width()) == (name, size)


# --------------------------------------------------------------------------- chapter 2


def test_dtype_layouts_draw_one_box_per_bit():
    names = ("fp32", "bf16", "fp8 e4m3")
    ax = dtypes.dtype_layouts(names).axes[0]
    assert len(ax.patches) == 32 + 16 + 8
    colours = facecolors(ax)
    assert (
        colours[:9]
        == [dtypes.FIELD_COLORS["sign"].lower()] + [dtypes.FIELD_COLORS["exponent"].lower()] * 8
    )
    assert {"fp32  (32 bits)", "max 448, eps 2^-3"} <= set(texts(ax))


def test_range_and_precision_spans_subnormals_to_the_largest_number():
    ax = dtypes.range_and_precision(("fp16",)).axes[0]
    subnormal, normal = ax.patches
    assert subnormal.get_x() == -24 and subnormal.get_width() == 10  # 2^-24 ... 2^-14
    assert normal.get_x() == -14 and normal.get_x() + normal.get_width() == pytest.approx(
        np.log2(65504)
    )
    assert "6.0e-08 … 6.55e+04" in texts(ax)


def test_plot_loss_scaling_plots_each_row():
    rows = [{"log2 scale": k, "median rel. error": 2.0**-k, "subnormal": 0.5, "zero": 0.25,
             "inf": k / 100} for k in (0, 4, 8)]  # fmt: skip
    left, right = dtypes.plot_loss_scaling(rows).axes
    (errors,) = [line for line in left.lines if len(line.get_xdata()) == 3]
    assert list(errors.get_xdata()) == [0, 4, 8] and list(errors.get_ydata()) == [1, 2**-4, 2**-8]
    assert [list(line.get_ydata()) for line in right.lines] == [[50] * 3, [25] * 3, [0, 4, 8]]
    assert [t.get_text() for t in right.get_legend().get_texts()] == ["subnormal", "zero", "inf"]


# --------------------------------------------------------------------------- chapter 3


def test_memory_breakdown_stacks_16_bytes_per_parameter():
    fig = walls.memory_breakdown_figure({"7B": 7e9, "1B": 1e9})
    seven, one = fig.axes
    assert [p.get_height() for p in seven.patches] == [14, 14, 28, 28, 28]  # GB per part
    assert [p.get_height() for p in one.patches] == [2, 2, 4, 4, 4]
    assert {"112 GB", " one H100: 80 GB", "7B parameters"} <= set(texts(seven))
    assert seven.lines[0].get_ydata()[0] == 80  # one GPU's memory


def test_time_to_train_crosses_over_where_the_formula_says():
    ax = walls.time_to_train_figure().axes[0]
    compute, communication, total = ax.lines[:3]
    np.testing.assert_allclose(total.get_ydata(), compute.get_ydata() + communication.get_ydata())
    # compute falls as 1/GPUs; communication stays about flat
    devices = compute.get_xdata()
    np.testing.assert_allclose(compute.get_ydata() * devices, compute.get_ydata()[0] * devices[0])
    cross = crossover_devices(3.2e6, 312e12 * 0.4, 50e9)
    assert ax.lines[3].get_xdata()[0] == cross
    assert "communication\ndominates beyond\n~1,924 GPUs" in texts(ax)
    assert ax.get_xlabel() == "number of A100 GPUs (data parallel)"


# --------------------------------------------------------------------------- chapter 4


def test_draw_checkpoint_memory_puts_measurements_next_to_the_formulas():
    layers, batch, d = 8, 4, 2
    unit = batch * d * 4
    measured = {None: {"after_forward": 72 * unit, "peak": 80 * unit},
                2: {"after_forward": 4 * unit, "peak": 25 * unit}}  # fmt: skip
    ax = one_device.draw_checkpoint_memory(measured, layers, batch, d).axes[0]
    assert [p.get_height() for p in ax.patches] == [72, 4, 80, 25]
    kept, peak = ax.lines
    assert list(kept.get_ydata()) == [checkpoint_saved_bytes(8, 4, 2, s) / unit for s in (None, 2)]
    assert list(peak.get_ydata()) == [checkpoint_peak_bytes(8, 4, 2, s) / unit for s in (None, 2)]
    assert [t.get_text() for t in ax.get_xticklabels()] == ["none", "2"]


def test_mixed_precision_loop_has_its_eight_stages():
    ax = one_device.mixed_precision_loop_figure().axes[0]
    boxes = [p for p in ax.patches if isinstance(p, FancyBboxPatch)]
    assert len(boxes) == 8
    assert {"master weights\nfp32", "inf or NaN found?\nskip step, halve S"} <= set(texts(ax))


# --------------------------------------------------------------------------- chapter 5


def test_plot_fit_draws_measurements_and_model_on_log_axes():
    results = [{"bytes": 4**k, "seconds": 50e-6 + 4**k / 3e9} for k in range(1, 13)]
    ax = clusters.plot_fit(results, 50e-6, 1 / 3e9)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    model, latency, bandwidth, measured, half = ax.lines
    assert list(measured.get_xdata()) == [r["bytes"] for r in results]
    np.testing.assert_allclose(measured.get_ydata(), [r["seconds"] * 1e6 for r in results])
    np.testing.assert_allclose(model.get_ydata(), p2p_time(model.get_xdata(), 50e-6, 1 / 3e9) * 1e6)
    assert half.get_xdata()[0] == pytest.approx(150e3)  # n½ = α/β
    assert "n½ = α/β ≈ 146 KiB" in texts(ax)
    assert [t.get_text() for t in ax.get_xticklabels()] == ["16 B", "256 B", "4 KiB", "64 KiB",
                                                            "1 MiB", "16 MiB"]  # fmt: skip


def test_alpha_beta_regimes_mark_each_links_half_bandwidth_size():
    left, right = clusters.alpha_beta_regimes().axes
    assert {"n½ = 250 kB", "n½ = 2.25 MB"} <= set(texts(right))  # 5 µs x 50 GB/s, x 450 GB/s
    ndr = right.lines[0]
    np.testing.assert_allclose(ndr.get_ydata(), ndr.get_xdata() / (5e-6 + ndr.get_xdata() / 50e9)
                               / 1e9)  # fmt: skip


def test_rail_topology_joins_gpu_k_of_every_node_to_leaf_k():
    ax = clusters.rail_topology().axes[0]
    labels = texts(ax)
    assert [f"node {j}" for j in range(4)] == [t for t in labels if t.startswith("node")]
    assert [f"leaf switch, rail {k}" for k in range(4)] == [
        t for t in labels if t.startswith("leaf switch")
    ]
    assert sum(1 for t in labels if t.startswith("spine switch")) == 2
    rail0 = [line for line in ax.lines if to_hex(line.get_color()) == "#000000"]
    assert len(rail0) == 4  # GPU 0 of each of the 4 nodes, drawn in black


# --------------------------------------------------------------------------- fault tolerance


def test_job_mtbf_falls_as_one_over_the_gpus_and_marks_are_on_the_line():
    per_gpu = 50_000 * 3600.0
    ax = reliability_figures.draw_job_mtbf(per_gpu, marks={"Llama 3": 16_384})
    line, mark = ax.lines[0], ax.lines[1]
    n, hours = line.get_xdata(), line.get_ydata()
    np.testing.assert_allclose(hours * n, 50_000)
    assert mark.get_xdata()[0] == 16_384
    assert mark.get_ydata()[0] == pytest.approx(50_000 / 16_384)
    assert any("Llama 3\n3.1 h" in t for t in texts(ax))


def test_wasted_fraction_curve_is_least_at_youngs_interval():
    c, m = 40.0, 11_130.0
    ax = reliability_figures.draw_wasted_fraction(c, m)
    first, daly_model, young = ax.lines[0], ax.lines[1], ax.lines[2]
    minutes, percent = first.get_xdata(), first.get_ydata()
    best = reliability.young_interval(c, m) / 60
    assert young.get_xdata()[0] == pytest.approx(best)
    assert minutes[np.argmin(percent)] == pytest.approx(best, rel=0.02)
    assert percent.min() == pytest.approx(100 * np.sqrt(2 * c / m), rel=1e-3)
    # the same quantity, extra time per second of work: Daly's complete model lies above
    # Young's first order, C/τ + (τ+C)²/(2Mτ) + ... >= C/τ + τ/(2M)
    assert np.all(daly_model.get_ydata() >= percent - 1e-9)
    at_young = reliability.expected_wall_time(1.0, best * 60, c, m) - 1
    daly_at_young = np.interp(best, minutes, daly_model.get_ydata())
    assert daly_at_young == pytest.approx(100 * at_young, rel=1e-3)
    assert any("every 16 min" in t for t in texts(ax))


def test_fp8_errors_draw_a_line_per_recipe_in_percent():
    table = {0: {"bf16": 0.002, "E4M3 blocks": 0.037}, 1e6: {"bf16": 0.002, "E4M3 blocks": 0.9}}
    ax = one_device.draw_fp8_errors(table).axes[0]
    bf16, blocks = ax.lines[:2]
    assert list(bf16.get_xdata()) == [1, 1e6]  # no outliers drawn at 1 on the log axis
    assert list(blocks.get_ydata()) == pytest.approx([3.7, 90.0])
    assert [t.get_text() for t in ax.get_legend().get_texts()] == ["bf16", "E4M3 blocks"]
    assert ax.lines[2].get_xdata()[0] == 448 / 2**-6  # E4M3's normal range, dotted


def test_lanes_legend_names_every_colour_of_a_step():
    from labsupport.viz import data_parallel as dp_figures

    events = [("forward", 0.0), ("backward", 0.01), ("grad w", 0.02),
              ("all-reduce start bucket 0", 0.02), ("all-reduce finished bucket 0", 0.03),
              ("waited", 0.03), ("step", 0.04)]  # fmt: skip
    lanes = dp_figures.step_lanes([events])
    fig = dp_figures.draw_lanes({"a step": lanes}, legend=dp_figures.STEP_LEGEND)
    (legend,) = fig.legends
    assert [t.get_text() for t in legend.get_texts()] == [
        label for label, _ in dp_figures.STEP_LEGEND
    ]
    used = {color for bars in lanes.values() for *_, color in bars}
    assert used - {"#bbbbbb"} <= {color for _, color in dp_figures.STEP_LEGEND} | {
        style.rank_color(4)
    }
    assert not dp_figures.draw_lanes({"a step": lanes}).legends  # none unless asked


def test_resumed_curve_splits_at_the_checkpoint():
    straight = [5.0, 4.0, 3.0, 2.5, 2.0]
    ax = reliability_figures.draw_resumed(straight, straight, resumed_at=3, killed_at=4)
    whole, before, after = ax.lines[:3]
    assert list(whole.get_ydata()) == straight
    assert list(before.get_xdata()) == [0, 1, 2] and list(after.get_xdata()) == [3, 4]
    assert "resumed from step 3" in [t.get_text() for t in ax.get_legend().get_texts()]


def test_the_chapter_figure_has_both_panels():
    fig = reliability_figures.failures_figure()
    left, right = fig.axes
    assert "384 (BLOOM's size)\n5.5 days" in texts(left)  # one decimal under 10 days
    assert any("8.5% wasted" in t for t in texts(right))


# --------------------------------------------------------------------------- the chapters'

COMMITTED = Path(__file__).resolve().parents[1] / "chapters" / "figures"

# Drawn on another CPU, a figure can differ by one grey level of antialiasing here and
# there: 76 channel values of 03-time-to-train.png, an RMS difference of 0.010 (on the
# 0 to 255 scale of compare_images). A small real change weighs far more. Changing one
# digit of one label, or moving one label by 2 pixels, in turn for every label of every
# figure, gave an RMS of at least 0.26 (a digit in one box of 07-collectives.png, the
# largest figure), 0.6 to 1.7 in the others, and 0.42 to 8 for a moved label. The
# tolerance sits between the two, 5 times the noise seen and 5 times below the smallest
# real change.
RMS_TOLERANCE = 0.05


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_committed_figures_are_what_the_code_draws(tmp_path, name):
    figures.save(figures.FIGURES[name](), tmp_path / name)
    difference = compare_images(COMMITTED / name, tmp_path / name, tol=RMS_TOLERANCE)
    assert difference is None, f"run `make figures` and commit the result:\n{difference}"
