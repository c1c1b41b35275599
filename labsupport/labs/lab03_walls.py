"""Lab 3, the three walls: a small GPT measured against the formulas, a data-parallel
step, the explorer, and the exercises' checkers.

The formulas are in :mod:`labsupport.estimate` (``flops``, ``memory``, ``walls``), the
measurements in :mod:`labsupport.measure` (``memory``, ``flops``), the model is
:class:`labsupport.models.GPT`, the drawings are in :mod:`labsupport.viz.walls`.
"""

from __future__ import annotations

import html
import math

import ipywidgets as widgets
import torch
import torch.distributed as dist

from labsupport import comm
from labsupport.estimate.flops import SECONDS_PER_DAY, training_days, training_flops
from labsupport.estimate.units import GB
from labsupport.estimate.walls import describe_walls, step_times
from labsupport.labs.cells import exercise
from labsupport.launch.runtime import device
from labsupport.measure.flops import count_flops
from labsupport.measure.memory import saved_tensors
from labsupport.models import GPT, random_tokens, tiny_gpt

#: The lab's GPT: small enough for a laptop core, with attention written out (so every
#: tensor the activation formula counts is one autograd saves) and dropout on.
LAB_GPT = {
    "vocab_size": 256,
    "block_size": 64,
    "n_layer": 2,
    "n_head": 4,
    "n_embd": 64,
    "dropout": 0.1,
    "attention": "math",
}

#: fp32's unit roundoff: one rounding changes a value by at most this share of it.
FP32_UNIT_ROUNDOFF = 2.0**-24


def build(seed: int = 0, **overrides) -> GPT:
    """The lab's GPT (:data:`LAB_GPT` with ``overrides``), weights drawn from ``seed``, in
    training mode, on :func:`labsupport.launch.runtime.device`."""
    return tiny_gpt(seed, **(LAB_GPT | overrides)).to(device()).train()


def batch(model: GPT, size: int, seed: int):
    """``size`` sequences of random tokens for ``model``, and their targets, on its device."""
    c = model.config
    idx, targets = random_tokens(size, c.block_size, c.vocab_size, seed)
    return idx.to(device()), targets.to(device())


def activation_bytes(model: GPT, idx) -> list[int]:
    """Bytes autograd saves for the backward pass in each block, over one forward pass
    (:func:`labsupport.measure.memory.saved_tensors`, parameters and buffers left out)."""
    per_layer = []
    with torch.no_grad():
        x = model.embed(idx)
    x.requires_grad_(True)
    for block in model.h:
        with saved_tensors(exclude=model) as saved:
            x = model.run_block(block, x)
        per_layer.append(saved.nbytes)
    return per_layer


def step_flops(model: GPT, idx, targets) -> int:
    """FLOPs of one forward and backward pass, counted while they run."""
    flops = count_flops(lambda: model(idx, targets)[1].backward())
    model.zero_grad(set_to_none=True)
    return flops


