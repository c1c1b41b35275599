"""Lab 10, data parallelism: the lab's GPT and its data (the training loop itself is in
the notebook), what the ranks must reproduce, one step's timeline and its bytes counted,
both through communication hooks (torch's ``register_comm_hook``); the bucket size swept.
The model of overlap is :mod:`labsupport.estimate.overlap`; the profiler, the sampler and
the first exercises' checkers are in :mod:`labsupport.labs.lab10_tools`, the gradient-hook
exercise in :mod:`labsupport.labs.lab10_exercises`.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from labsupport.comm.allreduce import all_reduce, bytes_sent
from labsupport.comm.p2p import count_traffic
from labsupport.launch.runtime import device
from labsupport.measure.timing import side_by_side
from labsupport.models import GPT, batch_share, random_tokens, tiny_gpt, train_one_process
from labsupport.parallel.data_parallel import DistributedDataParallel

#: The lab's GPT (the benchmark's, bench/ddp.py): 4 layers, d = 128, 128 tokens, 256 ids.
CONFIG = {"vocab_size": 256, "block_size": 128, "n_layer": 4, "n_head": 4, "n_embd": 128}
#: Sequences per rank and step, and the learning rate of plain SGD.
BATCH, LR = 2, 0.1


def make_gpt() -> GPT:
    """The lab's GPT, the same weights on every rank (seed 0)."""
    return tiny_gpt(0, **CONFIG)


def global_batch(step: int, world: int):
    """The ``(idx, targets)`` of every rank together at ``step``: ``BATCH * world`` sequences."""
    return random_tokens(BATCH * world, CONFIG["block_size"], CONFIG["vocab_size"], seed=step)


def my_share(step: int) -> tuple:
    """This rank's :data:`BATCH` sequences of :func:`global_batch` at ``step``, on its device."""
    rank, world = dist.get_rank(), dist.get_world_size()
    mine = batch_share(BATCH * world, rank, world)
    return tuple(t[mine].to(device()) for t in global_batch(step, world))


def single_process(steps: int, world: int, lr: float = LR) -> tuple[dict, list]:
    """What the ranks must reproduce: one process, the whole global batch each step.
    Returns the parameters after, by name, and each step's loss."""
    model = make_gpt()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)
    batches = (global_batch(step, world) for step in range(steps))
    losses = train_one_process(model, optimizer, batches)
    return {n: p.detach() for n, p in model.named_parameters()}, losses


def max_difference(a: dict, b: dict) -> float:
    """The largest difference between two sets of parameters, element by element."""
    return max((a[n] - b[n]).abs().max().item() for n in a)


# --------------------------------------------------------------------------- one step


def timed_allreduce(events: list, bucket):
    """A communication hook (``ddp.register_comm_hook(events, timed_allreduce)``, for
    ours or torch's DDP): torch's default all-reduce hook, with the time each bucket's
    all-reduce started and finished appended to ``events`` (the finish by a callback on
    its future, which the communication thread runs)."""
    index = bucket.index()
    events.append((f"all-reduce start bucket {index}", time.perf_counter()))

    def finished(fut):
        events.append((f"all-reduce finished bucket {index}", time.perf_counter()))
        return fut.value()

    return default_hooks.allreduce_hook(None, bucket).then(finished)


def record_gradients(model: nn.Module, events: list) -> None:
    """Append ``("grad NAME", time)`` to ``events`` as each gradient of ``model`` is
    ready. Registered before the model is wrapped, these hooks run before DDP's."""
    for name, p in model.named_parameters():
        if p.requires_grad:
            p.register_post_accumulate_grad_hook(
                lambda _, name=name: events.append((f"grad {name}", time.perf_counter()))
            )


def step_timeline(bucket_cap_mb: float = 0.25) -> list:
    """On every rank: one warm-up step, then one timed step of the bucketed DDP, timed
    by :func:`record_gradients` and :func:`timed_allreduce`.

    Returns this rank's events, ``(what, seconds since the step started)``, in order:
    ``forward``, ``backward``, every gradient ready, every bucket's all-reduce started
    and finished, ``waited`` (``backward()`` returned, every bucket waited for) and
    ``step`` (the optimizer step done). The steps start together, after a barrier.
    """
    model, events = make_gpt().to(device()), []
    record_gradients(model, events)
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    ddp.register_comm_hook(events, timed_allreduce)
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(2):
        idx, targets = my_share(step)
        dist.barrier()
        events.clear()
        marks = [("forward", time.perf_counter())]
        optimizer.zero_grad()
        loss = ddp(idx, targets)[1]
        marks.append(("backward", time.perf_counter()))
        loss.backward()
        marks.append(("waited", time.perf_counter()))
        optimizer.step()
        marks.append(("step", time.perf_counter()))
    start = marks[0][1]
    return [(what, t - start) for what, t in sorted(marks + events, key=lambda e: e[1])]


# --------------------------------------------------------------------------- bytes


def counted_ring_allreduce(state: dict, bucket):
    """A communication hook: each bucket averaged by :mod:`labsupport.comm`'s ring
    all-reduce instead of torch's, every byte it sends counted in ``state["sent"]``;
    synchronous, so the future it returns is already done."""
    with count_traffic() as traffic:
        all_reduce(bucket.buffer(), algorithm="ring")
    state["sent"] += traffic.bytes_sent
    done = torch.futures.Future()
    done.set_result(bucket.buffer().div_(dist.get_world_size()))
    return done


def bytes_per_step(bucket_cap_mb: float = 0.25) -> dict:
    """On every rank: one step of the bucketed DDP with :func:`counted_ring_allreduce`;
    the bytes this rank sent, the ring's formula summed over the buckets, and the
    gradients' bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ddp, counted = DistributedDataParallel(make_gpt().to(device()), bucket_cap_mb), {"sent": 0}
    ddp.register_comm_hook(counted, counted_ring_allreduce)
    ddp(*my_share(0))[1].backward()
    numels = [b.buffer().numel() for b in ddp.buckets]
    return {
        "rank": rank,
        "buckets": len(numels),
        "counted": counted["sent"],
        "formula": sum(bytes_sent("ring", n, 4, world, rank) for n in numels),
        "gradient bytes": 4 * sum(numels),
    }


# --------------------------------------------------------------------------- bucket size


def bucket_sweep(caps_mb: list[float], rounds: int = 5) -> dict | None:
    """On every rank: one training step with each bucket size, and one without any
    communication (``"compute only"``), timed in turns, round by round
    (:func:`~labsupport.measure.timing.side_by_side`). Rank 0 returns median seconds per
    case and each one's median ratio to the compute-only step of the same round."""
    rank, (idx, targets) = dist.get_rank(), my_share(0)

    def step_of(module, parameters):
        optimizer = torch.optim.SGD(parameters, lr=LR)

        def step():
            optimizer.zero_grad()
            module(idx, targets)[1].backward()
            optimizer.step()

        return step

    local = make_gpt().to(device())
    fns = {"compute only": step_of(local, local.parameters())}
    for cap in caps_mb:
        model = make_gpt().to(device())
        fns[cap] = step_of(DistributedDataParallel(model, bucket_cap_mb=cap), model.parameters())
    result = side_by_side(fns, rounds=rounds, device=device(), min_sample_s=0)
    return result if rank == 0 else None
