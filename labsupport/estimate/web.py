"""The website's calculators: what the page asks, answered by the planner's own functions.

The course's website runs this module in the reader's browser (Pyodide, no torch, no
numpy) behind two forms: memory per GPU, and the planner. It is the only module the page
calls, and it only translates: the page's inputs (plain names and numbers) into the
planner's :class:`~labsupport.estimate.planner.Transformer` and
:class:`~labsupport.estimate.planner.Layout`, and the answers of
:func:`~labsupport.estimate.stages.heaviest_stage` and
:func:`~labsupport.estimate.planner.plan` into JSON the page draws. When the planner's
interface changes, this module is what follows it.

Memory per GPU is the planner's memory of its heaviest pipeline stage, context and expert
parallelism included: each of ``cp`` ranks holds ``s/cp`` tokens, the dense weights are
sharded by ZeRO over the ``dp·cp`` ranks that hold them, the routed experts of an MoE
model split over ``ep`` ranks and sharded over the ``dp·cp/ep`` replicas.

The planner ranks every layout with the framework's settings as given (``cp``,
``dp_overlap`` and the rest of :data:`~labsupport.estimate.published.FRAMEWORKS`), the
step timed with the fitted efficiency :data:`~labsupport.estimate.compute.FITTED`.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import replace

from labsupport.estimate.architecture import FAMILIES
from labsupport.estimate.compute import FITTED, H800, REPORTED_MEMORY
from labsupport.estimate.datasheets import DEVICES
from labsupport.estimate.planner import (
    DEFAULTS,
    USABLE_MEMORY,
    Layout,
    Transformer,
    best_per_mesh,
    plan,
    stage_layers,
    stage_params,
)
from labsupport.estimate.published import CLUSTERS, FRAMEWORKS, MODELS, PUBLISHED
from labsupport.estimate.stages import heaviest_stage
from labsupport.models.recompute import RECOMPUTE

GPUS = [name for name, spec in DEVICES.items() if spec["kind"] == "GPU"] + [H800["name"]]
MEMORY_OF = {name: DEVICES.get(name, H800)["memory_bytes"] for name in GPUS} | REPORTED_MEMORY
"""Bytes a GPU has: as ``nvidia-smi`` reports them where the planner knows it
(:data:`~labsupport.estimate.compute.REPORTED_MEMORY`), else the datasheet's."""
#: GPT-2 small's shape (124M parameters, Radford et al. 2019) beside the published models.
PRESETS = {"GPT-2 124M": Transformer("GPT-2 124M", 12, 768, 12, 1024, 50257)} | MODELS
#: A custom model's sizes, then what it may leave empty (0) for the family's default.
CUSTOM = ("layers", "hidden", "heads", "vocab")
CUSTOM_OPTIONAL = ("family", "ffn", "kv_heads")
#: The framework settings the planner does not choose: what ``"framework"`` sets.
SETTINGS = ("sequence_parallel", "dp_overlap", "a2a_overlap", "fused_attention", "fp8")
#: Where :func:`plan_layouts` narrows the planner's search, so that the page answers in a
#: few seconds (the full search runs in the page too slowly), and what it tries there.
NARROWED = {"DeepSeek-V3": {"tp": (1,)}}


def _int(inputs: dict, name: str, low: int = 1) -> int:
    value = inputs.get(name)
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name} must be a whole number, got {value!r}") from None
    if number != float(value) or number < low:
        raise ValueError(f"{name} must be a whole number of at least {low}, got {value!r}")
    return number


def _optional(inputs: dict, name: str) -> int:
    """``inputs[name]``, a whole number, or 0 (the default) where it is empty."""
    return 0 if inputs.get(name) in (None, "", 0) else _int(inputs, name)


