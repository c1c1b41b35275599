"""The planner: which layout trains a transformer fastest on a cluster, and fits.

A layout is a mesh of data- x tensor- x context- x pipeline-parallel ranks
``(dp, tp, cp, pp)``, with expert parallelism ``ep`` inside the data x context ranks, a
ZeRO stage on the data axis, a micro-batch size, interleaved chunks per pipeline rank, a
recomputation policy, and what the framework overlaps. :func:`plan` enumerates them,
:func:`evaluate` predicts for each, per GPU:

* **memory**: the model states of the heaviest pipeline stage, split over the
  tensor-parallel group (the routed experts over the expert-parallel group) and sharded
  as the ZeRO stage says (:func:`labsupport.estimate.memory.training_memory`, 16 bytes
  per parameter), plus the activations of the micro-batches the stage holds at once,
  counted from the architecture (:meth:`~labsupport.estimate.architecture.Transformer.
  activation_bytes`) on the ``b·s/cp`` tokens a GPU holds. Pipelines count the embedding
  and the output layer as a layer each when they balance the stages (BLOOM's
  ``type:transformer|embedding``, Llama 3's first and last stages one layer short). The
  layout fits under :data:`USABLE_MEMORY` of the memory the GPU reports
  (:data:`labsupport.estimate.compute.REPORTED_MEMORY`).
* **step time**: each layer's GEMMs from their shapes against the roofline, with the
  fitted efficiency model (:mod:`labsupport.estimate.compute`,
  :mod:`labsupport.estimate.calibration`), plus what communication does not hide
  (Narayanan et al. 2021, section 3): tensor parallelism's all-reduces inside every layer,
  context parallelism's all-gathers of keys and values (Llama 3's variant,
  :func:`labsupport.estimate.context_parallel.bytes_per_rank`), expert parallelism's
  all-to-alls (:func:`labsupport.estimate.moe.balanced_all_to_all_bytes`) unless the
  framework overlaps them (``a2a_overlap``, DeepSeek's DualPipe), the pipeline's bubble
  ``(p-1)/(v·m)`` and its messages, and the data-parallel collectives: after the pipeline
  flush (``dp_overlap=False``, Megatron-LM and DeepSpeed in 2021-22) or hidden behind the
  last backward pass as far as they fit (PyTorch DDP and FSDP, Megatron-LM's
  ``--overlap-grad-reduce``). Collectives are timed with the alpha-beta model
  (:mod:`labsupport.comm.cost`) over NVLink when the group fits in a node.

Ranks are numbered tensor-parallel fastest, then context, data and pipeline (Megatron's
``tp-cp-dp-pp``); an expert-parallel group is ``ep`` consecutive data-parallel ranks.
:mod:`labsupport.estimate.published` holds the models, clusters and published runs.
"""

from __future__ import annotations

import itertools

from labsupport.estimate.architecture import Transformer
from labsupport.estimate.compute import REPORTED_MEMORY, gpu_spec
from labsupport.estimate.layout import Cluster, Layout
from labsupport.estimate.stages import in_flight, memory, stage_layers, stage_params, units
from labsupport.estimate.step import step_time

__all__ = [
    "Cluster",
    "Layout",
    "Transformer",
    "best_per_mesh",
    "evaluate",
    "in_flight",
    "layouts",
    "memory",
    "plan",
    "stage_layers",
    "stage_params",
    "step_time",
]

USABLE_MEMORY = 0.9
"""Share of the memory a GPU reports that the planner lets a layout fill; the rest is left
to CUDA's context, the allocator's fragmentation, workspaces and communication buffers (an
assumption)."""


