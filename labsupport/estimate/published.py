"""Published 3D layouts, with the models and clusters they ran on, for the planner.

Each entry says what its source says; where the source leaves a setting open (the
micro-batch of the trillion-parameter run, the number of interleaved chunks), the entry
leaves it to :func:`labsupport.estimate.planner.plan` and says so.

* **BLOOM-176B** (BigScience 2022): the training script ``tr11-176B-ml.slurm`` and its
  README in ``bigscience-workshop/bigscience/train/tr11-176B-ml``: 48 nodes of 8 A100
  80GB on Jean Zay, TP 4, PP 12, DP 8, micro-batch 2, global batch 2,048 sequences of
  2,048 tokens, bf16 with DeepSpeed's BF16 optimizer ("its own ZeRO stage 1
  equivalent"), full activation checkpointing, no interleaving (DeepSpeed's pipeline);
  4 Omni-Path 100 Gb/s links per node; 149.8 TFLOP/s per GPU logged at the end of the
  first epoch, counted with recomputation (8 FLOPs per parameter and token). The entry
  models the data axis as ZeRO-1 (``zero=1``: a reduce-scatter partly hidden behind the
  last backward pass, then an all-gather). DeepSpeed's BF16 optimizer (``_bf16_reduce_grads``
  in ``runtime/pipe/engine.py``, mid-2022) instead all-reduces the fp32 gradient buffer in
  bf16 after the last backward pass, steps Adam on its shard and all-gathers the bf16
  weights, none of it overlapped: under the planner's cost model about 1.6 s more per step
  (106.5 s instead of 104.9 s).
* **GPT-3 175B** (Narayanan et al. 2021, table 2, PTD parallelism on 1,536 GPUs): model
  parallel size 96 (tensor 8 inside a DGX A100, pipeline 12), data 16, global batch
  1,536, micro-batch 1, 141 TFLOP/s per GPU; Selene: 8 A100 80GB per node with NVSwitch,
  8 HDR 200 Gb/s InfiniBand adapters per node; the interleaved schedule (section 5.1),
  activation recomputation, plain data-parallel all-reduce.
* **The 1T model** (Narayanan et al. 2021, table 1, last row): 128 layers, hidden 25,600,
  160 heads, TP 8, PP 64, 3,072 GPUs (DP 6), global batch 3,072, 163 TFLOP/s per GPU.
* **Llama 3 405B** (Grattafiori et al. 2024, table 4, 8K-token stage on 16,384 GPUs):
  TP 8, CP 1, PP 16, DP 128 (FSDP), 16 sequences of 8,192 per data-parallel group, 400
  TFLOP/s per GPU (41 % BF16 MFU); H100 80GB, 8 per server on NVLink, 400 Gb/s RoCE per
  GPU; no activation checkpointing; FSDP shards the optimizer states and gradients and
  keeps the gathered weights from forward to backward (ZeRO-2's memory); interleaved
  pipeline stages.
"""

from __future__ import annotations

from labsupport.estimate.datasheets import link, per_direction
from labsupport.estimate.planner import Cluster, Layout, Transformer, best_per_mesh, plan
from labsupport.estimate.units import GB

MODELS = {
    "BLOOM-176B": Transformer("BLOOM-176B", 70, 14336, 112, 2048, 250880, positions=False),
    "GPT-3 175B": Transformer("GPT-3 175B", 96, 12288, 96, 2048, 51200),
    "GPT 1T": Transformer("GPT 1T", 128, 25600, 160, 2048, 51200),
    "Llama 3 405B": Transformer(
        "Llama 3 405B",
        126,
        16384,
        128,
        8192,
        128256,
        ffn=53248,
        kv_heads=8,
        family="llama",
        positions=False,
        tied=False,
    ),
}
"""Shapes: BLOOM from its README (vocabulary padded to 250,880, ALiBi positions);
GPT-3 and the 1T model as Narayanan et al. 2021 train them (vocabulary 51,200, sequence
2,048); Llama 3 405B from Grattafiori et al. 2024, table 3."""

NVLINK_A100 = link("NVLink 3 (A100)")["gb_per_s"] * GB
NVLINK_H100 = link("NVLink 4 (H100)")["gb_per_s"] * GB

