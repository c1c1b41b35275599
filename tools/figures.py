"""The chapters' figures, drawn from code: ``python -m tools.figures chapters/figures``.

Each function returns a matplotlib figure; :func:`main` saves them all as PNG with no
timestamp in the file, so that regenerating a figure changes nothing unless its code
did (a test checks that the committed files match).
"""

from __future__ import annotations

import functools
import re
import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch
from matplotlib.text import Text

from labsupport import launch
from labsupport.estimate import moe as moe_estimate
from labsupport.estimate.tensor_parallel import layer_costs
from labsupport.labs import lab04_checkpointing, lab04_fp8, lab07_collectives, lab18_moe
from labsupport.labs.lab06_launching import global_rank
from labsupport.labs.lab15_megatron import bloom_stack_figure
from labsupport.models import MLPStack
from labsupport.parallel.context_parallel import Layout, ring_schedule
from labsupport.viz import clusters, collectives, dtypes, one_device, ranks, roofline, walls
from labsupport.viz import context_parallel as cp_figures
from labsupport.viz import data_parallel as dp_figures
from labsupport.viz import expert_parallel as ep_figures
from labsupport.viz import parameter_server as ps_figures
from labsupport.viz import pipeline as pipeline_figures
from labsupport.viz import reliability as reliability_figures
from labsupport.viz import sharding as sharding_figures
from labsupport.viz import tensor_parallel as tp_figures


def ranks_on_two_nodes():
    """Chapter 6: 2 nodes x 4 GPUs; global rank = node_rank x 4 + local_rank."""
    infos = [
        {"rank": global_rank(node, local, 4), "local_rank": local, "node_rank": node}
        for node in range(2)
        for local in range(4)
    ]
    ax = ranks.draw_ranks(infos, title="world_size = 8: two nodes, four processes each")
    return ax.figure


def checkpoint_memory(layers: int = 16, batch: int = 512, d: int = 64):
    """Chapter 4: an MLP stack's activation memory measured for segments of 1 to 16
    blocks (and none), next to the formulas."""
    stack, x = MLPStack(layers, d), torch.randn(batch, d)
    measured = {c: lab04_checkpointing.step_memory(stack, x, c) for c in (None, 1, 2, 4, 8, 16)}
    return one_device.draw_checkpoint_memory(measured, layers, batch, d)


def fp8_errors():
    """Chapter 4: a linear layer's error on ordinary tokens in bf16 and in FP8, with one
    scale per tensor and with DeepSeek-V3's blocks, as a few tokens' outliers grow."""
    return one_device.draw_fp8_errors(lab04_fp8.error_table(lab04_fp8.SWEEP))


# --------------------------------------------------------------------------- chapters 7, 8


def collectives_before_after():
    """Chapter 7: the eight primitives on 4 ranks, run for real by labsupport.comm
    (and checked against torch.distributed) through labsupport.launch, on the chapter's
    running example, rank r holding [1, 2, 3, 4] x 10^r."""
    runs = {}
    for name in lab07_collectives.PRIMITIVES:
        runs[name] = launch(lab07_collectives.run_primitive, 4, args=(name,), timeout=120)
        lab07_collectives.agreement(runs[name], name)
    return collectives.collectives_figure(runs)


def ring_all_reduce_steps():
    """Chapter 8: the ring all-reduce on 4 ranks, from the schedule the code runs."""
    return collectives.draw_ring_allreduce(4)


# --------------------------------------------------------------------------- chapter 18


@functools.cache
def routed_top2() -> list[dict]:
    """Lab 18's top-2 layer on 4 ranks, routed exactly (dyadic numbers): each rank's
    result, run once for both figures that draw it."""
    return [r["top-2, dropless"] for r in launch(lab18_moe.compare_all, 4, timeout=240)]


def total_and_active():
    """Chapter 18: Mixtral 8x7B and DeepSeek-V3, counted from their configurations."""
    models = {}
    for name, config in (
        ("Mixtral 8x7B", moe_estimate.MIXTRAL_8X7B),
        ("DeepSeek-V3", moe_estimate.DEEPSEEK_V3),
    ):
        counts = moe_estimate.moe_params(config)
        models[name] = counts | {"top_k": config["top_k"], "n_expert": config["n_expert"]}
    return ep_figures.draw_total_active(models)


def rows_per_expert():
    """Chapter 18: the rows each expert of lab 18's top-2 layer gets, by source rank."""
    return ep_figures.draw_tokens_per_expert([r["kept"] for r in routed_top2()])


def dispatch():
    """Chapter 18: the dispatch all-to-all of lab 18's top-2 layer, from its split sizes."""
    return ep_figures.draw_dispatch([r["sent"] for r in routed_top2()])


