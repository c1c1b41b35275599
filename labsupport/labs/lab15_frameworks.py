"""Lab 15, frameworks: DeepSpeed's JSON config and its engine on the course GPT, next to
the course's own ZeRO (:mod:`labsupport.parallel.zero`), and the exercises' checkers.

DeepSpeed picks its *accelerator* when it is first imported
(:mod:`labsupport.parallel.deepspeed_setup` chooses it); its CPU accelerator talks over
gloo here, the course's laptop setting. The launcher (``deepspeed``) is in
:mod:`labsupport.labs.lab15_launcher`, BLOOM's launch in
:mod:`labsupport.labs.lab15_megatron`. DeepSpeed 0.19.8.
"""

from __future__ import annotations

import contextlib
import gc
import io
import os
import time
import warnings

import torch
import torch.distributed as dist

from labsupport.comm.metrics import mean_over_ranks
from labsupport.labs.cells import exercise
from labsupport.launch.progress import progress, status
from labsupport.launch.runtime import device
from labsupport.models import batch_share, random_tokens, tiny_gpt
from labsupport.parallel.deepspeed_setup import (
    BUILDING_SHM_COMM,
    cpu_accelerator,
    shm_comm_needs_building,
    use_deepspeed_accelerator,
)
from labsupport.parallel.zero import ZeRO

#: The run both frameworks train: the course GPT, 16 sequences of 32 tokens per step.
BATCH, SEQ, VOCAB, LR, STEPS = 16, 32, 256, 1e-3, 3


def build_deepspeed_ops() -> dict:
    """Build (or load from ``~/.cache/torch_extensions``) the C++ op DeepSpeed's CPU
    accelerator compiles the first time a process group starts: the shared-memory
    all-reduce (``ShareMemCommBuilder``); when it is not built yet, says so first (about
    a minute). Returns the seconds it took and whether it was built now (rather than
    found built)."""
    with cpu_accelerator():
        from deepspeed.accelerator import get_accelerator

        builder = get_accelerator().create_op_builder("ShareMemCommBuilder")
        if shm_comm_needs_building():
            status(BUILDING_SHM_COMM)
    start, began = time.perf_counter(), time.time()
    with contextlib.redirect_stdout(io.StringIO()):  # ninja's "no work to do"
        module = builder.load(verbose=False)
    seconds = time.perf_counter() - start
    return {
        "op": builder.NAME,
        "seconds": seconds,
        "built": os.path.getmtime(module.__file__) >= began,
    }


def deepspeed_config(stage: int, offload: bool = False, world_size: int = 4, defaults=False):
    """The JSON config of chapter 15, as a dict: the course's batch, fp32, Adam, ZeRO ``stage``.

    ``adam_w_mode: false`` makes DeepSpeed's ``"Adam"`` Adam: without it, it is AdamW
    (``torch.optim.AdamW`` with ``torch_adam``, weight decay 0.01 by default).
    ``offload`` keeps the optimizer states (and Adam's step) in host memory. Unless
    ``defaults``, stage 3 gets a gradient bucket as large as this model's largest
    parameter (2¹⁴ elements) and shards every parameter: DeepSpeed's defaults suit GPUs
    with tens of GB (``reduce_bucket_size`` 5·10⁸ elements, a 2 GB fp32 buffer) and keep
    whole every parameter under 10⁵ elements (``stage3_param_persistence_threshold``),
    which is every parameter of this model. Stages 1 and 2 keep the default bucket: they
    allocate it during each backward and free it before the step
    (``stage_1_and_2.py``: ``setup_buckets``, ``_release_ipg_buffers``), so the bytes
    counted after the step do not include it.
    """
    zero = {"stage": stage}
    if stage == 3 and not defaults:
        zero.update(reduce_bucket_size=2**14, stage3_param_persistence_threshold=0)
    if offload:
        zero["offload_optimizer"] = {"device": "cpu"}
    return {
        "train_batch_size": BATCH,
        "train_micro_batch_size_per_gpu": BATCH // world_size,
        "gradient_accumulation_steps": 1,
        "optimizer": {
            "type": "Adam",
            "params": {"lr": LR, "torch_adam": True, "adam_w_mode": False},
        },
        "bf16": {"enabled": False},
        "zero_optimization": zero,
        "steps_per_print": 10**9,
    }


def live_tensor_bytes() -> int:
    """Bytes of every tensor storage alive in this process (each storage once)."""
    gc.collect()
    storages = {}
    for obj in gc.get_objects():
        with contextlib.suppress(Exception):  # objects that are half torn down
            if isinstance(obj, torch.Tensor) and not obj.is_meta:
                storage = obj.untyped_storage()
                storages[storage.data_ptr()] = max(
                    storages.get(storage.data_ptr(), 0), storage.nbytes()
                )
    storages.pop(0, None)  # freed storages (ZeRO-3 parameters between uses)
    return sum(storages.values())


