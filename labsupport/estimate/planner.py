"""The planner: which layout trains a transformer fastest on a cluster, and fits.

A layout is a data- x tensor- x pipeline-parallel mesh ``(dp, tp, pp)`` with a ZeRO stage
on the data axis, a micro-batch size, a number of interleaved chunks per pipeline rank
and a recomputation policy. :func:`plan` enumerates them, :func:`evaluate` predicts for
each, per GPU:

* **memory**: the model states of the heaviest pipeline stage, split over the
  tensor-parallel group and sharded over the data-parallel group as the ZeRO stage says
  (:func:`labsupport.estimate.memory.training_memory`, 16 bytes per parameter), plus the
  activations of the micro-batches the first stage holds at once (Korthikanti et al.
  2022, sections 4.1 and 4.2.3, :func:`labsupport.estimate.memory.activation_memory`).
  The first stage is the heaviest: it holds the embedding, and pipelines count the
  embedding and the output layer as a layer each when they balance the stages (BLOOM's
  ``type:transformer|embedding``, Llama 3's first and last stages one layer short).
* **step time**: the compute of the step at an assumed matmul efficiency, plus what
  communication does not hide (Narayanan et al. 2021, section 3): tensor parallelism's
  all-reduces inside every layer (not overlapped), the pipeline's bubble
  ``(p-1)/(v·m)`` and its point-to-point messages, and the data-parallel collectives of
  the ZeRO stage that outlast the backward pass they can overlap with. Each collective
  is timed with the alpha-beta model (:mod:`labsupport.comm.cost`) over NVLink when its
  group fits in a node, over the network otherwise.

Ranks are numbered tensor-parallel fastest, then data, then pipeline (Megatron's
``tp-dp-pp``, :class:`labsupport.parallel.parallel_state.Mesh`). Feasible layouts are
ranked by predicted step time. :mod:`labsupport.estimate.published` holds the models,
clusters and published layouts the chapter checks the planner against.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from labsupport.comm.cost import all_reduce_time
from labsupport.estimate.datasheets import ASSUMED_ALPHA, device_spec
from labsupport.estimate.memory import activation_memory, training_memory

ASSUMED_MATMUL_EFFICIENCY = 0.55
"""Share of the GPU's dense 16-bit peak that the model's matrix multiplications reach, an
assumption: the planner adds communication and the bubble on top, so this is higher than
a run's end-to-end MFU (Narayanan et al. 2021 report 52 % of peak end to end)."""

USABLE_MEMORY = 0.9
"""Share of a GPU's memory the planner lets a layout fill; the rest is left to the
allocator's fragmentation, workspaces and communication buffers (an assumption)."""


@dataclass(frozen=True)
class Transformer:
    """A decoder-only transformer's shape. ``family="gpt"``: GELU MLP of ``ffn`` (4h by
    default), biases and LayerNorms; ``"llama"``: SwiGLU (three matrices), no biases,
    RMSNorm, ``kv_heads`` for grouped-query attention. ``positions``: learned position
    embeddings; ``tied``: the output layer reuses the token embedding."""

    name: str
    layers: int
    hidden: int
    heads: int
    seq_len: int
    vocab: int
    ffn: int = 0
    kv_heads: int = 0
    family: str = "gpt"
    positions: bool = True
    tied: bool = True

    def layer_weights(self) -> int:
        """Weights of one layer's matrix multiplications."""
        h, ffn = self.hidden, self.ffn or 4 * self.hidden
        kv = h * (self.kv_heads or self.heads) // self.heads
        mlp = (3 if self.family == "llama" else 2) * h * ffn
        return 2 * h * h + 2 * h * kv + mlp

    def layer_params(self) -> int:
        h, ffn = self.hidden, self.ffn or 4 * self.hidden
        kv = h * (self.kv_heads or self.heads) // self.heads
        if self.family == "llama":
            return self.layer_weights() + 2 * h  # two RMSNorm weights
        return self.layer_weights() + (2 * h + 2 * kv) + (ffn + h) + 4 * h  # biases, norms

    def embedding_params(self) -> int:
        return self.vocab * self.hidden + (self.seq_len * self.hidden if self.positions else 0)

    def params(self) -> int:
        """All parameters: layers, embeddings, the final norm, an untied output layer."""
        norm = 2 * self.hidden if self.family == "gpt" else self.hidden
        output = 0 if self.tied else self.vocab * self.hidden
        return self.layers * self.layer_params() + self.embedding_params() + norm + output

    def flops_per_token(self, recompute: str = "none") -> float:
        """Training FLOPs per token: 6 per weight (forward 2, backward 4), attention's two
        s x s products (4·s·h forward per layer), the output layer; ``"full"``
        recomputation reruns each layer's forward, ``"selective"`` its attention products
        (FlashAttention's backward does the same). Narayanan et al. 2021, appendix."""
        weights, attention = 2 * self.layer_weights(), 4 * self.seq_len * self.hidden
        per_layer = 3 * (weights + attention)
        per_layer += {"none": 0, "selective": attention, "full": weights + attention}[recompute]
        return self.layers * per_layer + 6 * self.hidden * self.vocab


