"""Lab 0, a first distributed program: hello from every rank, a message from rank 0 to
rank 1, an all-reduce, a barrier, and the exercises' checkers.

The programs follow PyTorch's tutorial "Writing Distributed Applications with PyTorch"
(https://docs.pytorch.org/tutorials/intermediate/dist_tuto.html). Each function runs on
every rank of an initialised process group, under :func:`labsupport.launch` or
``torchrun -m labsupport.run`` alike, puts its tensors on
:func:`labsupport.launch.runtime.device` and returns plain numbers or CPU tensors.
"""

from __future__ import annotations

import os
import time

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise, launch_answer
from labsupport.launch.runtime import device


def hello() -> dict:
    """Say which of the processes this one is: its rank, the world size, its process id."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    print(f"hello from rank {rank} of {world_size}")
    return {"rank": rank, "world_size": world_size, "pid": os.getpid()}


def send_to_rank_1() -> float:
    """Rank 0 sends a tensor to rank 1; every rank returns the value it then holds.

    ``send`` and ``recv`` block: rank 0 waits until rank 1 has taken its message (gloo),
    rank 1 until it has arrived, in the tensor rank 1 made ready for it. The other ranks
    take no part.
    """
    tensor = torch.zeros(1, device=device())
    if dist.get_rank() == 0:
        tensor += 1
        dist.send(tensor, dst=1)
    elif dist.get_rank() == 1:
        dist.recv(tensor, src=0)
    print(f"I hold {tensor.item():g}")
    return tensor.item()


def all_reduce_sum() -> dict:
    """Rank r holds r + 1; one all-reduce leaves the sum over all ranks on every rank."""
    tensor = torch.tensor([dist.get_rank() + 1.0], device=device())
    before = tensor.clone()
    dist.all_reduce(tensor, op=dist.ReduceOp.SUM)  # in place, on every rank
    print(f"before {before.item():g}, after {tensor.item():g}")
    return {"before": before.cpu(), "after": tensor.cpu()}


def barrier_times(step_s: float = 0.1) -> dict:
    """Rank r works r x ``step_s`` seconds, then waits at a barrier for the others.

    Returns when it arrived at the barrier and when it left, on the machine's monotonic
    clock, which all the processes of one machine share.
    """
    rank = dist.get_rank()
    time.sleep(rank * step_s)  # stands in for uneven work
    arrived = time.monotonic()
    dist.barrier()
    return {"rank": rank, "arrived": arrived, "left": time.monotonic()}


# --------------------------------------------------------------------------- exercises


def _run(fn, world_size: int, kwargs=None, timeout: float = 60) -> list:
    """``fn`` on ``world_size`` ranks; a launch that hangs is the learner's answer's fault."""
    hint = "Does every rank make the same collective calls, in the same order?"
    return launch_answer(fn, world_size, hint, timeout, kwargs=kwargs)


@exercise
def check_mean_of_ranks(fn, world_sizes=(2, 3, 4)) -> str:
    """Exercise 1: ``fn()`` on every rank must return the mean of all ranks' numbers."""
    for world in world_sizes:
        got = [float(value) for value in _run(fn, world)]
        want = (world - 1) / 2  # (0 + 1 + ... + (N - 1)) / N
        if all(value == want for value in got):  # exact: sums of small integers, halved
            continue
        hint = "every rank must end with the same number, the mean"
        if all(value == want * world for value in got):
            hint = "every rank holds the sum: what turns a sum into a mean?"
        elif got == [float(rank) for rank in range(world)]:
            hint = "each rank returned its own number: the ranks never combined theirs"
        elif got[0] == want:
            hint = "rank 0 is right, the others are not: every rank needs the result"
        raise AssertionError(f"world_size={world}: the ranks returned {got}; {hint}")
    return f"every rank returns the mean at world sizes {', '.join(map(str, world_sizes))}"


def _sum_of_squares(numbers) -> int:
    return sum(i * i for i in numbers)


@exercise
def check_shared_sum(fn, cases=((1, 10), (2, 37), (3, 37), (4, 100))) -> str:
    """Exercise 2: ``fn(n)`` on every rank must return 0² + 1² + ... + (n - 1)², each
    rank having added only its own share of the numbers."""
    for world, n in cases:
        got = [int(round(float(value))) for value in _run(fn, world, {"n": n})]
        want = _sum_of_squares(range(n))
        if got == [want] * world:
            continue
        shares = [_sum_of_squares(range(rank, n, world)) for rank in range(world)]
        hint = "every rank must end with the whole sum"
        if got == [want * world] * world:
            hint = "each number is counted once per rank: each rank should add its share only"
        elif got == shares:
            hint = "each rank returned its own share: the ranks never combined them"
        raise AssertionError(f"world_size={world}, n={n}: the ranks returned {got}; {hint}")
    worlds = ", ".join(str(world) for world, _ in cases)
    return f"every rank returns the whole sum, at world sizes {worlds}"