def evaluate(
    model: Transformer, cluster: Cluster, layout: Layout, global_batch: int, eff=None
) -> dict:
    """Memory and step time of ``layout``, whether it fits, and its throughput per GPU:
    ``tflops`` counts every FLOP the GPUs run (recomputation included, as Megatron and
    BLOOM's logs do), ``model_tflops`` and ``mfu`` only the model's (as MFU does)."""
    mem = memory(model, layout, global_batch)
    parts = step_time(model, cluster, layout, global_batch, eff)
    seconds = sum(parts.values())
    spec = gpu_spec(cluster.gpu)
    per_gpu_s = seconds * cluster.gpus / (global_batch * model.seq_len)  # GPU-seconds/token
    capacity = REPORTED_MEMORY.get(cluster.gpu, spec["memory_bytes"])
    return {
        "layout": layout,
        "memory": sum(mem.values()),
        "states": mem["states"],
        "fits": sum(mem.values()) <= USABLE_MEMORY * capacity,
        "parts": parts,
        "step_s": seconds,
        "tokens_per_s": global_batch * model.seq_len / seconds / cluster.gpus,
        "tflops": model.flops_per_token(layout.recompute) / per_gpu_s / 1e12,
        "model_tflops": model.flops_per_token("none") / per_gpu_s / 1e12,
        "mfu": model.flops_per_token("none") / per_gpu_s / spec["tensor"],
    }


DEFAULTS = {
    "zero": (0, 1, 2, 3),
    "micro_batch": (1, 2, 4),
    "chunks": (1, 2, 4, 8),
    "recompute": ("none", "selective", "full"),
    "sequence_parallel": (True,),
    "cp": (1,),
    "dp_overlap": (True,),
    "a2a_overlap": (False,),
    "fused_attention": (True,),
    "fp8": (False,),
}
"""What :func:`layouts` tries by default besides the mesh's sizes; the framework's
settings (``dp_overlap``, ``a2a_overlap``, ``fused_attention``, ``fp8``) are one value
each, assumptions a caller can change."""


def layouts(model: Transformer, cluster: Cluster, global_batch: int, **choices):
    """Every layout of ``cluster.gpus`` GPUs that splits the model and the batch evenly.

    ``choices`` narrow or widen the search, each a tuple of values: ``tp``, ``pp``,
    ``cp``, ``ep`` and the fields of :data:`DEFAULTS`. By default tensor parallelism stays
    inside a node and divides the heads and the key-value heads, every stage keeps at
    least one layer per chunk, the global batch divides into micro-batches, and an MoE
    model's experts spread over any expert-parallel size that divides them and the
    data-parallel group."""
    n = cluster.gpus
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and model.splits_heads(t)]
    eps = (
        [e for e in (1, 2, 4, 8, 16, 32, 64, 128, 256) if not model.n_expert % e]
        if model.n_expert
        else [1]
    )
    options = (
        DEFAULTS
        | {"tp": tps, "pp": [p for p in range(1, model.layers + 1) if n % p == 0], "ep": eps}
        | choices
    )
    fields = list(DEFAULTS)
    for t, p, cp in itertools.product(options["tp"], options["pp"], options["cp"]):
        if n % (t * p * cp):
            continue
        dp = n // (t * p * cp)
        for ep, *rest in itertools.product(
            options["ep"], *(options[f] for f in fields if f != "cp")
        ):
            lay = dict(zip([f for f in fields if f != "cp"], rest, strict=True))
            b, v = lay["micro_batch"], lay["chunks"]
            if global_batch % (dp * b) or (v > 1 and (p == 1 or v > units(model, p))):
                continue
            if (dp * cp) % ep:
                continue
            lay["sequence_parallel"] = lay["sequence_parallel"] and t > 1
            yield Layout(dp, t, p, cp=cp, ep=ep, **lay)


def plan(model: Transformer, cluster: Cluster, global_batch: int, eff=None, **choices) -> list:
    """Every layout that fits (:func:`layouts`, :func:`evaluate`), fastest first."""
    results = (
        evaluate(model, cluster, lay, global_batch, eff)
        for lay in layouts(model, cluster, global_batch, **choices)
    )
    return sorted((r for r in results if r["fits"]), key=lambda r: r["step_s"])


def best_per_mesh(results: list[dict]) -> list[dict]:
    """The fastest layout of each mesh (``(dp, tp, cp, pp, ep)``), fastest first."""
    seen, best = set(), []
    for r in results:
        if r["layout"].axes not in seen:
            seen.add(r["layout"].axes)
            best.append(r)
    return best
