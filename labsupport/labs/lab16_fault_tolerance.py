"""Lab 16, fault tolerance: the pieces of a training run that checkpoints (its loop is
in the notebook), a rank killed by SIGKILL, the resume that continues it exactly, a
checkpoint of 4 ranks loaded by 2, a damaged checkpoint refused and passed over, and
asynchronous checkpoints.

The run trains the course GPT, with dropout, data-parallel with the course's ZeRO-1
(:mod:`labsupport.parallel.zero`) and Adam, a learning rate that warms up and decays,
and a data set read in a new order every epoch. Its checkpoints
(:mod:`labsupport.parallel.checkpoint`) hold everything it needs to go on exactly: the
parameters and Adam's states (sharded over the ranks), the step (from which the
learning rate and the position in the data follow), every rank's random-number
generator, and the losses so far; and the SHA-256 of each of its files, checked before
it is loaded.
"""

from __future__ import annotations

import math
import os
import re
import signal
import textwrap
import time

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from labsupport.launch.runtime import device
from labsupport.models import batch_share, random_tokens, tiny_gpt
from labsupport.parallel import checkpoint as ck
from labsupport.parallel.zero import ZeRO

#: 16 sequences of 32 tokens per step from a data set of 64: 4 steps per epoch.
BATCH, SEQ, VOCAB, DATASET = 16, 32, 256, 64
#: 12 steps, a checkpoint every 4, a peak learning rate after 3 steps of warm-up.
STEPS, EVERY, LR, WARMUP = 12, 4, 3e-3, 3


