"""Published layouts, with the models and clusters they ran on, for the planner.

Each entry says what its source says; where the source leaves a setting open (the
micro-batch of the trillion-parameter run, the number of interleaved chunks), the entry
takes a stated value (``assumed``), never the planner's fastest. :func:`as_published`
evaluates an entry as published, :func:`check` also ranks its mesh among the planner's.

* **BLOOM-176B** (BigScience 2022): the training script ``tr11-176B-ml.slurm`` and its
  README in ``bigscience-workshop/bigscience/train/tr11-176B-ml``: 48 nodes of 8 A100
  80GB on Jean Zay, TP 4, PP 12, DP 8, micro-batch 2, global batch 2,048 sequences of
  2,048 tokens, bf16 with DeepSpeed's BF16 optimizer ("its own ZeRO stage 1
  equivalent"), full activation checkpointing, no interleaving (DeepSpeed's pipeline);
  4 Omni-Path 100 Gb/s links per node; 149.8 TFLOP/s per GPU logged at the end of the
  first epoch, counted with recomputation (8 FLOPs per parameter and token). The entry
  models the data axis as ZeRO-1 with nothing overlapped (``zero=1, dp_overlap=False``: a
  reduce-scatter and an all-gather after the last backward pass). DeepSpeed's BF16
  optimizer (``_bf16_reduce_grads`` in ``runtime/pipe/engine.py``, mid-2022) instead
  all-reduces the fp32 gradient buffer in bf16 after the last backward pass, steps Adam on
  its shard and all-gathers the bf16 weights, none of it overlapped: under the planner's
  cost model half as much again (3.3 s instead of 2.2 s per step).
* **GPT-3 175B** (Narayanan et al. 2021, table 2, PTD parallelism on 1,536 GPUs): model
  parallel size 96 (tensor 8 inside a DGX A100, pipeline 12), data 16, global batch
  1,536, micro-batch 1, 141 TFLOP/s per GPU; Selene: 8 A100 80GB per node with NVSwitch,
  8 HDR 200 Gb/s InfiniBand adapters per node; activation recomputation, a plain
  data-parallel all-reduce after the pipeline flush; the paper does not say whether these
  rows used its interleaved schedule (the entry assumes not).
* **The 1T model** (Narayanan et al. 2021, table 1, last row): 128 layers, hidden 25,600,
  160 heads, TP 8, PP 64, 3,072 GPUs (DP 6), global batch 3,072, 163 TFLOP/s per GPU.
* **Llama 3 405B** (Grattafiori et al. 2024, table 4, 8K-token stage on 16,384 GPUs):
  TP 8, CP 1, PP 16, DP 128 (FSDP), 16 sequences of 8,192 per data-parallel group, 400
  TFLOP/s per GPU (41 % BF16 MFU); H100 80GB, 8 per server on NVLink, 400 Gb/s RoCE per
  GPU; no activation checkpointing; FSDP shards the optimizer states and gradients and
  keeps the gathered weights from forward to backward (ZeRO-2's memory); interleaved
  pipeline stages, their number per rank not given (the entry takes 2). The 8K stage on
  8,192 GPUs (DP 64, 32 sequences per group): 430 TFLOP/s (43 %). The 128K-token stage:
  TP 8, CP 16, PP 16, DP 8, 16 sequences of 131,072 per data-parallel group, 380 TFLOP/s
  (38 %); context parallelism all-gathers keys and values (section 3.3.2).
* **DeepSeek-V3** (DeepSeek-AI 2024, sections 3.1, 3.2 and 4.2): 2,048 H800 GPUs, 8 per
  node on NVLink (400 GB/s), 400 Gb/s InfiniBand per GPU; PP 16 with DualPipe (its bubble
  about half of 1F1B's: the entry takes 2 chunks), EP 64 over 8 nodes, ZeRO-1 data
  parallelism, no tensor parallelism; FP8 GEMMs, all-to-alls overlapped with compute,
  RMSNorm and MLA's up-projections recomputed (taken as ``"selective"``); sequences of
  4,096, a global batch of 15,360 at the end of its ramp; 180K H800 GPU hours per trillion
  tokens (section 1): 1,543 tokens/s per GPU, counted here as model FLOPs per second.

Where a source leaves a setting open, the entry takes a stated value (``assumed``), the
same one for every run of a framework; the throughput it is checked against is the
source's.
"""

