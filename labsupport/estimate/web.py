"""The website's calculators: what the page asks, answered by the planner's own functions.

The course's website runs this module in the reader's browser (Pyodide, no torch, no
numpy) behind two forms: memory per GPU, and the planner. It is the only module the page
calls, and it only translates: the page's inputs (plain names and numbers) into the
planner's :class:`~labsupport.estimate.planner.Transformer` and
:class:`~labsupport.estimate.planner.Layout`, and the answers of
:func:`~labsupport.estimate.planner.memory`,
:func:`~labsupport.estimate.memory.training_memory` and
:func:`~labsupport.estimate.planner.plan` into JSON the page draws. When the planner's
interface changes, this module is what follows it.

Memory per GPU is the planner's memory of the first pipeline stage (its heaviest), with
two axes the planner does not have yet:

* context parallelism over ``cp`` ranks: each rank holds ``s/cp`` tokens of every
  per-token activation, and the optimizer states are sharded over the data-parallel and
  context-parallel ranks together (Megatron-LM's distributed optimizer shards over
  ``dp·cp``). Attention then runs blockwise (FlashAttention), so no score matrix is kept:
  recomputation ``"none"`` is refused;
* expert parallelism over ``ep`` ranks: the planner's models are dense, so ``ep`` must be 1.
"""

from __future__ import annotations

import dataclasses
import json

from labsupport.estimate.datasheets import DEVICES
from labsupport.estimate.memory import training_memory
from labsupport.estimate.planner import (
    USABLE_MEMORY,
    Layout,
    Transformer,
    best_per_mesh,
    memory,
    plan,
    stage_layers,
    stage_params,
)
from labsupport.estimate.published import CLUSTERS, MODELS, PUBLISHED
from labsupport.models.recompute import RECOMPUTE

GPUS = [name for name, spec in DEVICES.items() if spec["kind"] == "GPU"]
#: GPT-2 small's shape (124M parameters, Radford et al. 2019) beside the published models.
PRESETS = {"GPT-2 124M": Transformer("GPT-2 124M", 12, 768, 12, 1024, 50257)} | MODELS
CUSTOM = ("layers", "hidden", "heads", "vocab")


def _int(inputs: dict, name: str, low: int = 1) -> int:
    value = inputs.get(name)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if number != float(value) or number < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
    return number


def model_from(inputs: dict) -> Transformer:
    """The preset ``inputs["model"]``, or ``"custom"`` with ``layers``, ``hidden``,
    ``heads``, ``vocab`` (a GPT), at ``seq_len`` tokens per sequence."""
    name = inputs.get("model", "custom")
    if name == "custom":
        sizes = {key: _int(inputs, key) for key in CUSTOM}
        if sizes["hidden"] % sizes["heads"]:
            raise ValueError("hidden must be a multiple of heads")
        model = Transformer("custom", sizes["layers"], sizes["hidden"], sizes["heads"], 1,
                            sizes["vocab"])  # fmt: skip
    elif name in PRESETS:
        model = PRESETS[name]
    else:
        raise ValueError(f"model must be custom or one of {', '.join(PRESETS)}, got {name!r}")
    return dataclasses.replace(model, seq_len=_int(inputs, "seq_len"))