CLUSTERS = {
    "Jean Zay (BLOOM)": Cluster(
        "Jean Zay, 48 nodes",
        "A100 SXM 80GB",
        384,
        8,
        NVLINK_A100,
        4 * per_direction(100, "Gb/s") / 8,  # 4 Omni-Path 100 Gb/s links per node
    ),
    "Selene, 1,536 GPUs": Cluster(
        "Selene, 192 DGX A100",
        "A100 SXM 80GB",
        1536,
        8,
        NVLINK_A100,
        link("InfiniBand HDR")["gb_per_s"] * GB,  # one HDR adapter per GPU
    ),
    "Selene, 3,072 GPUs": Cluster(
        "Selene, 384 DGX A100",
        "A100 SXM 80GB",
        3072,
        8,
        NVLINK_A100,
        link("InfiniBand HDR")["gb_per_s"] * GB,
    ),
    "Meta RoCE, 16,384 H100": Cluster(
        "Meta, 2,048 Grand Teton servers",
        "H100 SXM",
        16384,
        8,
        NVLINK_H100,
        link("RoCE 400 GbE")["gb_per_s"] * GB,  # 400 Gb/s per GPU
    ),
}

PUBLISHED = [
    {
        "model": "BLOOM-176B",
        "cluster": "Jean Zay (BLOOM)",
        "global_batch": 2048,
        # zero=1 stands for the BF16 optimizer's sharded step; its collectives differ (above)
        "layout": Layout(
            8, 4, 12, zero=1, micro_batch=2, chunks=1, recompute="full", sequence_parallel=False
        ),
        "tflops": 149.8,
        "counted": "with recomputation",
        "source": "BigScience tr11-176B-ml README and slurm script",
    },
    {
        "model": "GPT-3 175B",
        "cluster": "Selene, 1,536 GPUs",
        "global_batch": 1536,
        "layout": Layout(
            16, 8, 12, zero=0, micro_batch=1, recompute="full", sequence_parallel=False
        ),
        "open": {"chunks": (1, 2, 4, 8)},
        "tflops": 141,
        "counted": "with recomputation",
        "source": "Narayanan et al. 2021, table 2",
    },
    {
        "model": "GPT 1T",
        "cluster": "Selene, 3,072 GPUs",
        "global_batch": 3072,
        "layout": Layout(6, 8, 64, zero=0, recompute="full", sequence_parallel=False),
        "open": {"chunks": (1, 2), "micro_batch": (1, 2, 4)},
        "tflops": 163,
        "counted": "with recomputation",
        "source": "Narayanan et al. 2021, table 1",
    },
    {
        "model": "Llama 3 405B",
        "cluster": "Meta RoCE, 16,384 H100",
        "global_batch": 2048,
        "layout": Layout(128, 8, 16, zero=2, micro_batch=1, recompute="selective"),
        "open": {"chunks": (1, 2, 4, 8)},
        "tflops": 400,
        "counted": "model FLOPs (MFU)",
        "source": "Grattafiori et al. 2024, table 4",
    },
]
"""The published layouts; ``open`` lists the settings the source does not give, which
the planner chooses (the fastest that fits)."""


def check(entry: dict) -> dict:
    """The planner on a published run: its layout as published (the open settings chosen
    by the planner), and where its mesh ranks among every feasible mesh's best layout."""
    model, cluster = MODELS[entry["model"]], CLUSTERS[entry["cluster"]]
    batch, layout = entry["global_batch"], entry["layout"]
    fixed = {k: (getattr(layout, k),) for k in Layout.__dataclass_fields__ if k != "dp"}
    as_published = plan(model, cluster, batch, **(fixed | entry.get("open", {})))
    meshes = best_per_mesh(plan(model, cluster, batch))
    order = [r["layout"].mesh for r in meshes]
    return {
        "published": as_published[0] if as_published else None,
        "rank": order.index(layout.mesh) + 1 if layout.mesh in order else None,
        "meshes": meshes,
        "mesh_best": meshes[order.index(layout.mesh)] if layout.mesh in order else None,
    }