def llama_ffn(hidden: int, multiple_of: int = 256) -> int:
    """Llama's FFN width: two thirds of ``4·hidden``, rounded up to a multiple of
    ``multiple_of`` (Meta's ``llama/model.py``, ``FeedForward``, with no
    ``ffn_dim_multiplier``: Llama 2 7B's 11,008 and 13B's 13,824)."""
    return -(-(8 * hidden // 3) // multiple_of) * multiple_of


def model_from(inputs: dict) -> Transformer:
    """The preset ``inputs["model"]``, or ``"custom"`` with ``layers``, ``hidden``,
    ``heads``, ``vocab`` and optionally ``family`` (``"gpt"``, the default, or
    ``"llama"``: SwiGLU, RMSNorm, no biases, no learned positions, an untied output
    layer, as :data:`published.MODELS` builds Llama 3), ``ffn`` (by default ``4·hidden``
    for a GPT, :func:`llama_ffn` for Llama) and ``kv_heads`` (grouped-query attention;
    by default one per head), at ``seq_len`` tokens per sequence."""
    name = inputs.get("model", "custom")
    if name == "custom":
        layers, hidden, heads, vocab = (_int(inputs, key) for key in CUSTOM)
        family = inputs.get("family") or "gpt"
        if family not in FAMILIES:
            raise ValueError(f"family must be one of {', '.join(FAMILIES)}, got {family!r}")
        ffn, kv_heads = _optional(inputs, "ffn"), _optional(inputs, "kv_heads") or heads
        if hidden % heads:
            raise ValueError("hidden must be a multiple of heads")
        if heads % kv_heads:
            raise ValueError(f"kv_heads must divide the {heads} heads, each key-value head serving "
                             "as many query heads; leave it empty for one per head")  # fmt: skip
        llama = family == "llama"
        ffn = ffn or (llama_ffn(hidden) if llama else 4 * hidden)
        model = Transformer("custom", layers, hidden, heads, 1, vocab, ffn=ffn,
                            kv_heads=kv_heads, family=family, positions=not llama,
                            tied=not llama)  # fmt: skip
    elif name in PRESETS:
        model = PRESETS[name]
    else:
        raise ValueError(f"model must be custom or one of {', '.join(PRESETS)}, got {name!r}")
    return replace(model, seq_len=_int(inputs, "seq_len"))


def _check_axes(model: Transformer, dp: int, tp: int, pp: int, cp: int, ep: int) -> None:
    if model.heads % tp or model.seq_len % cp:
        raise ValueError("tp must divide the heads, and cp the sequence length")
    if not model.splits_heads(tp):  # the heads do split: the key-value heads do not
        raise ValueError(f"tp must divide the {model.kv_heads} key-value heads too (Megatron "
                         "gives each rank whole key-value heads)")  # fmt: skip
    if ep > 1 and not model.n_expert:
        raise ValueError(f"ep must be 1: {model.name} is dense (no experts to spread)")
    if model.n_expert and (model.n_expert % ep or (dp * cp) % ep):
        raise ValueError(f"ep must divide the {model.n_expert} experts and dp·cp = {dp * cp}")
    if pp > model.layers:
        raise ValueError(f"pp must be at most the {model.layers} layers")


def published_inputs(name: str) -> dict:
    """The memory form's inputs for the published run ``name`` (:data:`PUBLISHED`),
    its layout as published: what the form shows when its model is chosen."""
    run = next(e for e in PUBLISHED if e["name"] == name)
    lay, model = run["layout"], MODELS[run["model"]]
    gpu = CLUSTERS[run["cluster"]].gpu
    return {"model": run["model"], "seq_len": model.seq_len, "gpu": gpu, "dp": lay.dp,
            "tp": lay.tp, "pp": lay.pp, "cp": lay.cp, "ep": lay.ep, "zero": lay.zero,
            "recompute": lay.recompute, "micro_batch": lay.micro_batch,
            "micro_batches": run["global_batch"] // (lay.dp * lay.micro_batch),
            "chunks": lay.chunks, "sequence_parallel": lay.sequence_parallel,
            "fused_attention": lay.fused_attention}  # fmt: skip


def memory_per_gpu(inputs: dict) -> dict:
    """Bytes per GPU of the heaviest pipeline stage, by part, against ``inputs["gpu"]``.

    ``inputs``: the model (:func:`model_from`), ``dp``, ``tp``, ``pp``, ``cp``, ``ep``,
    ``zero`` (0 to 3), ``recompute``, ``micro_batch`` (sequences), ``micro_batches`` (per
    step and data-parallel rank), ``chunks`` (interleaved stages per pipeline rank),
    ``sequence_parallel`` and ``fused_attention`` (bools), ``gpu``. A custom model's
    ``family``, ``ffn`` and ``kv_heads``, defaults filled in, come back as ``"custom"``."""
    model = model_from(inputs)
    dp, tp, pp, cp, ep = (_int(inputs, k) for k in ("dp", "tp", "pp", "cp", "ep"))
    zero, recompute = _int(inputs, "zero", 0), inputs.get("recompute")
    b, m, v = (_int(inputs, k) for k in ("micro_batch", "micro_batches", "chunks"))
    if inputs.get("gpu") not in GPUS:
        raise ValueError(f"gpu must be one of {', '.join(GPUS)}")
    if zero > 3 or recompute not in RECOMPUTE:
        raise ValueError(f"zero must be 0 to 3 and recompute one of {', '.join(RECOMPUTE)}")
    _check_axes(model, dp, tp, pp, cp, ep)
    if v > 1 and (pp == 1 or v > stage_layers(model, pp) + 1):
        raise ValueError("interleaving (chunks > 1) needs pp > 1 and a layer per chunk")
    layout = Layout(dp, tp, pp, zero=zero, micro_batch=b, chunks=v, recompute=recompute,
                    sequence_parallel=bool(inputs.get("sequence_parallel")) and tp > 1,
                    cp=cp, ep=ep, fused_attention=bool(inputs.get("fused_attention")))  # fmt: skip
    stage, parts = heaviest_stage(model, layout, dp * b * m)
    params = stage_params(model, pp, stage)
    device = MEMORY_OF[inputs["gpu"]]
    total = sum(parts.values())
    custom = {k: getattr(model, k) for k in CUSTOM_OPTIONAL} if model.name == "custom" else None
    return {
        "parts": parts,
        "total": total,
        "stage": stage,
        "params_total": model.params(),
        "params_per_gpu": params["dense"] / tp + params["experts"] / ep,
        "stage_layers": stage_layers(model, pp, stage),
        "gpus": layout.gpus,
        "device": device,
        "usable": USABLE_MEMORY * device,
        "fits": total <= USABLE_MEMORY * device,
        "custom": custom,
    }


def _row(result: dict) -> dict:
    return {
        "layout": dataclasses.asdict(result["layout"]),
        "axes": result["layout"].axes,
        "memory": result["memory"],
        "states": result["states"],
        "activations": result["memory"] - result["states"],
        "parts": result["parts"],
        "step_s": result["step_s"],
        "tflops": result["tflops"],
        "mfu": result["mfu"],
    }


def framework_of(layout: Layout) -> str:
    """The name in :data:`FRAMEWORKS` whose settings ``layout`` has."""
    for name, settings in FRAMEWORKS.items():
        if all(getattr(layout, k) == settings.get(k, DEFAULTS[k][0]) for k in SETTINGS):
            return name
    raise ValueError(f"no framework of {', '.join(FRAMEWORKS)} has {layout}'s settings")


def planner_presets() -> list[dict]:
    """The published runs on their whole clusters: model, cluster, global batch and the
    framework's settings, to fill the planner's form."""
    return [
        {"name": e["name"], "model": e["model"], "cluster": e["cluster"],
         "global_batch": e["global_batch"], "cp": e["layout"].cp,
         "framework": framework_of(e["layout"]), "dp_overlap": e["layout"].dp_overlap,
         "axes": e["layout"].axes, "source": e["source"]}
        for e in PUBLISHED if "gpus" not in e
    ]  # fmt: skip


def plan_choices(inputs: dict) -> dict:
    """What :func:`plan_layouts` passes to :func:`planner.plan`: ``cp``, the settings of
    ``inputs["framework"]`` (:data:`FRAMEWORKS`) with ``dp_overlap`` as given, and the
    narrower search of :data:`NARROWED` for the models named there."""
    framework = inputs.get("framework")
    if framework not in FRAMEWORKS:
        raise ValueError(f"framework must be one of {', '.join(FRAMEWORKS)}, got {framework!r}")
    settings = {k: FRAMEWORKS[framework].get(k, DEFAULTS[k][0]) for k in SETTINGS}
    settings["dp_overlap"] = bool(inputs.get("dp_overlap"))
    choices = {k: (v,) for k, v in settings.items()} | {"cp": (_int(inputs, "cp"),)}
    return choices | NARROWED.get(inputs["model"], {})


def plan_layouts(inputs: dict, top: int = 10) -> dict:
    """The fastest layout of each mesh that fits (:func:`planner.plan`,
    :func:`planner.best_per_mesh`), the ``top`` first, for ``inputs["model"]`` (a name of
    :data:`published.MODELS`), ``inputs["cluster"]`` (of :data:`published.CLUSTERS`),
    ``inputs["global_batch"]`` (sequences) and the settings of :func:`plan_choices`."""
    if inputs.get("model") not in MODELS or inputs.get("cluster") not in CLUSTERS:
        raise ValueError(f"model: one of {', '.join(MODELS)}; cluster: {', '.join(CLUSTERS)}")
    model, cluster = MODELS[inputs["model"]], CLUSTERS[inputs["cluster"]]
    batch, choices = _int(inputs, "global_batch"), plan_choices(inputs)
    if model.seq_len % choices["cp"][0]:
        raise ValueError(f"cp must divide the sequence length, {model.seq_len}")
    results = plan(model, cluster, batch, **choices)
    meshes = best_per_mesh(results)
    order = [r["layout"].axes for r in meshes]
    same = [p for p in planner_presets() if (p["model"], p["cluster"], p["global_batch"]) == (
        inputs["model"], inputs["cluster"], batch)]  # fmt: skip
    axes = tuple(same[0]["axes"]) if same else None
    return {
        "gpus": cluster.gpus,
        "gpu": cluster.gpu,
        "device": MEMORY_OF[cluster.gpu],
        "feasible": len(results),
        "meshes": len(meshes),
        "rows": [_row(r) for r in meshes[:top]],
        "published_axes": axes,
        "published_rank": order.index(axes) + 1 if axes in order else None,
        "narrowed": {k: list(v) for k, v in NARROWED.get(inputs["model"], {}).items()},
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
        "custom": CUSTOM + CUSTOM_OPTIONAL,
        "gpus": MEMORY_OF,
        "clusters": {name: {"gpus": c.gpus, "gpu": c.gpu} for name, c in CLUSTERS.items()},
        "planner_models": list(MODELS),
        "published": planner_presets(),
        "layouts": {p["model"]: published_inputs(p["name"]) for p in planner_presets()},
        "efficiency": dataclasses.asdict(FITTED),
        "frameworks": {
            name: {k: settings.get(k, DEFAULTS[k][0]) for k in SETTINGS}
            for name, settings in FRAMEWORKS.items()
        },
    }
