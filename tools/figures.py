"""The chapters' figures, drawn from code: ``python -m tools.figures chapters/figures``.

Each function returns a matplotlib figure; :func:`main` saves them all as PNG with no
timestamp in the file, so that regenerating a figure changes nothing unless its code
did (a test checks that the committed files match).
"""

from __future__ import annotations

import sys
from pathlib import Path

import matplotlib.pyplot as plt
import torch

from labsupport import launch
from labsupport.estimate.tensor_parallel import layer_costs
from labsupport.labs import lab04_checkpointing, lab04_fp8, lab07_collectives
from labsupport.labs.lab06_launching import global_rank
from labsupport.labs.lab15_megatron import bloom_stack_figure
from labsupport.models import MLPStack
from labsupport.viz import clusters, collectives, dtypes, one_device, ranks, roofline, walls
from labsupport.viz import data_parallel as dp_figures
from labsupport.viz import parameter_server as ps_figures
from labsupport.viz import pipeline as pipeline_figures
from labsupport.viz import reliability as reliability_figures
from labsupport.viz import sharding as sharding_figures
from labsupport.viz import tensor_parallel as tp_figures
from labsupport.viz.style import subplots


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
    fig, axes = subplots(4, 2, 11, 10)
    for ax, name in zip(axes.T.flat, lab07_collectives.PRIMITIVES, strict=True):
        results = launch(lab07_collectives.run_primitive, 4, args=(name,), timeout=120)
        lab07_collectives.agreement(results, name)
        collectives.draw_collective(results, name, ax=ax, width=4)
    return fig


def ring_all_reduce_steps():
    """Chapter 8: the ring all-reduce on 4 ranks, from the schedule the code runs."""
    return collectives.draw_ring_allreduce(4)


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
    "12-split.png": tp_figures.draw_linear_split,
    "12-block.png": tp_figures.draw_block,
    "12-cost.png": lambda: tp_figures.draw_layer_costs(
        layer_costs(), "GPT-3 175B on H100s, per GPU (modelled, not measured)"
    ),
    "12-activations.png": tp_figures.draw_activations,
}


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