def data_parallel_step(config: dict, batch_per_rank: int, seed: int = 0) -> dict:
    """One data-parallel step of the lab's GPT (run on every rank).

    Every rank builds the same model (same seed), computes the gradient of its own batch
    (seed ``seed + 1 + rank``), and all-reduces the gradients, flattened into one fp32
    buffer, with the course's ring (:func:`labsupport.comm.all_reduce`) while
    :func:`labsupport.comm.count_traffic` counts the bytes this rank sends. The same sum
    from ``torch.distributed.all_reduce`` is the reference: the two add the ranks'
    values in different orders, and each order's rounding error is at most
    (N - 1)·u·Σ|g| (Higham 2002, "Accuracy and Stability of Numerical Algorithms",
    section 4.2), so they agree within 2·N·u·Σ|g|, element by element.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(seed, **config)
    idx, targets = batch(model, batch_per_rank, seed + 1 + rank)
    model(idx, targets)[1].backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference, magnitude = grads.clone(), grads.abs()
    dist.all_reduce(reference)
    dist.all_reduce(magnitude)
    with comm.count_traffic() as traffic:
        comm.all_reduce(grads)
    bound = 2 * world * FP32_UNIT_ROUNDOFF * magnitude
    return {
        "rank": rank,
        "numel": grads.numel(),
        "bytes_sent": traffic.bytes_sent,
        "messages": len(traffic.messages),
        "matches_torch": bool(((grads - reference).abs() <= bound).all()),
        "mean_gradient": (grads / world).cpu() if rank == 0 else None,
    }


# --------------------------------------------------------------------------- explorer

#: The explorer's choices: every setting the lab's text and tables use is among them, so
#: that the sliders start exactly on the page's numbers (a log slider would snap 405 to
#: 10^2.6 = 398).
PARAMS_B = (1, 3, 5, 7, 13, 30, 70, 175, 405, 1_000, 2_000)
TOKENS_B = (10, 30, 100, 300, 1_000, 2_000, 5_000, 15_000, 15_600, 50_000)
GPUS = tuple(2**k for k in range(16))  # 1, 2, 4, ..., 32,768
BANDWIDTH_GB_S = (1.25, 3.125, 12.5, 25, 50, 100, 200, 450)

#: Where the explorer starts: Llama 3 405B's size and tokens, on 16,384 H100s with one
#: 400 Gb/s NIC (50 GB/s) each, plain data parallelism.
EXPLORER_START = {
    "params_b": 405,
    "tokens_b": 15_600,
    "gpus": 16_384,
    "bandwidth_gb_s": 50,
    "sharded": False,
}


def describe_setting(params_b, tokens_b, gpus, bandwidth_gb_s, sharded) -> str:
    """:func:`labsupport.estimate.walls.describe_walls` for the explorer's units."""
    return describe_walls(
        params_b * 1e9, tokens_b * 1e9, gpus, bandwidth_gb_s * GB, sharded=sharded
    )


class WallsExplorer(widgets.interactive):
    """The explorer's widget; without a kernel (a saved notebook, a website) it reads as
    one line instead of ipywidgets' ``interactive(children=...)``."""

    def __repr__(self) -> str:
        return "Walls explorer: a live widget (run this cell in JupyterLab to move its sliders)"

    def describe(self) -> str:
        """The text of the setting the controls show now."""
        return describe_setting(**self.kwargs)


def explorer() -> WallsExplorer:
    """An ipywidgets explorer: model size, tokens, GPUs and bandwidth -> which wall binds.

    Selection sliders over :data:`PARAMS_B`, :data:`TOKENS_B`, :data:`GPUS` and
    :data:`BANDWIDTH_GB_S`, and a checkbox for sharded states (ZeRO-3), starting at
    :data:`EXPLORER_START`; the last child shows :func:`describe_walls` for them. The text
    goes into an HTML widget rather than to stdout, so it is the same on every run.
    """
    style = {"description_width": "150px"}
    layout = widgets.Layout(width="560px")
    report = widgets.HTML()

    def slider(values, description, unit=""):
        options = [(f"{v:,g}{unit}", v) for v in values]
        return widgets.SelectionSlider(
            options=options, description=description, style=style, layout=layout
        )

    def show(params_b, tokens_b, gpus, bandwidth_gb_s, sharded):
        text = describe_setting(params_b, tokens_b, gpus, bandwidth_gb_s, sharded)
        report.value = f"<pre>{html.escape(text)}</pre>"

    controls = {
        "params_b": slider(PARAMS_B, "parameters", "B"),
        "tokens_b": slider(TOKENS_B, "tokens", "B"),
        "gpus": slider(GPUS, "GPUs (H100 SXM)"),
        "bandwidth_gb_s": slider(BANDWIDTH_GB_S, "bandwidth per GPU", " GB/s"),
        "sharded": widgets.Checkbox(
            description="shard the model states (ZeRO-3)", style=style, layout=layout
        ),
    }
    for name, control in controls.items():
        control.value = EXPLORER_START[name]
    box = WallsExplorer(show, **controls)
    box.children = (*box.children, report)
    return box


