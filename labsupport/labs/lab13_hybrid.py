"""Lab 13, hybrid (3D) parallelism: the course GPT trained data x tensor x pipeline
parallel on 8 ranks, its traffic counted per axis, the mesh in two rank orders and in
PyTorch's ``DeviceMesh``, and the checkers of exercises 2 and 3 (exercise 1's is
:mod:`labsupport.labs.lab13_mesh`; the planner's tables and exercise 4's checker are
:mod:`labsupport.labs.lab13_planner`, imported here for the notebook's ``lab.``).

The training loop is the notebook's, around :class:`labsupport.parallel.hybrid.Hybrid3D`
(:func:`~labsupport.parallel.hybrid.train_3d` is the same loop), the mesh
:class:`labsupport.parallel.parallel_state.Mesh`, the planner
:mod:`labsupport.estimate.planner` with :mod:`labsupport.estimate.published`.
"""

from __future__ import annotations

import math

import torch.distributed as dist

from labsupport.comm import p2p, traced
from labsupport.estimate.memory import training_memory
from labsupport.labs.cells import exercise
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
# (labsupport.labs.lab13_planner; its names here for the notebook's ``lab.``)

from labsupport.labs.lab13_planner import (  # noqa: E402, F401
    ASSUMPTION_RUN,
    PUBLISHED_TABLES,
    SENSITIVITY,
    PlannerExplorer,
    calibration_rows,
    check_assumption,
    checked,
    explorer,
    mesh_label,
    plan_rows,
    published_rows,
    published_tables,
    sensitivity_rows,
)

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