def memory_per_gpu(inputs: dict) -> dict:
    """Bytes per GPU of the first pipeline stage, by part, against ``inputs["gpu"]``.

    ``inputs``: the model (:func:`model_from`), ``dp``, ``tp``, ``pp``, ``cp``, ``ep``,
    ``zero`` (0 to 3), ``recompute``, ``micro_batch`` (sequences), ``micro_batches`` (per
    step and data-parallel rank), ``chunks`` (interleaved stages per pipeline rank),
    ``sequence_parallel`` (bool), ``gpu``."""
    model = model_from(inputs)
    dp, tp, pp, cp, ep = (_int(inputs, k) for k in ("dp", "tp", "pp", "cp", "ep"))
    zero, recompute = _int(inputs, "zero", 0), inputs.get("recompute")
    b, m, v = (_int(inputs, k) for k in ("micro_batch", "micro_batches", "chunks"))
    if inputs.get("gpu") not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}")
    if zero > 3 or recompute not in RECOMPUTE:
        raise ValueError(f"zero must be 0 to 3 and recompute one of {', '.join(RECOMPUTE)}")
    if ep > 1:
        raise ValueError("ep must be 1: these models are dense (no experts to spread)")
    if model.heads % tp or model.seq_len % cp:
        raise ValueError("tp must divide the heads, and cp the sequence length")
    if pp > model.layers:
        raise ValueError(f"pp must be at most the {model.layers} layers")
    if v > 1 and (pp == 1 or v > stage_layers(model, pp) + 1):
        raise ValueError("interleaving (chunks > 1) needs pp > 1 and a layer per chunk")
    if cp > 1 and recompute == "none":
        raise ValueError("with cp > 1 attention runs blockwise and keeps no score matrix: "
                         "choose selective or full recomputation")  # fmt: skip
    shard = dataclasses.replace(model, seq_len=model.seq_len // cp)  # one rank's tokens
    sp = bool(inputs.get("sequence_parallel")) and tp > 1
    layout = Layout(dp=dp * cp, tp=tp, pp=pp, zero=zero, micro_batch=b, chunks=v,
                    recompute=recompute, sequence_parallel=sp)  # fmt: skip
    planned = memory(shard, layout, dp * cp * b * m)
    params = stage_params(model, pp) / tp
    parts = training_memory(params, "mixed", zero, dp * cp)
    parts["activations"] = planned["activations"]
    device = DEVICES[inputs["gpu"]]["memory_bytes"]
    total = sum(parts.values())
    return {
        "parts": parts,
        "total": total,
        "params_total": model.params(),
        "params_per_gpu": params,
        "stage_layers": stage_layers(model, pp),
        "gpus": dp * tp * pp * cp * ep,
        "device": device,
        "usable": USABLE_MEMORY * device,
        "fits": total <= USABLE_MEMORY * device,
    }


def _row(result: dict) -> dict:
    lay = result["layout"]
    return {
        "layout": dataclasses.asdict(lay),
        "memory": result["memory"],
        "states": result["states"],
        "activations": result["memory"] - result["states"],
        "parts": result["parts"],
        "step_s": result["step_s"],
        "tflops": result["tflops"],
        "mfu": result["mfu"],
    }


def planner_presets() -> list[dict]:
    """The published runs: model, cluster and global batch, to fill the planner's form."""
    return [
        {"model": e["model"], "cluster": e["cluster"], "global_batch": e["global_batch"],
         "published": dataclasses.asdict(e["layout"]), "source": e["source"]}
        for e in PUBLISHED
    ]  # fmt: skip


def plan_layouts(inputs: dict, top: int = 10) -> dict:
    """The fastest layout of each mesh that fits (:func:`planner.plan`,
    :func:`planner.best_per_mesh`), the ``top`` first, for ``inputs["model"]`` (a name of
    :data:`published.MODELS`), ``inputs["cluster"]`` (of :data:`published.CLUSTERS`) and
    ``inputs["global_batch"]`` (sequences)."""
    if inputs.get("model") not in MODELS or inputs.get("cluster") not in CLUSTERS:
        raise ValueError(f"model: one of {', '.join(MODELS)}; cluster: {', '.join(CLUSTERS)}")
    model, cluster = MODELS[inputs["model"]], CLUSTERS[inputs["cluster"]]
    batch = _int(inputs, "global_batch")
    results = plan(model, cluster, batch)
    meshes = best_per_mesh(results)
    order = [r["layout"].mesh for r in meshes]
    runs = [e for e in PUBLISHED if (e["model"], e["cluster"], e["global_batch"]) == (
        inputs["model"], inputs["cluster"], batch)]  # fmt: skip
    mesh = runs[0]["layout"].mesh if runs else None
    return {
        "gpus": cluster.gpus,
        "gpu": cluster.gpu,
        "device": DEVICES[cluster.gpu]["memory_bytes"],
        "feasible": len(results),
        "meshes": len(meshes),
        "rows": [_row(r) for r in meshes[:top]],
        "published_mesh": mesh,
        "published_rank": order.index(mesh) + 1 if mesh in order else None,
    }


def call(name: str, arguments: str) -> str:
    """What the page calls: ``name`` (``"memory"``, ``"plan"``, ``"presets"``) with JSON
    arguments, answered in JSON: the result, or ``{"error": message}`` for bad input."""
    functions = {"memory": memory_per_gpu, "plan": plan_layouts, "presets": lambda _: _presets()}
    try:
        return json.dumps({"result": functions[name](json.loads(arguments))})
    except ValueError as error:
        return json.dumps({"error": str(error)})


def _presets() -> dict:
    return {
        "models": {name: dataclasses.asdict(m) for name, m in PRESETS.items()},
        "gpus": {name: DEVICES[name]["memory_bytes"] for name in GPUS},
        "clusters": {name: {"gpus": c.gpus, "gpu": c.gpu} for name, c in CLUSTERS.items()},
        "planner_models": list(MODELS),
        "published": planner_presets(),
    }