def _batch(step: int):
    """This rank's part of step ``step``'s global batch, on its device."""
    mine = batch_share(BATCH, dist.get_rank(), dist.get_world_size())
    return tuple(t[mine].to(device()) for t in random_tokens(BATCH, SEQ, VOCAB, seed=step))


def train_deepspeed(config: dict, steps: int = STEPS) -> dict:
    """``deepspeed.initialize`` on the course GPT, then ``steps`` steps: the losses
    (averaged over the ranks), the optimizer the engine built, and the bytes this rank
    holds after the last step (:func:`live_tensor_bytes`, less what was alive before the
    model was built): model states and DeepSpeed's buffers. The loop keeps each forward's
    loss, not its logits, which would add the last micro-batch's (4 x 32 x 256 fp32 on 4
    ranks: 131,072 bytes) to the count."""
    use_deepspeed_accelerator()
    import deepspeed

    before = live_tensor_bytes()
    model = tiny_gpt(0, block_size=SEQ)
    with contextlib.redirect_stdout(io.StringIO()):  # "... built successfully", each time
        engine, optimizer, _, _ = deepspeed.initialize(
            model=model, model_parameters=model.parameters(), config=config
        )
    losses = []
    for step in range(steps):
        loss = engine(*_batch(step))[1]  # the engine calls the model: (logits, loss)
        engine.backward(loss)  # backward, and ZeRO's gradient reduction
        engine.step()  # the optimizer step (and the all-gather of new parameters)
        losses.append(mean_over_ranks(loss))
    del loss
    held = live_tensor_bytes() - before
    inner = optimizer.optimizer  # the torch optimizer inside DeepSpeed's ZeRO wrapper
    moments = [t for state in inner.state.values() for t in state.values()]
    adam = sum(t.nbytes for t in moments if isinstance(t, torch.Tensor) and t.dim() > 0)
    return {
        "losses": losses,
        "bytes": held,
        "adam_bytes": adam,
        "optimizer": f"{type(optimizer).__name__}({type(inner).__name__})",
        "weight_decay": inner.param_groups[0]["weight_decay"],
    }


def train_course(stage: int, steps: int = STEPS) -> dict:
    """The same run with the course's :class:`~labsupport.parallel.zero.ZeRO`, counted
    the same way."""
    before = live_tensor_bytes()
    model = tiny_gpt(0, block_size=SEQ).to(device())
    zero = ZeRO(model, stage, lr=LR)
    losses = []
    for step in range(steps):
        zero.zero_grad()
        loss = model(*_batch(step))[1]
        loss.backward()
        zero.step()
        losses.append(mean_over_ranks(loss))
    del loss
    held, adam = live_tensor_bytes() - before, zero.state_bytes()["optimizer states"]
    return {"losses": losses, "bytes": held, "adam_bytes": adam, "optimizer": "ZeRO(Adam)"}


#: The runs the lab compares: (label, ZeRO stage, optimizer offload, DeepSpeed's defaults).
RUNS = [
    ("ZeRO-1", 1, False, False),
    ("ZeRO-2", 2, False, False),
    ("ZeRO-2 + offload", 2, True, False),
    ("ZeRO-3", 3, False, False),
    ("ZeRO-3, DeepSpeed's defaults", 3, False, True),
]


def compare(runs=RUNS, steps: int = STEPS) -> list[dict]:
    """Each run of ``runs`` with DeepSpeed, next to the course's ZeRO at the same stage
    (offload has no course counterpart). The course's runs go first: DeepSpeed's ZeRO-3
    replaces ``torch.nn.functional.linear`` for the rest of the process (its
    ``memory_efficient_linear``), so the DeepSpeed runs go after them, ZeRO-3 last.
    Only the first ``deepspeed.initialize`` of a process is slow: it imports
    ``torch._dynamo``. A bar per rank shows the runs done, live."""
    world = dist.get_world_size()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)  # deprecation notes from torch
        stages = sorted({r[1] for r in runs})
        ours = {stage: train_course(stage, steps) for stage in progress(stages, "course ZeRO")}
        rows = []
        for label, stage, offload, defaults in progress(runs, "DeepSpeed"):
            config = deepspeed_config(stage, offload, world, defaults)
            theirs = train_deepspeed(config, steps)
            rows.append({"run": label, "stage": stage, "course": ours[stage], "deepspeed": theirs})
    return rows