@dataclass(frozen=True)
class Cluster:
    """GPUs (a name of :data:`labsupport.estimate.datasheets.DEVICES`) in nodes; the
    bandwidths are bytes/s per GPU and direction, inside a node and across nodes."""

    name: str
    gpu: str
    gpus: int
    gpus_per_node: int
    intra_node: float
    inter_node: float
    alpha: float = ASSUMED_ALPHA


@dataclass(frozen=True)
class Layout:
    dp: int
    tp: int
    pp: int
    zero: int = 1
    micro_batch: int = 1
    chunks: int = 1  # v: interleaved model chunks per pipeline rank
    recompute: str = "selective"
    sequence_parallel: bool = True

    @property
    def mesh(self) -> tuple:
        return (self.dp, self.tp, self.pp)


def stage_layers(model: Transformer, pp: int) -> int:
    """Transformer layers on the first pipeline stage, which also holds the embedding:
    ``ceil((L + 2) / p) - 1`` (the embedding and the output layer count as a layer)."""
    return model.layers if pp == 1 else _units(model, pp) - 1


def stage_params(model: Transformer, pp: int) -> int:
    """Parameters of the first pipeline stage: its layers and the embedding."""
    if pp == 1:
        return model.params()
    return stage_layers(model, pp) * model.layer_params() + model.embedding_params()


def _units(model: Transformer, pp: int) -> int:
    """Layers per pipeline rank, the embedding and the output layer counted as layers:
    interleaving cuts them into at most this many chunks."""
    return math.ceil((model.layers + 2) / pp)


