"""The step time of a layout, by cause, for :mod:`labsupport.estimate.planner`.

Compute from each layer's GEMM shapes (:mod:`labsupport.estimate.compute`), plus what
communication does not hide (Narayanan et al. 2021, section 3): tensor parallelism's
all-reduces, context parallelism's all-gathers of keys and values (Llama 3's variant,
Grattafiori et al. 2024, section 3.3.2), expert parallelism's all-to-alls unless the
framework overlaps them (DeepSeek's DualPipe), the pipeline's messages and bubble, and the
data-parallel collectives of the ZeRO stage, after the pipeline flush or overlapped.
Each collective is timed with the alpha-beta model (:mod:`labsupport.comm.cost`), over
NVLink when its group fits in a node, over the network otherwise.
"""

from __future__ import annotations

from labsupport.estimate.architecture import Transformer
from labsupport.estimate.compute import FITTED, gpu_spec, layer_seconds, output_layer_seconds
from labsupport.estimate.context_parallel import bytes_per_rank
from labsupport.estimate.layout import Cluster, Layout
from labsupport.estimate.moe import balanced_all_to_all_bytes
from labsupport.estimate.stages import stage_params


def _beta(cluster: Cluster, stride: int, size: int) -> float:
    """Seconds per byte of a group of ``size`` ranks, ``stride`` ranks apart."""
    inside = stride * size <= cluster.gpus_per_node
    return 1 / (cluster.intra_node if inside else cluster.inter_node)


def ring_all_reduce_time(cluster, n, nbytes, stride) -> float:
    """A ring all-reduce of ``nbytes`` over ``n`` ranks ``stride`` apart in the alpha-beta
    model, ``2(n-1)·α + 2(n-1)/n·S·β``: :func:`labsupport.comm.cost.all_reduce_time`'s
    ring (a test checks they agree), here in plain Python so that the planner runs
    without NumPy or PyTorch (in a browser)."""
    if n == 1:
        return 0.0
    beta = _beta(cluster, stride, n)
    return 2 * (n - 1) * cluster.alpha + 2 * (n - 1) / n * nbytes * beta


def step_time(
    model: Transformer, cluster: Cluster, layout: Layout, global_batch: int, eff=None
) -> dict:
    """Seconds of one training step, by cause: compute, the tensor-, context- and
    expert-parallel collectives, the pipeline's messages and bubble, the exposed
    data-parallel collectives. ``eff``: the efficiency model (default
    :data:`labsupport.estimate.compute.FITTED`)."""
    eff = eff or FITTED
    dp, t, p, v, b, cp = (
        layout.dp,
        layout.tp,
        layout.pp,
        layout.chunks,
        layout.micro_batch,
        layout.cp,
    )
    s, h, a = model.seq_len, model.hidden, cluster.alpha
    m = global_batch // (dp * b)
    spec = gpu_spec(cluster.gpu)
    tokens = b * s / cp
    run = {
        "recompute": layout.recompute,
        "sequence_parallel": layout.sequence_parallel,
        "fused_attention": layout.fused_attention,
        "fp8": layout.fp8,
    }
    dense_layers = (model.layers - model.moe_layers) / p
    moe_layers = model.moe_layers / p
    slot = dense_layers * layer_seconds(model, tokens, spec, eff, tp=t, **run)["total"]
    if moe_layers:
        one = layer_seconds(model, tokens, spec, eff, tp=t, ep=layout.ep, moe=True, **run)
        slot += moe_layers * one["total"]
    slot += output_layer_seconds(model, tokens, spec, eff, t) / p
    compute = m * slot
    layers, activation = model.layers / p, 2 * tokens * h  # bf16 bytes of one micro-batch
    rerun = layout.recompute == "full"
    tp = 0.0
    if t > 1:  # 2 all-reduces forward, 2 backward per layer, 2 more if the forward reruns
        tp = m * layers * (6 if rerun else 4) * ring_all_reduce_time(cluster, t, activation, 1)
    context = 0.0
    if cp > 1:  # all-gather K, V forward; all-gather and reduce-scatter backward
        w = model.widths
        d = model.head_dim or h // model.heads
        kv_heads = w["k"] // d
        sent = bytes_per_rank("all_gather", b, s, model.heads, kv_heads, d, cp, 2, 2)
        total = sent["total"] + (sent["forward"] if rerun else 0)
        one = total / t * _beta(cluster, t, cp) + (3 + rerun) * (cp - 1) * a
        context = m * layers * one
    expert = 0.0
    if model.n_expert and layout.ep > 1 and not layout.a2a_overlap:
        sent = balanced_all_to_all_bytes(tokens, model.top_k, layout.ep, h, 2)
        sent *= 1.5 if rerun else 1  # the forward's dispatch and combine again
        one = sent * _beta(cluster, t * cp, layout.ep) + 4 * (layout.ep - 1) * a
        expert = m * moe_layers * one
    pp = 0.0
    if p > 1:  # an activation out and a gradient back per chunk, split over the TP ranks
        pp = m * 2 * v * (a + activation / t * _beta(cluster, t * cp * dp, p))
    bubble = (p - 1) / (v * m) * (compute + tp + context + expert + pp)
    params = stage_params(model, p)
    data = _data_parallel(cluster, layout, params, m, slot)
    return {
        "compute": compute,
        "tensor": tp,
        "context": context,
        "expert": expert,
        "pipeline": pp,
        "bubble": bubble,
        "data": data,
    }


def _data_parallel(cluster, layout, params, m, slot) -> float:
    """Exposed seconds of the data-parallel collectives of the ZeRO stage: the dense
    gradients over the ``dp·cp`` replicas, the experts' over their ``dp·cp/ep``. With
    ``dp_overlap`` a collective hides behind the micro-batch's pass beside it (the last
    backward for ZeRO-0 and 1, every backward for ZeRO-2, every pass for ZeRO-3's
    gathers); without, nothing hides (ZeRO-0 and 1 reduce after the pipeline flush)."""
    t, exposed = layout.tp, 0.0
    replicas = layout.dp * layout.cp
    groups = [
        (params["dense"] / t, replicas, t),
        (params["experts"] / layout.ep, replicas // layout.ep, t * layout.ep),
    ]
    for count, n, stride in groups:
        if n < 2 or not count:
            continue
        half = (
            ring_all_reduce_time(cluster, n, 2 * count, stride) / 2
        )  # bf16 gradients (and weights)
        forward, backward = slot / 3, 2 * slot / 3  # a reduce-scatter or an all-gather
        if not layout.dp_overlap:
            forward = backward = 0.0
        exposed += {
            0: max(0.0, 2 * half - backward),  # all-reduce beside the last backward
            1: max(0.0, half - backward) + half,  # reduce-scatter, then gather the update
            2: m * max(0.0, half - backward) + half,  # reduce-scatter every micro-batch
            3: m * (max(0.0, half - forward) + max(0.0, 2 * half - backward)),
        }[layout.zero]
    return exposed
