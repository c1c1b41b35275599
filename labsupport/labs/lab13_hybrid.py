"""Lab 13, hybrid (3D) parallelism: the course GPT trained data x tensor x pipeline
parallel on 8 ranks, its traffic counted per axis, the mesh in two rank orders and in
PyTorch's ``DeviceMesh``, the planner on published runs, and the checkers of exercises 2
and 3 (exercise 1's is :mod:`labsupport.labs.lab13_mesh`).

The training loop is the notebook's, around :class:`labsupport.parallel.hybrid.Hybrid3D`
(:func:`~labsupport.parallel.hybrid.train_3d` is the same loop), the mesh
:class:`labsupport.parallel.parallel_state.Mesh`, the planner
:mod:`labsupport.estimate.planner` with :mod:`labsupport.estimate.published`.
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets
import torch.distributed as dist

from labsupport.comm import p2p, traced
from labsupport.estimate.memory import training_memory
from labsupport.estimate.planner import best_per_mesh, plan
from labsupport.estimate.published import CLUSTERS, MODELS, PUBLISHED, check
from labsupport.labs.cells import exercise, format_table
from labsupport.launch.runtime import device
from labsupport.parallel.hybrid import train_3d
from labsupport.parallel.pipeline_parallel import partition

#: The lab's GPT and run: 2 layers, so that 2 pipeline stages hold one block each.
CONFIG = {"vocab_size": 64, "block_size": 8, "n_layer": 2, "n_head": 2, "n_embd": 16}
DP = TP = PP = 2
MICROBATCHES, STEPS, BATCH, LR = 2, 3, 8, 1e-2
#: Two conventions for numbering a mesh's ranks, fastest-varying axis first: Megatron's
#: default, and Llama 3's [TP, CP, PP, DP] (Megatron's ``--use-tp-pp-dp-mapping``).
ORDERS = {"Megatron-LM (default)": "tp-dp-pp", "Llama 3": "tp-pp-dp"}


def lab_train(dp=DP, tp=TP, pp=PP, steps=STEPS) -> dict:
    """:func:`labsupport.parallel.hybrid.train_3d` with the lab's model and run (the
    notebook writes the same loop out)."""
    return train_3d(CONFIG, dp, tp, pp, MICROBATCHES, steps, BATCH, LR)


def train_3d_counted(train=lab_train, dp=DP, tp=TP, pp=PP, steps=STEPS):
    """``train(dp, tp, pp, steps)`` (the notebook's loop, or :func:`lab_train`) on this
    rank, which prints its coordinates and groups, with its traffic counted per axis: the
    collectives on its tensor-parallel group (all-reduces) and on its data-parallel group
    (ZeRO-1's reduce-scatter, all-gather and the all-reduce of which parameters got a
    gradient), the point-to-point messages the pipeline's. Returns ``train``'s result
    and the bytes this rank sent per step on each axis."""
    with traced.trace_collectives() as trace, p2p.count_traffic() as messages:
        out = train(dp, tp, pp, steps)
    c, g = out["coords"], out["groups"]
    print(
        f"tp={c['tp']} dp={c['dp']} pp={c['pp']}: "
        f"TP group {g['tp']}, DP group {g['dp']}, PP group {g['pp']}"
    )
    traffic = {axis: traced.bytes_per_rank(trace.on(g[axis])) / steps for axis in ("tp", "dp")}
    traffic["pp"] = messages.bytes_sent / steps
    return out | {"traffic": traffic}


def stage_numel(tp: int, pp: int, stage: int, config=CONFIG) -> int:
    """Parameters one tensor-parallel rank of pipeline ``stage`` holds: its blocks (the
    split matrices and biases /t; LayerNorms and the row-parallel biases whole), the
    first stage's embeddings, the last stage's final LayerNorm and its copy of the
    output layer (the vocabulary padded to a multiple of t, split)."""
    h, s = config["n_embd"], config["block_size"]
    vocab = math.ceil(config["vocab_size"] / tp) * tp // tp
    layers = len(partition(config["n_layer"], pp)[stage])
    numel = layers * (6 * h + (12 * h * h + 7 * h) // tp)
    if stage == 0:
        numel += vocab * h + s * h
    if stage == pp - 1:
        numel += 2 * h + vocab * h
    return numel


def stage_tensors(pp: int, stage: int, config=CONFIG) -> int:
    """Parameter tensors of pipeline ``stage``: 12 per block (two LayerNorms and four
    linear layers, a weight and a bias each), the first stage's two embeddings, the last
    stage's final LayerNorm (2) and its output layer (1)."""
    layers = len(partition(config["n_layer"], pp)[stage])
    return 12 * layers + (2 if stage == 0 else 0) + (3 if stage == pp - 1 else 0)


def expected_traffic(coords: dict, dp=DP, tp=TP, pp=PP, microbatches=MICROBATCHES) -> dict:
    """Bytes a rank sends per step on each axis, from the formulas (fp32, rings)."""
    stage, first, last = coords["pp"], coords["pp"] == 0, coords["pp"] == pp - 1
    micro = BATCH // (dp * microbatches)
    x = micro * CONFIG["block_size"] * CONFIG["n_embd"] * 4  # one activation, bytes
    layers = len(partition(CONFIG["n_layer"], pp)[stage])
    # per layer: 2 all-reduces forward (g), 2 backward (f); the first stage's embedding
    # (g), the last stage's head (f) and the loss's 3 all-reduces of one value per token
    reduced = 4 * layers * x + (x if first else 0)
    reduced += (x + 3 * micro * CONFIG["block_size"] * 4) if last else 0
    padded = math.ceil(stage_numel(tp, pp, stage) / dp) * dp
    # ZeRO-1: reduce-scatter + all-gather of the fp32 parameters, and the all-reduce of
    # one byte per parameter tensor saying whether it got a gradient on some rank
    zero = 2 * padded * 4 + 2 * stage_tensors(pp, stage)
    return {
        "tp": microbatches * reduced * 2 * (tp - 1) / tp,
        "dp": zero * (dp - 1) / dp,
        "pp": microbatches * x * ((not last) + (not first)) if pp > 1 else 0,
    }


def torch_groups(dp: int, tp: int, pp: int, order: str) -> dict:
    """This rank's groups in PyTorch's ``init_device_mesh`` for the mesh of ``order``:
    the mesh's shape lists the axes slowest first, the reverse of ``order``."""
    from torch.distributed.device_mesh import init_device_mesh

    axes = order.split("-")[::-1]
    sizes = {"tp": tp, "dp": dp, "pp": pp}
    mesh = init_device_mesh(
        device().type, tuple(sizes[a] for a in axes), mesh_dim_names=tuple(axes)
    )
    return {a: dist.get_process_group_ranks(mesh.get_group(a)) for a in axes}


def device_mesh_groups(dp=DP, tp=TP, pp=PP) -> dict:
    """This rank's groups in PyTorch's ``init_device_mesh`` for both orders of
    :data:`ORDERS`."""
    found = {name: torch_groups(dp, tp, pp, order) for name, order in ORDERS.items()}
    return {"rank": dist.get_rank(), "groups": found}


# --------------------------------------------------------------------------- the planner


def checked() -> dict:
    """:func:`labsupport.estimate.published.check` of every published run, by model."""
    return {entry["model"]: check(entry) for entry in PUBLISHED}


def published_rows(checks: dict) -> list[dict]:
    """The planner on each published run (``checks``: :func:`checked`): the layout as
    published, its predicted throughput next to the published one, where its mesh ranks."""
    rows = []
    for entry in PUBLISHED:
        found = checks[entry["model"]]
        p, best = found["published"], found["meshes"][0]
        key = "tflops" if entry["counted"] == "with recomputation" else "model_tflops"
        dp, tp, pp = entry["layout"].mesh
        gap = found["mesh_best"]["step_s"] / best["step_s"] - 1
        rows.append(
            {
                "model": entry["model"],
                "GPUs": f"{dp * tp * pp:,}",
                "published dp x tp x pp": f"{dp} x {tp} x {pp}",
                "GB/GPU": f"{p['memory'] / 1e9:.0f}",
                "TFLOP/s predicted": f"{p[key]:.0f}",
                "published": f"{entry['tflops']:g}",
                "mesh rank": f"{found['rank']} of {len(found['meshes'])}",
                "planner's best": "{} x {} x {}".format(*best["layout"].mesh),
                "published mesh vs best": f"+{gap:.0%}",
            }
        )
    return rows


def plan_rows(model: str, cluster: str, global_batch: int, top: int = 5) -> list[dict]:
    """The ``top`` meshes the planner finds, each with its best layout: ``b`` is the
    micro-batch in sequences, ``v`` the chunks per pipeline rank (interleaving), ``comm``
    the communication left exposed (tensor, pipeline and data parallel together)."""
    meshes = best_per_mesh(plan(MODELS[model], CLUSTERS[cluster], global_batch))
    rows = []
    for r in meshes[:top]:
        lay, parts = r["layout"], r["parts"]
        rows.append(
            {
                "dp x tp x pp": f"{lay.dp} x {lay.tp} x {lay.pp}",
                "ZeRO": lay.zero,
                "b": lay.micro_batch,
                "v": lay.chunks,
                "recompute": lay.recompute,
                "GB/GPU": f"{r['memory'] / 1e9:.0f}",
                "step (s)": f"{r['step_s']:.2f}",
                "bubble (s)": f"{parts['bubble']:.2f}",
                "comm (s)": f"{parts['tensor'] + parts['pipeline'] + parts['data']:.2f}",
                "MFU": f"{r['mfu']:.0%}",
            }
        )
    return rows


class PlannerExplorer(widgets.interactive):
    """The planner's widget; without a kernel it reads as one line."""

    def __repr__(self) -> str:
        return "Planner explorer: a live widget (run this cell in JupyterLab to use it)"

    def describe(self) -> str:
        """The table the controls show now."""
        return format_table(plan_rows(**self.kwargs, top=8))


def explorer() -> PlannerExplorer:
    """Pick a published model, a cluster and a global batch (in sequences): the planner's
    best meshes. It starts on GPT-3 175B's run on Selene (BLOOM's best meshes are printed
    above it in the lab)."""
    report = widgets.HTML()
    style, layout = {"description_width": "120px"}, widgets.Layout(width="520px")

    def show(model, cluster, global_batch):
        rows = plan_rows(model, cluster, global_batch, top=8)
        text = format_table(rows) if rows else "no layout fits in memory"
        report.value = f"<pre>{html.escape(text)}</pre>"

    start = PUBLISHED[1]

    box = PlannerExplorer(
        show,
        model=widgets.Dropdown(
            options=list(MODELS), value=start["model"], description="model", style=style
        ),
        cluster=widgets.Dropdown(
            options=list(CLUSTERS), value=start["cluster"], description="cluster", style=style
        ),
        global_batch=widgets.SelectionSlider(
            options=[256, 512, 1024, 1536, 2048, 3072, 4096],
            value=start["global_batch"],
            description="global batch",
            style=style,
            layout=layout,
        ),
    )
    box.children = (*box.children, report)
    return box


# --------------------------------------------------------------------------- exercises


@exercise
def check_tp_bytes(fn) -> str:
    """Exercise 2: ``fn(micro_batch, seq_len, hidden, tp, element_bytes)``, the bytes one
    rank sends for one layer's tensor parallelism per micro-batch, forward and backward."""
    cases = [(2, 8, 16, 2, 4), (2, 2048, 14336, 4, 2), (1, 2048, 12288, 8, 2), (4, 512, 1024, 1, 2)]
    for b, s, h, t, e in cases:
        want = 4 * 2 * (t - 1) / t * b * s * h * e
        got = fn(b, s, h, t, e)
        hint = ""
        if math.isclose(got, want / 2, rel_tol=1e-9):
            hint = " (two all-reduces forward and two backward)"
        elif t > 1 and math.isclose(got, 4 * b * s * h * e, rel_tol=1e-9):
            hint = " (a ring all-reduce sends 2(t-1)/t of the tensor)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"b={b}, s={s}, h={h}, t={t}, element_bytes={e}: got {got:.6g}, "
            f"expected {want:.6g}{hint}"
        )
    return f"{len(cases)} cases, the lab's run and BLOOM's layer among them"


@exercise
def check_states_per_gpu(fn) -> str:
    """Exercise 3: ``fn(num_params, tp, pp, dp, zero)``, mixed-precision model-state bytes
    per GPU when tensor and pipeline parallelism split the parameters evenly and ZeRO
    ``zero`` shards them over the data-parallel group."""
    cases = [(176e9, 4, 12, 8, 1), (175e9, 8, 12, 16, 0), (405e9, 8, 16, 128, 3), (7e9, 1, 1, 8, 2)]
    for n, t, p, d, zero in cases:
        want = sum(training_memory(n / (t * p), "mixed", zero, d).values())
        got = fn(n, t, p, d, zero)
        hint = ""
        if math.isclose(got, want * t * p, rel_tol=1e-9):
            hint = " (tensor and pipeline parallelism each hold a part of the model)"
        assert math.isclose(got, want, rel_tol=1e-9), (
            f"num_params={n:g}, tp={t}, pp={p}, dp={d}, zero={zero}: got {got:.6g} bytes, "
            f"expected {want:.6g}{hint}"
        )
    return f"{len(cases)} layouts: BLOOM's, GPT-3's, Llama 3's and a small one"