def in_flight(pp: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first stage holds at once, in units of its
    whole stage: ``min(p, m)`` with 1F1B; interleaved, ``2(p-1) + (v-1)p + 1`` chunks of
    ``1/v`` stage each (Megatron's warm-up), at most all ``m·v`` of them."""
    if v == 1:
        return min(pp, m)
    return min(2 * (pp - 1) + (v - 1) * pp + 1, m * v) / v


def memory(model: Transformer, layout: Layout, global_batch: int) -> dict:
    """Bytes per GPU of the first pipeline stage: ``states`` and ``activations``."""
    t, sp, b = layout.tp, layout.sequence_parallel, layout.micro_batch
    s, h = model.seq_len, model.hidden
    layers = stage_layers(model, layout.pp)
    params = stage_params(model, layout.pp) / t
    states = sum(training_memory(params, "mixed", layout.zero, layout.dp).values())
    m = global_batch // (layout.dp * b)

    def per_layer(policy):
        return activation_memory(
            s, b, h, model.heads, 1, policy, tensor_parallel=t, sequence_parallel=sp
        )

    if layout.recompute == "full":  # each layer's input, and one layer rerun at a time
        kept, working = per_layer("full"), per_layer("selective")
    else:
        kept, working = per_layer(layout.recompute), 0
    activations = in_flight(layout.pp, m, layout.chunks) * layers * kept + working
    return {"states": states, "activations": activations}


def _beta(cluster: Cluster, stride: int, size: int) -> float:
    """Seconds per byte of a group of ``size`` ranks, ``stride`` ranks apart."""
    inside = stride * size <= cluster.gpus_per_node
    return 1 / (cluster.intra_node if inside else cluster.inter_node)


def step_time(model: Transformer, cluster: Cluster, layout: Layout, global_batch: int) -> dict:
    """Seconds of one training step, by cause: compute, tensor-parallel all-reduces,
    the pipeline bubble and its messages, the exposed data-parallel collectives."""
    dp, t, p, v, b = layout.dp, layout.tp, layout.pp, layout.chunks, layout.micro_batch
    s, h, a = model.seq_len, model.hidden, cluster.alpha
    m = global_batch // (dp * b)
    spec = device_spec(cluster.gpu)
    tokens = global_batch * s
    compute = model.flops_per_token(layout.recompute) * tokens / cluster.gpus
    compute /= spec["tensor"] * ASSUMED_MATMUL_EFFICIENCY
    slot = compute / m  # one micro-batch's forward and backward on this rank
    layers, activation = stage_layers(model, p), 2 * b * s * h  # bf16 bytes
    tp = 0.0
    if t > 1:  # 2 all-reduces forward, 2 backward per layer, 2 more if the forward reruns
        count = 6 if layout.recompute == "full" else 4
        one = float(all_reduce_time("ring", t, activation, a, _beta(cluster, 1, t)))
        tp = m * layers * count * one
    pp = 0.0
    if p > 1:  # an activation out and a gradient back per chunk, split over the TP ranks
        pp = m * 2 * v * (a + activation / t * _beta(cluster, t * dp, p))
    bubble = (p - 1) / (v * m) * (compute + tp + pp)
    grads = 2 * stage_params(model, p) / t  # bf16 gradients (and weights) of this GPU
    half = float(all_reduce_time("ring", dp, grads, a, _beta(cluster, t, dp))) / 2
    forward, backward = slot / 3, 2 * slot / 3  # a reduce-scatter or an all-gather
    exposed = {
        0: max(0.0, 2 * half - backward),  # all-reduce beside the last backward
        1: max(0.0, half - backward) + half,  # reduce-scatter, then gather the update
        2: m * max(0.0, half - backward) + half,  # reduce-scatter every micro-batch
        3: m * (max(0.0, half - forward) + max(0.0, 2 * half - backward)),
    }[layout.zero]
    return {"compute": compute, "tensor": tp, "pipeline": pp, "bubble": bubble, "data": exposed}


def evaluate(model: Transformer, cluster: Cluster, layout: Layout, global_batch: int) -> dict:
    """Memory and step time of ``layout``, whether it fits, and its throughput per GPU:
    ``tflops`` counts every FLOP the GPUs run (recomputation included, as Megatron and
    BLOOM's logs do), ``model_tflops`` and ``mfu`` only the model's (as MFU does)."""
    mem = memory(model, layout, global_batch)
    parts = step_time(model, cluster, layout, global_batch)
    seconds = sum(parts.values())
    spec = device_spec(cluster.gpu)
    per_gpu_s = seconds * cluster.gpus / (global_batch * model.seq_len)  # GPU-seconds/token
    return {
        "layout": layout,
        "memory": sum(mem.values()),
        "states": mem["states"],
        "fits": sum(mem.values()) <= USABLE_MEMORY * spec["memory_bytes"],
        "parts": parts,
        "step_s": seconds,
        "tflops": model.flops_per_token(layout.recompute) / per_gpu_s / 1e12,
        "model_tflops": model.flops_per_token("none") / per_gpu_s / 1e12,
        "mfu": model.flops_per_token("none") / per_gpu_s / spec["tensor"],
    }


def layouts(model: Transformer, cluster: Cluster, global_batch: int, **choices):
    """Every layout of ``cluster.gpus`` GPUs that splits the model and the batch evenly.

    ``choices`` narrow the search: ``tp``, ``pp``, ``zero``, ``micro_batch``,
    ``chunks``, ``recompute``, ``sequence_parallel``, each a tuple of values. By default
    tensor parallelism stays inside a node and divides the heads, every stage keeps at
    least one layer per chunk, and the global batch divides into micro-batches."""
    n = cluster.gpus
    tps = [t for t in (1, 2, 4, 8, 16) if t <= cluster.gpus_per_node and model.heads % t == 0]
    options = {
        "tp": tps,
        "pp": [p for p in range(1, model.layers + 1) if n % p == 0],
        "zero": (0, 1, 2, 3),
        "micro_batch": (1, 2, 4),
        "chunks": (1, 2, 4, 8),
        "recompute": ("none", "selective", "full"),
        "sequence_parallel": (True,),
    } | choices
    for t, p in itertools.product(options["tp"], options["pp"]):
        if n % (t * p):
            continue
        dp = n // (t * p)
        for zero, b, v, rc, sp in itertools.product(
            options["zero"],
            options["micro_batch"],
            options["chunks"],
            options["recompute"],
            options["sequence_parallel"],
        ):
            if global_batch % (dp * b) or (v > 1 and (p == 1 or v > _units(model, p))):
                continue
            yield Layout(dp, t, p, zero, b, v, rc, sp and t > 1)


def plan(model: Transformer, cluster: Cluster, global_batch: int, **choices) -> list[dict]:
    """Every layout that fits (:func:`layouts`, :func:`evaluate`), fastest first."""
    results = (
        evaluate(model, cluster, lay, global_batch)
        for lay in layouts(model, cluster, global_batch, **choices)
    )
    return sorted((r for r in results if r["fits"]), key=lambda r: r["step_s"])


def best_per_mesh(results: list[dict]) -> list[dict]:
    """The fastest layout of each ``(dp, tp, pp)`` mesh, fastest first."""
    seen, best = set(), []
    for r in results:
        if r["layout"].mesh not in seen:
            seen.add(r["layout"].mesh)
            best.append(r)
    return best
