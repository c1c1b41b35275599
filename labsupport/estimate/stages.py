"""Pipeline stages: their layers, parameters, micro-batches in flight and memory per GPU,
for :mod:`labsupport.estimate.planner`.

The first stage holds the embedding and one layer less (pipelines count the embedding and
the output layer as a layer each when they balance the stages: BLOOM's
``type:transformer|embedding``, Llama 3's first and last stages one layer short). Model
states are 16 bytes per parameter (:func:`labsupport.estimate.memory.training_memory`),
activations counted from the architecture
(:meth:`labsupport.estimate.architecture.Transformer.activation_bytes`).
"""

from __future__ import annotations

import math

from labsupport.estimate.architecture import Transformer
from labsupport.estimate.layout import Layout
from labsupport.estimate.memory import training_memory


def units(model: Transformer, pp: int) -> int:
    """Layers per pipeline rank, the embedding and the output layer counted as layers:
    interleaving cuts them into at most this many chunks."""
    return math.ceil((model.layers + 2) / pp)


def stage_layers(model: Transformer, pp: int, stage: int = 0) -> int:
    """Transformer layers on pipeline ``stage``: ``ceil((L + 2) / p) - 1`` on the first
    (which also holds the embedding), ``ceil((L + 2) / p)`` on a middle one."""
    if pp == 1:
        return model.layers
    return units(model, pp) - (1 if stage in (0, pp - 1) else 0)


def _stage_split(model: Transformer, pp: int, stage: int) -> tuple:
    """Dense and MoE layers of ``stage`` (the dense layers come first)."""
    per_stage, layers = units(model, pp), stage_layers(model, pp, stage)
    first = 0 if stage == 0 else stage * per_stage - 1
    dense = max(0, min(model.layers - model.moe_layers - first, layers))
    return dense, layers - dense


def stage_params(model: Transformer, pp: int, stage: int = 0) -> dict:
    """Parameters of pipeline ``stage``: ``{"dense", "experts"}``, the routed experts
    apart (expert parallelism divides them); the first stage holds the embedding."""
    if pp == 1:
        experts = model.expert_params()
        return {"dense": model.params() - experts, "experts": experts}
    dense, moe = _stage_split(model, pp, stage)
    experts = moe * model.n_expert * 3 * model.hidden * model.expert_ffn
    total = dense * model.layer_params() + moe * model.layer_params(True)
    total += model.embedding_params() if stage == 0 else 0
    return {"dense": total - experts, "experts": experts}


def in_flight(pp: int, m: int, v: int) -> float:
    """Micro-batches whose activations the first stage holds at once, in units of its
    whole stage: ``min(p, m)`` with 1F1B; interleaved, ``2(p-1) + (v-1)p + 1`` chunks of
    ``1/v`` stage each (Megatron's warm-up), at most all ``m·v`` of them."""
    if v == 1:
        return min(pp, m)
    return min(2 * (pp - 1) + (v - 1) * pp + 1, m * v) / v


def state_parts(params: dict, layout: Layout) -> dict:
    """Model-state bytes by part (:func:`~labsupport.estimate.memory.training_memory`'s):
    dense parameters over ``tp``, ZeRO over the ``dp·cp`` ranks that hold the same ones;
    routed experts over ``ep``, ZeRO over the ``dp·cp/ep`` replicas."""
    replicas = layout.dp * layout.cp
    dense = training_memory(params["dense"] / layout.tp, "mixed", layout.zero, replicas)
    experts = training_memory(
        params["experts"] / layout.ep, "mixed", layout.zero, replicas // layout.ep
    )
    return {part: dense[part] + experts[part] for part in dense}


def stage_memory(model: Transformer, layout: Layout, global_batch: int, stage: int = 0) -> dict:
    """Bytes per GPU of pipeline ``stage``: its model states by part (:func:`state_parts`)
    and ``activations``, those of the micro-batches it holds at once."""
    t, sp, b = layout.tp, layout.sequence_parallel, layout.micro_batch
    tokens = b * model.seq_len / layout.cp
    m = global_batch // (layout.dp * b)

    def per_layer(policy, moe):
        kept = model.activation_bytes(policy, t, sp, layout.fused_attention, moe)
        return kept * tokens

    dense, moe = _stage_split(model, layout.pp, stage)
    if layout.pp == 1:
        dense, moe = model.layers - model.moe_layers, model.moe_layers
    parts = state_parts(stage_params(model, layout.pp, stage), layout)
    if layout.recompute == "full":  # each layer's input, and one layer rerun at a time
        kept = (dense + moe) * per_layer("full", False)
        working = per_layer("selective", moe > 0)
    else:
        kept = dense * per_layer(layout.recompute, False)
        kept += moe * per_layer(layout.recompute, True)
        working = 0
    flight = in_flight(layout.pp - stage, m, layout.chunks)
    return parts | {"activations": flight * kept + working}


def heaviest_stage(model: Transformer, layout: Layout, global_batch: int) -> tuple:
    """The pipeline stage that holds the most bytes per GPU, and its
    :func:`stage_memory`: the first, or for an MoE model possibly the second, whose
    layers all hold experts."""
    stages = [0] if layout.pp == 1 or not model.n_expert else [0, 1]
    found = [(s, stage_memory(model, layout, global_batch, s)) for s in stages]
    return max(found, key=lambda f: sum(f[1].values()))


def memory(model: Transformer, layout: Layout, global_batch: int) -> dict:
    """Bytes per GPU of the heaviest pipeline stage (:func:`heaviest_stage`): ``states``
    and ``activations``."""
    parts = dict(heaviest_stage(model, layout, global_batch)[1])
    activations = parts.pop("activations")
    return {"states": sum(parts.values()), "activations": activations}
