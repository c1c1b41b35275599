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
from labsupport.launch.runtime import device
from labsupport.measure.flops import count_flops
from labsupport.measure.memory import saved_tensors
from labsupport.models import GPT, GPTConfig, random_tokens

#: The lab's GPT: small enough for a laptop core, with attention written out (so every
#: tensor the activation formula counts is one autograd saves) and dropout on.
LAB_GPT = {"vocab_size": 256, "block_size": 64, "n_layer": 2, "n_head": 4, "n_embd": 64,
           "dropout": 0.1, "attention": "math"}  # fmt: skip


def build(seed: int = 0, **overrides) -> GPT:
    """The lab's GPT (:data:`LAB_GPT` with ``overrides``), weights drawn from ``seed``, in
    training mode, on :func:`labsupport.launch.runtime`."""
    torch.manual_seed(seed)
    return GPT(GPTConfig(**(LAB_GPT | overrides))).to(device()).train()


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
    from ``torch.distributed.all_reduce`` is the reference.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    model = build(seed, **config)
    idx, targets = batch(model, batch_per_rank, seed + 1 + rank)
    model(idx, targets)[1].backward()
    grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    reference = grads.clone()
    dist.all_reduce(reference)
    with comm.count_traffic() as traffic:
        comm.all_reduce(grads)
    return {
        "rank": rank,
        "numel": grads.numel(),
        "bytes_sent": traffic.bytes_sent,
        "messages": len(traffic.messages),
        "max_diff_vs_torch": (grads - reference).abs().max().item(),
        "mean_gradient": (grads / world).cpu() if rank == 0 else None,
    }


def explorer():
    """An ipywidgets explorer: model size, tokens, devices and bandwidth -> which wall binds.

    Returns an ``ipywidgets.interactive`` whose last child shows :func:`describe_walls`
    for the sliders' values, starting from Llama 3 405B's size and tokens on 16,384 H100s
    at 50 GB/s. The text goes into an HTML widget rather than to stdout, so the stored
    notebook holds it in the widget state, the same on every run.
    """
    style = {"description_width": "150px"}
    layout = widgets.Layout(width="520px")
    report = widgets.HTML()

    def show(params_b, tokens_b, devices, bandwidth_gb_s, sharded):
        text = describe_walls(params_b * 1e9, tokens_b * 1e9, devices, bandwidth_gb_s * GB,
                              sharded=sharded)  # fmt: skip
        report.value = f"<pre>{html.escape(text)}</pre>"

    box = widgets.interactive(
        show,
        params_b=widgets.FloatLogSlider(value=405, base=10, min=-1, max=4, step=0.05,
                                        description="parameters (B)", style=style,
                                        layout=layout, readout_format=".3g"),
        tokens_b=widgets.FloatLogSlider(value=15_600, base=10, min=0, max=5, step=0.05,
                                        description="tokens (B)", style=style,
                                        layout=layout, readout_format=".3g"),
        devices=widgets.IntSlider(value=16_384, min=1, max=32_768, step=1,
                                  description="GPUs (H100)", style=style, layout=layout),
        bandwidth_gb_s=widgets.FloatLogSlider(value=50, base=10, min=0, max=3, step=0.05,
                                              description="bandwidth (GB/s)", style=style,
                                              layout=layout, readout_format=".3g"),
        sharded=widgets.Checkbox(value=False, description="shard states (ZeRO-3)",
                                 style=style),
    )  # fmt: skip
    box.children = (*box.children, report)
    return box


def check_training_days(fn) -> None:
    """Exercise 1: ``fn(num_params, num_tokens, num_gpus, peak_flops, mfu)`` in days."""
    cases = [
        (175e9, 300e9, 1024, 312e12, 0.4),
        (405e9, 15.6e12, 16384, 989e12, 0.4),
        (7e9, 2e12, 64, 989e12, 0.5),
        (1e9, 1e9, 1, 1e12, 1.0),
    ]
    for case in cases:
        got = float(fn(*case))
        want = training_days(training_flops(case[0], case[1]), *case[2:])
        hint = ""
        if math.isclose(got, want * SECONDS_PER_DAY, rel_tol=1e-6):
            hint = " (that is in seconds: a day has 86,400)"
        elif math.isclose(got, want / 3, rel_tol=1e-6):
            hint = " (2 FLOPs per parameter and token is the forward pass only)"
        assert math.isclose(got, want, rel_tol=1e-6), (
            f"num_params={case[0]:g}, num_tokens={case[1]:g}, num_gpus={case[2]}: got "
            f"{got:.6g} days, expected {want:.6g}{hint}"
        )
    print("Correct: 6·N·D FLOPs / (GPUs × peak × MFU), in days.")


def check_min_gpus(fn) -> None:
    """Exercise 2: ``fn(num_params, gpu_memory)``, the fewest GPUs whose memory holds the
    mixed-precision Adam states when they are sharded evenly (ZeRO-3)."""
    cases = [(175e9, 80e9, 35), (7.5e9, 80e9, 2), (405e9, 80e9, 81), (1e9, 16e9, 1),
             (70e9, 40e9, 28), (5e9, 80e9, 1)]  # fmt: skip
    for n, memory, want in cases:
        got = fn(n, memory)
        assert got == want, f"num_params={n:g}, gpu_memory={memory:g}: got {got}, expected {want}"
    print("Correct: ceil(16·N / memory) GPUs, before any activation.")


def check_crossover(fn) -> None:
    """Exercise 3: ``fn(batch_tokens, effective_flops, bandwidth)``, the number of GPUs at
    which one step's ring all-reduce (alpha = 0) takes as long as its compute."""
    cases = [(3.2e6, 312e12 * 0.4, 50e9), (4 * 2**20, 989e12 * 0.4, 50e9),
             (1e6, 1e15, 450e9), (2**16, 1e14, 12.5e9)]  # fmt: skip
    for tokens, flops, bandwidth in cases:
        g = float(fn(tokens, flops, bandwidth))
        for n in (1e9, 175e9):
            t = step_times(n, tokens, g, flops, bandwidth, mfu=1.0, alpha=0.0)
            assert math.isclose(t["compute"], t["communication"], rel_tol=1e-6), (
                f"batch_tokens={tokens:g}, F={flops:g}, bandwidth={bandwidth:g}: at {g:.6g} "
                f"GPUs, compute takes {t['compute']:.4g} s and the all-reduce "
                f"{t['communication']:.4g} s per step (model of {n:g} parameters)"
            )
    print("Correct: G = 1 + 1.5·B·bandwidth / F, whatever the model's size.")