# --------------------------------------------------------------------------- exercises


@exercise
def check_training_days(fn) -> str:
    """Exercise 1: ``fn(num_params, num_tokens, num_gpus, peak_flops, mfu)`` in days."""
    cases = [
        (175e9, 300e9, 1024, 312e12, 0.4),
        (405e9, 15.6e12, 16384, 989e12, 0.4),
        (7e9, 2e12, 64, 989e12, 0.5),
        (1e9, 1e9, 1, 1e12, 1.0),
    ]
    for case in cases:
        got = fn(*case)
        want = training_days(training_flops(case[0], case[1]), *case[2:])
        hint = ""
        if math.isclose(got, want * SECONDS_PER_DAY, rel_tol=1e-6):
            hint = " (that is in seconds: a day has 86,400)"
        elif math.isclose(got, want / 3, rel_tol=1e-6):
            hint = " (2 FLOPs per parameter and token is the forward pass only)"
        elif math.isclose(got, want * 24, rel_tol=1e-6):
            hint = " (that is in hours)"
        assert math.isclose(got, want, rel_tol=1e-6), (
            f"num_params={case[0]:g}, num_tokens={case[1]:g}, num_gpus={case[2]}, "
            f"peak_flops={case[3]:g}, mfu={case[4]}: got {got:.6g} days, expected "
            f"{want:.6g}{hint}"
        )
    return f"{len(cases)} runs, from GPT-3 on 1,024 A100s to one GPU, in days"


@exercise
def check_min_gpus(fn) -> str:
    """Exercise 2: ``fn(num_params, gpu_memory)``, the fewest GPUs whose memory holds the
    mixed-precision Adam states when they are sharded evenly (ZeRO-3)."""
    cases = [
        (175e9, 80e9, 35),
        (7.5e9, 80e9, 2),
        (405e9, 80e9, 81),
        (1e9, 16e9, 1),
        (70e9, 40e9, 28),
        (5e9, 80e9, 1),
    ]
    for n, memory, want in cases:
        got = fn(n, memory)
        hint = ""
        if isinstance(got, int | float) and want - 1 <= got < want:
            hint = " (a whole number of GPUs that holds them all: round up)"
        assert got == want, (
            f"num_params={n:g}, gpu_memory={memory:g}: got {got}, expected {want}{hint}"
        )
    return f"{len(cases)} models, from 1B to 405B parameters, on 16 to 80 GB GPUs"


@exercise
def check_crossover(fn) -> str:
    """Exercise 3: ``fn(batch_tokens, effective_flops, bandwidth)``, the number of GPUs at
    which one step's ring all-reduce (alpha = 0) takes as long as its compute."""
    cases = [
        (3.2e6, 312e12 * 0.4, 50e9),
        (4 * 2**20, 989e12 * 0.4, 50e9),
        (1e6, 1e15, 450e9),
        (2**16, 1e14, 12.5e9),
    ]
    for tokens, flops, bandwidth in cases:
        g = fn(tokens, flops, bandwidth)
        for n in (1e9, 175e9):
            t = step_times(n, tokens, g, flops, bandwidth, mfu=1.0, alpha=0.0)
            assert math.isclose(t["compute"], t["communication"], rel_tol=1e-6), (
                f"batch_tokens={tokens:g}, effective_flops={flops:g}, bandwidth={bandwidth:g}: "
                f"at {g:.6g} GPUs, compute takes {t['compute']:.4g} s and the all-reduce "
                f"{t['communication']:.4g} s per step (model of {n:g} parameters)"
            )
    return f"{len(cases)} batches and clusters, each for a 1B and a 175B model"