def learning_rate(step: int, steps: int = STEPS) -> float:
    """Linear warm-up for :data:`WARMUP` steps, then cosine decay to a tenth: a function
    of the step alone, so the step is all a checkpoint needs to restore it."""
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    progress = (step - WARMUP) / max(1, steps - WARMUP)
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batch(step: int):
    """This rank's part of step ``step``'s batch: the data set is read in an order
    shuffled anew each epoch (seeded by the epoch), so the step fixes the position."""
    tokens, targets = random_tokens(DATASET, SEQ, VOCAB, seed=1234)
    epoch, i = divmod(step, DATASET // BATCH)
    order = torch.randperm(DATASET, generator=torch.Generator().manual_seed(epoch))
    share = batch_share(BATCH, dist.get_rank(), dist.get_world_size())
    mine = order[i * BATCH : (i + 1) * BATCH][share]
    return tokens[mine].to(device()), targets[mine].to(device())


def new_run(stage: int = 1):
    """The model (the same on every rank) and its ZeRO optimizer; then each rank seeds
    its own generator, so the ranks draw different dropout masks."""
    model = tiny_gpt(0, block_size=SEQ, dropout=0.1).to(device())
    zero = ZeRO(model, stage, lr=LR)
    torch.manual_seed(1000 + dist.get_rank())
    return model, zero


def training_state(zero: ZeRO, step: int, losses: list) -> dict:
    """Everything the run needs to go on exactly (every rank calls it)."""
    return {"zero": ck.zero_state(zero), "step": step, "rng": ck.rng_state(), "losses": losses}


def checkpoint_path(root: str, step: int) -> str:
    return os.path.join(root, f"step{step:05d}")


def latest_checkpoint(root: str) -> str | None:
    """The newest checkpoint under ``root`` that is complete and intact. One that a
    failure interrupted while it was written has no checksums (written last); one
    damaged since has a file that no longer matches its checksum. Each is passed over,
    with a line that says why."""
    if not os.path.isdir(root):
        return None
    steps = [d for d in os.listdir(root) if re.fullmatch(r"step\d+", d)]
    for name in sorted(steps, key=lambda d: int(d[4:]), reverse=True):
        path = os.path.join(root, name)
        try:
            ck.verify(path)
        except ck.CheckpointError as refused:
            passed = f"passed over: {str(refused).replace(path, name)}"
            print(textwrap.fill(passed, 79, subsequent_indent="  "))
        else:
            return path
    return None


def zero_block(file: str, size: int = 4096) -> None:
    """Overwrite ``size`` bytes in the middle of ``file`` with zeros, in place, as a
    failing disk can: the file keeps its size."""
    with open(file, "r+b") as f:
        f.seek(os.path.getsize(file) // 2)
        f.write(bytes(size))


#: What :func:`restore` can leave out of a resume, to see that each is needed.
PARTS = ("optimizer states", "RNG states", "step")


def restore(state: dict, zero: ZeRO, leave_out=()) -> tuple[int, list]:
    """After :func:`~labsupport.parallel.checkpoint.load` of a checkpoint into ``state``
    (:func:`training_state`'s, whose tensors it filled in place): rebuild the ZeRO
    parameters, set this rank's generator, and return the step to go on from and the
    losses so far. ``leave_out`` names parts of :data:`PARTS` to start afresh instead, as
    if the checkpoint had not saved them."""
    ck.restore_zero(zero)
    ck.set_rng_state(state["rng"])
    if "optimizer states" in leave_out:
        zero.optimizer.state.clear()  # Adam starts again: no moments, step 0
    if "RNG states" in leave_out:
        torch.manual_seed(1000 + dist.get_rank())
    step = 0 if "step" in leave_out else state["step"]
    return step, list(state["losses"])


def train_step(model, zero: ZeRO, step: int, steps: int = STEPS) -> float:
    """One step of the run: the step's learning rate, forward and loss on this rank's
    share of the step's batch, backward, and ZeRO-1's step (reduce-scatter the gradients,
    Adam on this rank's shard, all-gather the parameters). Returns the loss of the whole
    batch (the mean over the ranks)."""
    for group in zero.optimizer.param_groups:
        group["lr"] = learning_rate(step, steps)
    zero.zero_grad()
    _, loss = model(*batch(step))
    loss.backward()
    zero.step()
    total = loss.detach().clone()
    dist.all_reduce(total)
    return total.item() / dist.get_world_size()


def fail_here(kill, step: int) -> None:
    """``kill=(rank, step)``: that rank kills itself with SIGKILL as that step begins, as
    a failed GPU would stop its process (no exception, no clean-up)."""
    if kill is not None and (dist.get_rank(), step) == tuple(kill):
        os.kill(os.getpid(), signal.SIGKILL)


def first_difference(losses: list, reference: list) -> int | None:
    """The first step whose loss differs from ``reference``'s, or ``None``."""
    pairs = zip(losses, reference, strict=False)  # a run that restarted at 0 is longer
    return next((i for i, (a, b) in enumerate(pairs) if a != b), None)


def gathered_state(path: str, verified: bool = True) -> dict:
    """Load the checkpoint at ``path`` on however many ranks run this, and put every
    shard back together: the full parameters and Adam moments, as flat tensors.
    ``verified=False``: load with DCP alone, which checks no checksum."""
    _, zero = new_run()
    state = training_state(zero, 0, [])
    if verified:
        ck.load(state, path)
    else:
        dcp.load(state, checkpoint_id=path)
    keys = ("parameters", "exp_avg", "exp_avg_sq")
    whole = {
        f"{unit}.{key}": parts[key].full_tensor().cpu()
        for unit, parts in state["zero"].items()
        for key in keys
    }
    return whole


# --------------------------------------------------------------------------- async


def async_checkpoint(root: str, steps: int = EVERY) -> dict:
    """Train ``steps`` steps, then write the run's state twice: with
    :func:`~labsupport.parallel.checkpoint.save` (training waits until it is written) and
    with :func:`~labsupport.parallel.checkpoint.save_async` (training waits for the copy
    only, and takes its next step while the writer works). Returns the seconds a step
    took, the seconds training waited for each checkpoint, whether the asynchronous
    checkpoint holds the parameters as they were when it was started, and whether the
    step taken meanwhile changed them."""
    model, zero = new_run()
    began = time.perf_counter()
    losses = [train_step(model, zero, step) for step in range(steps)]
    step_s = (time.perf_counter() - began) / steps
    state = training_state(zero, steps, losses)
    dist.barrier()
    began = time.perf_counter()
    ck.save(state, os.path.join(root, "blocking"))
    blocking = time.perf_counter() - began
    writer_group = dist.new_group(backend="gloo")  # the writer's collectives, not training's
    expected = [unit.shard.detach().clone() for _, unit in zero.units]
    dist.barrier()
    began = time.perf_counter()
    future = ck.save_async(state, os.path.join(root, "async"), writer_group)
    returned = time.perf_counter() - began
    train_step(model, zero, steps)  # training goes on while the checkpoint is written
    future.result()
    written = time.perf_counter() - began
    _, fresh = new_run()
    ck.load(training_state(fresh, 0, []), os.path.join(root, "async"))
    held = all(
        torch.equal(unit.shard.detach(), want)
        for (_, unit), want in zip(fresh.units, expected, strict=True)
    )
    moved = not all(
        torch.equal(unit.shard.detach(), want)
        for (_, unit), want in zip(zero.units, expected, strict=True)
    )
    return {
        "step_s": step_s,
        "blocking_s": blocking,
        "async_returned_s": returned,
        "async_written_s": written,
        "held_the_state": held,
        "training_went_on": moved,
    }