def same_losses(a: list, b: list, ulps: int = 64) -> bool:
    """Whether two loss curves agree to ``ulps`` units of 2⁻²⁴, relative (float32's
    rounding: a loss near 5.5 has 1.4 such units per last bit).

    The two frameworks sum the ranks' gradients in another order (DeepSpeed divides by
    the world size first and reduces in buckets), so each gradient element differs by
    a few roundings of 2⁻²⁴. Adam's step m/√v does not depend on the scale of the
    gradient, so those relative differences reach the weights multiplied by the learning
    rate: far below a weight's last bit, except for the odd element that rounds the
    other way. The losses computed from those weights then agree to a few units: this
    lab measures at most 3 over its 3 steps, and 64 is a wide margin.
    """
    eps = torch.finfo(torch.float32).eps / 2  # 2⁻²⁴: the relative rounding of float32
    return len(a) == len(b) and all(
        abs(x - y) <= ulps * eps * abs(x) for x, y in zip(a, b, strict=True)
    )


# --------------------------------------------------------------------------- exercises


def accumulation_steps(train_batch_size: int, micro_batch_per_gpu: int, world_size: int) -> int:
    """DeepSpeed's rule: train_batch_size = micro-batch per GPU x accumulation x world."""
    steps, left = divmod(train_batch_size, micro_batch_per_gpu * world_size)
    if left or steps < 1:
        raise ValueError(
            f"train_batch_size {train_batch_size} is not a multiple of micro-batch "
            f"{micro_batch_per_gpu} x world size {world_size}"
        )
    return steps


@exercise
def check_accumulation_steps(fn) -> str:
    """Exercise 1: ``fn(train_batch_size, micro_batch_per_gpu, world_size)``."""
    cases = [(16, 4, 4), (64, 4, 4), (2048, 2, 8), (192, 1, 8), (96, 3, 4), (8, 8, 1)]
    for batch, micro, world in cases:
        got, want = fn(batch, micro, world), accumulation_steps(batch, micro, world)
        assert got == want, (
            f"train_batch_size={batch}, micro batch {micro} per GPU, {world} GPUs: got "
            f"{got!r}, but DeepSpeed accumulates another number of micro-batches (how many "
            "samples does one micro-batch step process on all the GPUs together?)"
        )
    for batch, micro, world in [(60, 4, 4), (16, 32, 1)]:
        try:
            got = fn(batch, micro, world)
        except ValueError:
            continue
        raise AssertionError(
            f"train_batch_size={batch}, micro batch {micro}, {world} GPUs: got {got!r}; "
            "no whole number of micro-batches makes that batch: raise ValueError"
        )
    return "the accumulation steps DeepSpeed derives, and ValueError where none fits"


def bloom_layout(nodes, gpus_per_node, tp, pp, global_batch, micro_batch) -> dict:
    """The data-parallel size of a Megatron launch, and the micro-batches each pipeline
    runs per step (its gradient accumulation)."""
    world = nodes * gpus_per_node
    dp, left = divmod(world, tp * pp)
    if left:
        raise ValueError(f"{world} GPUs do not split into replicas of tp x pp = {tp * pp}")
    micro_batches, left = divmod(global_batch, micro_batch * dp)
    if left:
        raise ValueError(f"global batch {global_batch} is not a multiple of {micro_batch} x {dp}")
    return {"data_parallel": dp, "gpus_per_replica": tp * pp, "micro_batches": micro_batches}


@exercise
def check_bloom_layout(fn) -> str:
    """Exercise 2: ``fn(nodes, gpus_per_node, tp, pp, global_batch, micro_batch)``."""
    cases = [
        (48, 8, 4, 12, 2048, 2),
        (48, 8, 4, 12, 192, 1),  # BLOOM's first steps: micro-batches of 1 until 784
        (24, 8, 4, 12, 2048, 2),
        (2, 4, 2, 2, 64, 4),
        (1, 8, 8, 1, 8, 1),
    ]
    for case in cases:
        got, want = fn(*case), bloom_layout(*case)
        for key, value in want.items():
            assert isinstance(got, dict) and got.get(key) == value, (
                f"nodes, gpus_per_node, tp, pp, global_batch, micro_batch = {case}: "
                f"{key} is {got.get(key) if isinstance(got, dict) else got!r}, not what "
                "Megatron computes (a replica holds one copy of the model: how many GPUs?)"
            )
    for case in [(48, 8, 4, 10, 2048, 2), (48, 8, 4, 12, 2040, 2)]:
        try:
            got = fn(*case)
        except ValueError:
            continue
        raise AssertionError(f"{case}: got {got!r}; that launch does not divide: raise ValueError")
    return "data-parallel size, GPUs per replica and micro-batches of four launches"