FIGURES = {
    "06-ranks.png": ranks_on_two_nodes,
    "05-alpha-beta.png": clusters.alpha_beta_regimes,
    "05-rails.png": clusters.rail_topology,
    "07-collectives.png": collectives_before_after,
    "08-ring.png": ring_all_reduce_steps,
    "03-memory.png": walls.memory_breakdown_figure,
    "03-time-to-train.png": walls.time_to_train_figure,
    "02-dtypes.png": dtypes.dtype_layouts,
    "02-range.png": dtypes.range_and_precision,
    "04-mixed-precision.png": one_device.mixed_precision_loop_figure,
    "04-checkpointing.png": checkpoint_memory,
    "04-fp8.png": fp8_errors,
    "01-roofline.png": roofline.datasheet_rooflines,
    "01-hierarchy.png": roofline.memory_hierarchy,
    "13-mesh.png": sharding_figures.mesh_orders_figure,
    "13-planner.png": sharding_figures.published_breakdown_figure,
    "14-zero.png": sharding_figures.zero_memory_figure,
    "15-stack.png": bloom_stack_figure,
    "16-failures.png": reliability_figures.failures_figure,
    "09-sync-async.png": ps_figures.sync_async_figure,
    "09-server-traffic.png": ps_figures.server_traffic_figure,
    "10-overlap.png": dp_figures.overlap_figure,
    "11-schedules.png": pipeline_figures.schedules_figure,
    "11-held.png": pipeline_figures.held_figure,
    "11-bubble.png": pipeline_figures.bubble_figure,
    "11-zero-bubble.png": pipeline_figures.zero_bubble_figure,
    "12-split.png": tp_figures.draw_linear_split,
    "12-block.png": tp_figures.draw_block,
    "12-cost.png": lambda: tp_figures.draw_layer_costs(
        layer_costs(), "GPT-3 175B on H100s, per GPU (modelled, not measured)"
    ),
    "12-activations.png": tp_figures.draw_activations,
    "12-sequence-parallel.png": tp_figures.draw_sequence_parallel_shapes,
    "17-balance.png": cp_figures.balance_figure,
    "17-ring.png": lambda: cp_figures.ring_steps_figure(ring_schedule(Layout.zigzag(4)), 8),
    "17-variants.png": cp_figures.variants_figure,
    "17-memory.png": cp_figures.memory_figure,
    "18-params.png": total_and_active,
    "18-imbalance.png": rows_per_expert,
    "18-dispatch.png": dispatch,
}


# --------------------------------------------------------------------------- text size

#: The page's small print, in CSS pixels: its code, inline and in blocks (0.875 x 16 px).
SMALL_PRINT_PX = 14
#: How wide a chapter figure is drawn at ``:width: 100%`` in a 1280 px window: the book
#: theme's text column (676 px) less the figure's margins. tests/browser/test_site.py
#: checks both numbers on the built site.
PAGE_PX = 660
CHAPTERS = Path(__file__).resolve().parents[1] / "chapters"


def shown_widths() -> dict[str, float]:
    """Each chapter figure's width on the page, in CSS pixels at a 1280 px window, from
    its ``{figure}`` directive's ``:width:`` (100 % without one)."""
    found = {}
    for chapter in sorted(CHAPTERS.glob("*.md")):
        for m in re.finditer(r"```\{figure\} figures/(\S+)\n((?::.*\n)*)", chapter.read_text()):
            width = re.search(r"^:width: (\d+)%", m.group(2), re.MULTILINE)
            found[m.group(1)] = PAGE_PX * (int(width.group(1)) if width else 100) / 100
    return found


def text_on_the_page(fig, png_px: int, shown_px: float) -> list[tuple[float, str]]:
    """Every piece of text ``fig`` draws, as ``(size in CSS px, text)`` when its PNG,
    ``png_px`` wide, is shown ``shown_px`` wide: points at the figure's dpi, scaled."""
    fig.canvas.draw()
    renderer = fig.canvas.get_renderer()
    scale = fig.dpi / 72 * shown_px / png_px
    return [
        (text.get_fontsize() * scale, text.get_text())
        for text in fig.findobj(Text)
        if text.get_visible()
        and text.get_text().strip()
        and text.get_window_extent(renderer).width > 0
    ]


def save(fig, path: Path) -> None:
    fig.savefig(path, metadata={"Software": None}, bbox_inches="tight")
    plt.close(fig)


def main(outdir: str) -> None:
    out = Path(outdir)
    out.mkdir(parents=True, exist_ok=True)
    for name, make in FIGURES.items():
        save(make(), out / name)
        print(f"wrote {out / name}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "chapters/figures")