from __future__ import annotations

from dataclasses import replace

from labsupport.estimate.datasheets import link, per_direction
from labsupport.estimate.moe import DEEPSEEK_V3, attention_params
from labsupport.estimate.planner import Cluster, Layout, Transformer, best_per_mesh, evaluate, plan
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
    "DeepSeek-V3": Transformer(
        "DeepSeek-V3",
        61,
        7168,
        128,
        4096,
        129280,
        ffn=18432,
        family="llama",
        positions=False,
        tied=False,
        head_dim=192,
        v_head_dim=128,
        attention_weights=attention_params(7168, DEEPSEEK_V3["attention"]),
        n_expert=256,
        top_k=8,
        expert_ffn=2048,
        n_shared=1,
        dense_layers=3,
    ),
}
"""Shapes: BLOOM from its README (vocabulary padded to 250,880, ALiBi positions);
GPT-3 and the 1T model as Narayanan et al. 2021 train them (vocabulary 51,200, sequence
2,048); Llama 3 405B from Grattafiori et al. 2024, table 3; DeepSeek-V3 from
:data:`labsupport.estimate.moe.DEEPSEEK_V3` (multi-head latent attention's weights from
:func:`~labsupport.estimate.moe.attention_params`, its heads' query-key width 192 and value
width 128)."""

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
    "DeepSeek, 2,048 H800": Cluster(
        "DeepSeek, 256 nodes of 8 H800",
        "H800 SXM",
        2048,
        8,
        per_direction(400, "GB/s bidirectional"),  # the H800's NVLink
        link("InfiniBand NDR")["gb_per_s"] * GB,  # 400 Gb/s per GPU
    ),
}

FRAMEWORKS = {
    "Megatron-LM and DeepSpeed, 2021-22": {
        "recompute": "full",
        "sequence_parallel": False,
        "dp_overlap": False,
        "fused_attention": False,
    },
    "Llama 3 (PyTorch FSDP)": {"dp_overlap": True, "fused_attention": True},
    "DeepSeek-V3 (HAI-LLM)": {
        "sequence_parallel": False,
        "dp_overlap": True,
        "a2a_overlap": True,
        "fused_attention": True,
        "fp8": True,
    },
}
"""What each framework did, as layout settings. Megatron-LM and DeepSpeed in 2021-22: full
recomputation, no sequence parallelism (2022), gradients reduced after the pipeline flush
(Megatron-LM's ``allreduce_gradients`` after ``forward_backward_func``; DeepSpeed's BF16
optimizer after the last backward pass), a fused softmax but no FlashAttention (2022).
Llama 3: FSDP's reduce-scatters overlapped with the backward pass, FlashAttention.
DeepSeek-V3: DualPipe's overlap of the all-to-alls with computation, FP8 GEMMs (its
sections 3.2 and 3.3)."""

MEGATRON_2021 = FRAMEWORKS["Megatron-LM and DeepSpeed, 2021-22"]
LLAMA_3 = FRAMEWORKS["Llama 3 (PyTorch FSDP)"]
DEEPSEEK = FRAMEWORKS["DeepSeek-V3 (HAI-LLM)"]

