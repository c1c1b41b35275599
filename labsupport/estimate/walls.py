"""The three walls of chapter 3: which one binds first for data-parallel training.

* **Compute**: 6·N·D FLOPs (:mod:`labsupport.estimate.flops`);
* **memory**: 16 bytes of model state per parameter (:mod:`labsupport.estimate.memory`);
* **communication**: a data-parallel step all-reduces the gradients; a ring sends
  2(N-1)/N of them out of every rank (Patarasuk and Yuan 2009), which
  :func:`labsupport.comm.cost.all_reduce_time` turns into seconds.

:func:`step_times` gives one step's compute and communication, :func:`walls` which wall
binds, :func:`describe_walls` says it in words, :func:`crossover_devices` where
communication overtakes compute. GPUs are named as in
:data:`labsupport.estimate.datasheets.DEVICES`.
"""

from __future__ import annotations

from labsupport.comm.cost import all_reduce_time
from labsupport.estimate.datasheets import ASSUMED_ALPHA, ASSUMED_MFU, device_spec
from labsupport.estimate.flops import SECONDS_PER_DAY, training_flops
from labsupport.estimate.memory import training_memory
from labsupport.estimate.units import GB

BATCH_TOKENS = 1024 * 4096
"""Llama 3 405B's *first* global batch: 1,024 sequences of 4,096 tokens, the paper's "4M"
(4 x 2^20 = 4,194,304 tokens; Grattafiori et al. 2024, section 3.4.1). The paper doubles it
to 8M tokens in sequences of 8,192 after 252M tokens, and to 16M after 2.87T tokens: that
*final* batch, four times this one, is ``datasheets.MODELS["Llama 3 405B"]["batch_tokens"]``.
The smallest batch is the one at which communication binds soonest."""


def step_times(
    num_params,
    batch_tokens,
    devices,
    peak_flops,
    bandwidth,
    mfu=ASSUMED_MFU,
    alpha=ASSUMED_ALPHA,
    grad_bytes=2,
    sharded=False,
) -> dict:
    """Seconds of compute and of gradient communication in one data-parallel step.

    Compute: 6·N·(batch tokens) FLOPs, split over ``devices`` at ``mfu`` of
    ``peak_flops``. Communication: a ring all-reduce of the 16-bit gradients (2 bytes
    per parameter) at ``bandwidth`` bytes/s per direction and ``alpha`` s per message,
    :func:`labsupport.comm.cost.all_reduce_time`. ``sharded=True`` models ZeRO-3 / FSDP,
    which moves 1.5 times as much (Rajbhandari et al. 2020, section 7). No overlap of
    communication with compute is assumed: both are what a step would take alone.
    """
    compute = training_flops(num_params, batch_tokens) / (devices * peak_flops * mfu)
    nbytes = grad_bytes * num_params
    communication = float(all_reduce_time("ring", devices, nbytes, alpha, 1 / bandwidth))
    if sharded:
        communication *= 1.5
    return {"compute": compute, "communication": communication}


def walls(
    num_params,
    num_tokens,
    devices,
    bandwidth,
    gpu: str = "H100 SXM",
    mfu=ASSUMED_MFU,
    batch_tokens=BATCH_TOKENS,
    alpha=ASSUMED_ALPHA,
    sharded=False,
) -> dict:
    """Which wall binds first for data-parallel training of a dense model.

    In order: the **memory wall** binds if the model states (16 bytes per parameter,
    divided by ``devices`` when ``sharded``, as in ZeRO-3) exceed one GPU's memory;
    otherwise the **communication wall** binds if the gradient all-reduce takes longer
    than the step's compute; otherwise the **compute wall**: the run takes as long as
    its FLOPs say. Activations are left out (they depend on the architecture and on
    recomputation; see :func:`activation_memory`).
    """
    spec = device_spec(gpu)
    states = sum(training_memory(num_params).values())
    per_device = states / devices if sharded else states
    step = step_times(
        num_params, batch_tokens, devices, spec["tensor"], bandwidth, mfu, alpha, sharded=sharded
    )
    steps = num_tokens / batch_tokens
    if per_device > spec["memory_bytes"]:
        binds = "memory"
    elif step["communication"] > step["compute"]:
        binds = "communication"
    else:
        binds = "compute"
    return {
        "flops": training_flops(num_params, num_tokens),
        "compute_days": steps * step["compute"] / SECONDS_PER_DAY,
        "communication_days": steps * step["communication"] / SECONDS_PER_DAY,
        "state_bytes_per_device": per_device,
        "device_memory": spec["memory_bytes"],
        "step_compute": step["compute"],
        "step_communication": step["communication"],
        "binds": binds,
    }


ADVICE = {
    "memory": "shard the model states (ZeRO, FSDP: ch. 14) or split the model (ch. 11-13)",
    "communication": "fewer, larger steps, overlap (ch. 10), or model parallelism (ch. 11-13)",
    "compute": "more GPUs (or better MFU: ch. 4) shorten the run",
}


def describe_walls(num_params, num_tokens, devices, bandwidth, sharded=False, **kw) -> str:
    """A few lines of text: the three walls for one setting, and which one binds."""
    w = walls(num_params, num_tokens, devices, bandwidth, sharded=sharded, **kw)
    gpu = kw.get("gpu", "H100 SXM")
    strategy = "ZeRO-3 / FSDP" if sharded else "data parallel"
    fits = "fits" if w["state_bytes_per_device"] <= w["device_memory"] else "does not fit"
    lines = [
        f"{num_params / 1e9:,.0f}B parameters, {num_tokens / 1e9:,.0f}B tokens, "
        f"{devices:,} x {gpu} at {kw.get('mfu', ASSUMED_MFU):.0%} MFU, "
        f"{bandwidth / GB:g} GB/s per GPU, {strategy}",
        f"  compute:       {w['flops']:.2e} FLOPs = {w['compute_days']:,.1f} days of compute",
        f"  memory:        {w['state_bytes_per_device'] / GB:,.1f} GB of model states per GPU "
        f"({fits} in {w['device_memory'] / GB:.0f} GB)",
        f"  communication: {w['step_communication']:.3g} s of all-reduce per step, "
        f"against {w['step_compute']:.3g} s of compute",
        f"  -> the {w['binds']} wall binds: {ADVICE[w['binds']]}",
    ]
    return "\n".join(lines)


def crossover_devices(batch_tokens, effective_flops, bandwidth):
    """GPUs beyond which a ring all-reduce of 16-bit gradients outlasts a step's compute.

    Compute 6·N·B/(G·F) equals communication 2(G-1)/G · 2N/bandwidth (alpha neglected)
    at G = 1 + 1.5·B·bandwidth/F, whatever N: both grow in proportion to the model.
    """
    return 1 + 1.5 * batch_tokens * bandwidth / effective_flops