PUBLISHED = [
    {
        "name": "BLOOM-176B",
        "model": "BLOOM-176B",
        "cluster": "Jean Zay (BLOOM)",
        "global_batch": 2048,
        # zero=1 stands for the BF16 optimizer's sharded step; its collectives differ (above)
        "layout": Layout(8, 4, 12, zero=1, micro_batch=2, **MEGATRON_2021),
        "tflops": 149.8,
        "counted": "with recomputation",
        "source": "BigScience tr11-176B-ml README and slurm script",
    },
    {
        "name": "GPT-3 175B",
        "model": "GPT-3 175B",
        "cluster": "Selene, 1,536 GPUs",
        "global_batch": 1536,
        "layout": Layout(16, 8, 12, zero=0, micro_batch=1, **MEGATRON_2021),
        "assumed": "no interleaving",
        "tflops": 141,
        "counted": "with recomputation",
        "source": "Narayanan et al. 2021, table 2",
    },
    {
        "name": "GPT 1T",
        "model": "GPT 1T",
        "cluster": "Selene, 3,072 GPUs",
        "global_batch": 3072,
        "layout": Layout(6, 8, 64, zero=0, **MEGATRON_2021),
        "assumed": "micro-batch 1, no interleaving",
        "tflops": 163,
        "counted": "with recomputation",
        "source": "Narayanan et al. 2021, table 1",
    },
    {
        "name": "Llama 3 405B",
        "model": "Llama 3 405B",
        "cluster": "Meta RoCE, 16,384 H100",
        "global_batch": 2048,
        "layout": Layout(128, 8, 16, zero=2, chunks=2, **LLAMA_3),
        "assumed": "2 chunks per pipeline rank",
        "tflops": 400,
        "counted": "model FLOPs (MFU)",
        "source": "Grattafiori et al. 2024, table 4",
    },
    {
        "name": "Llama 3 405B, 8,192 GPUs",
        "model": "Llama 3 405B",
        "cluster": "Meta RoCE, 16,384 H100",
        "gpus": 8192,
        "global_batch": 2048,
        "layout": Layout(64, 8, 16, zero=2, chunks=2, **LLAMA_3),
        "assumed": "2 chunks per pipeline rank",
        "tflops": 430,
        "counted": "model FLOPs (MFU)",
        "source": "Grattafiori et al. 2024, table 4",
    },
    {
        "name": "Llama 3 405B, 128K",
        "model": "Llama 3 405B, 128K",
        "cluster": "Meta RoCE, 16,384 H100",
        "global_batch": 128,
        "layout": Layout(8, 8, 16, zero=2, chunks=2, cp=16, **LLAMA_3),
        "assumed": "2 chunks per pipeline rank",
        "tflops": 380,
        "counted": "model FLOPs (MFU)",
        "source": "Grattafiori et al. 2024, table 4",
    },
    {
        "name": "DeepSeek-V3",
        "model": "DeepSeek-V3",
        "cluster": "DeepSeek, 2,048 H800",
        "global_batch": 15360,
        "layout": Layout(128, 1, 16, zero=1, chunks=2, ep=64, **DEEPSEEK),
        "assumed": "micro-batch 1; DualPipe as 2 chunks",
        "tokens_per_s": 1e12 / (180e3 * 3600),
        "counted": "model FLOPs (from tokens/s)",
        "source": "DeepSeek-AI 2024, sections 1 and 3",
    },
]
"""The published runs the chapter checks the planner against; ``assumed`` names the
settings the source does not give and the value the entry takes."""

MODELS["Llama 3 405B, 128K"] = replace(MODELS["Llama 3 405B"], seq_len=131072)
PUBLISHED[-1]["tflops"] = (
    MODELS["DeepSeek-V3"].flops_per_token("none") * PUBLISHED[-1]["tokens_per_s"] / 1e12
)


def as_published(entry: dict, eff=None) -> dict:
    """:func:`~labsupport.estimate.planner.evaluate` of ``entry``'s layout as published."""
    cluster = CLUSTERS[entry["cluster"]]
    cluster = replace(cluster, gpus=entry.get("gpus", cluster.gpus))
    return evaluate(MODELS[entry["model"]], cluster, entry["layout"], entry["global_batch"], eff)


def check(entry: dict, eff=None) -> dict:
    """The planner on a published run: its layout as published (``published``, with
    ``fits``), and where its mesh ranks among every feasible mesh's best layout (the
    framework's settings and context parallelism as published)."""
    model, cluster = MODELS[entry["model"]], CLUSTERS[entry["cluster"]]
    cluster = replace(cluster, gpus=entry.get("gpus", cluster.gpus))
    batch, layout = entry["global_batch"], entry["layout"]
    same = ("cp", "dp_overlap", "a2a_overlap", "fused_attention", "fp8", "sequence_parallel")
    settings = {k: (getattr(layout, k),) for k in same}
    settings["sequence_parallel"] = (True,) if layout.sequence_parallel else (False,)
    meshes = best_per_mesh(plan(model, cluster, batch, eff, **settings))
    order = [r["layout"].axes for r in meshes]
    found = layout.axes in order
    return {
        "published": as_published(entry, eff),
        "rank": order.index(layout.axes) + 1 if found else None,
        "meshes": meshes,
        "mesh_best": meshes[order.index(layout.axes)] if found else None,
    }
