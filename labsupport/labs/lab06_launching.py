"""Lab 6, launching: what each rank sees, ranks at work, a first send and receive, a
failure, a hang, torchrun and Slurm, other ways to meet, what a launch costs, and the
exercises' checkers.

Each rank function runs on every rank of an initialised process group, under
:func:`labsupport.launch` or ``torchrun -m labsupport.run`` alike, and puts its tensors
on :func:`labsupport.launch.runtime.device`. The environment they read is the one
torchrun documents: https://pytorch.org/docs/stable/elastic/run.html#environment-variables
"""

from __future__ import annotations

import os
import statistics
import time
import urllib.parse
from datetime import timedelta

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise, launch_answer

# the Slurm job of section 6 lives in lab06_nodes; the lab uses it from here
# (``name as name``: re-exported)
from labsupport.labs.lab06_nodes import SBATCH_TWO_NODES as SBATCH_TWO_NODES
from labsupport.labs.lab06_nodes import SLURM_STAND_INS as SLURM_STAND_INS
from labsupport.labs.lab06_nodes import sbatch_here as sbatch_here
from labsupport.launch import loopback
from labsupport.launch.launcher import launch
from labsupport.launch.nodes import torchrun_nodes
from labsupport.launch.progress import progress
from labsupport.launch.runtime import device


def world_info() -> dict:
    """This rank's view of the world: its ranks, the world's size, where the store is."""
    return {
        "rank": dist.get_rank(),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "world_size": dist.get_world_size(),
        "local_world_size": int(os.environ["LOCAL_WORLD_SIZE"]),
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "backend": dist.get_backend(),
        "device": str(device()),
        "pid": os.getpid(),
    }


def global_rank(node_rank: int, local_rank: int, nproc_per_node: int) -> int:
    """The global rank torchrun gives a process: ranks fill node 0 first, then node 1."""
    return node_rank * nproc_per_node + local_rank


def ring_pass() -> dict:
    """Each rank sends its rank to its right neighbour and receives from its left one.

    The send and the receive are posted together, as one ``batch_isend_irecv``, and only
    then waited for. That is what keeps the ring from deadlocking: with a blocking
    ``send`` first on every rank, every rank would wait for a receiver. (Gloo would also
    accept a separate ``isend`` and ``irecv``; NCCL needs the two grouped when, as on 2
    ranks, the right and left neighbours are the same rank.)
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    right, left = (rank + 1) % world, (rank - 1) % world
    outgoing = torch.tensor([float(rank)], device=device())
    incoming = torch.empty(1, device=device())
    ops = [dist.P2POp(dist.isend, outgoing, right), dist.P2POp(dist.irecv, incoming, left)]
    for request in dist.batch_isend_irecv(ops):
        request.wait()
    print(f"sent {rank} to rank {right}, received {int(incoming.item())} from rank {left}")
    return {"sent_to": right, "received_from": left, "received": int(incoming.item())}


def uneven_steps(steps: int = 40, step_s: float = 0.01) -> dict:
    """Rank r works through ``steps`` steps of (r + 1) x ``step_s`` seconds each, then
    every rank meets in one all-reduce, where the faster ranks wait for the slowest.

    The loop reports to the launcher through :func:`labsupport.launch.progress.progress`
    (a live bar per rank). Returns the seconds this rank worked and waited.
    """
    rank = dist.get_rank()
    print(f"{steps} steps of {(rank + 1) * step_s * 1e3:.0f} ms each")
    start = time.perf_counter()
    for _ in progress(range(steps), "steps"):
        time.sleep((rank + 1) * step_s)  # stands in for a training step
    worked = time.perf_counter() - start
    print("done; waiting for the others in all_reduce")
    ranks = torch.ones(1, device=device())
    dist.all_reduce(ranks)
    count = int(ranks.item())  # .item() waits for the all-reduce, on a GPU too
    print(f"all_reduce done: {count} ranks took part")
    return {"rank": rank, "worked_s": worked, "waited_s": time.perf_counter() - start - worked}


def failing_step(bad_rank: int = 2) -> float:
    """A training step in which one rank fails before the all-reduce the others wait in."""
    grad = torch.full((4,), float(dist.get_rank()), device=device())
    if dist.get_rank() == bad_rank:
        raise RuntimeError(f"simulated failure: rank {bad_rank} ran out of memory")
    dist.all_reduce(grad)
    return grad[0].item()


def one_rank_late(late_s: float = 3.0, timeout_s: float = 1.0) -> dict:
    """The last rank is ``late_s`` seconds late for a barrier that waits ``timeout_s``.

    ``dist.monitored_barrier`` gives up after ``timeout_s`` and, on rank 0, names the
    first rank that never came. It needs gloo, so it runs in a gloo group of its own,
    which works beside nccl as well. Returns what happened on this rank.
    """
    rank, world = dist.get_rank(), dist.get_world_size()
    checks = dist.new_group(backend="gloo")  # every rank creates it, the late one too
    start = time.perf_counter()
    if rank == world - 1:
        time.sleep(late_s)  # stands in for a rank stuck elsewhere: I/O, a deadlock, a bug
        return {"rank": rank, "outcome": "was late", "seconds": time.perf_counter() - start}
    try:
        dist.monitored_barrier(group=checks, timeout=timedelta(seconds=timeout_s))
        outcome = "passed the barrier"
    except RuntimeError as exc:
        outcome = str(exc).splitlines()[0]
    return {"rank": rank, "outcome": outcome, "seconds": time.perf_counter() - start}


def mismatched_all_reduce() -> list:
    """A bug that hangs or corrupts a job: rank r all-reduces 4 + r elements.

    Under ``TORCH_DISTRIBUTED_DEBUG=DETAIL`` every collective is checked first, through a
    gloo group of its own, and the ranks fail at once with a message that names the
    mismatch, instead of hanging or failing deep inside the backend.
    """
    grad = torch.ones(4 + dist.get_rank(), device=device())
    dist.all_reduce(grad)
    return grad.tolist()


def all_reduce_via(init_method: str) -> dict:
    """Leave the launcher's process group, meet again through ``init_method``
    (``tcp://host:port`` or ``file:///path``), and sum the ranks with one all-reduce.

    Only ``env://`` reads the rank and the world size from the environment; here they
    are passed. The backend stays the one the launch chose.
    """
    rank, world, backend = dist.get_rank(), dist.get_world_size(), dist.get_backend()
    dist.destroy_process_group()
    # The launcher (like torchrun) tells ranks to join its own store. Without that flag,
    # rank 0 hosts the store at the tcp:// address itself, as in a job started by hand.
    os.environ.pop("TORCHELASTIC_USE_AGENT_STORE", None)
    # torch's store would listen on every interface, whatever host the URL names: for a
    # loopback address, rank 0 opens it on loopback first, and torch's store shares it
    url = urllib.parse.urlparse(init_method)
    hosted = loopback.host_store(url.hostname, url.port) if rank == 0 else None
    dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world)
    del hosted  # the process group holds the store now
    total = torch.tensor([float(rank)], device=device())
    dist.all_reduce(total)
    return {"rank": rank, "sum_of_ranks": int(total.item())}


def all_reduce_ranks() -> dict:
    """Sum every rank's rank with one all-reduce; the answer is world·(world-1)/2."""
    total = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(total)
    return {
        "rank": dist.get_rank(),
        "node_rank": int(os.environ.get("GROUP_RANK", "0")),
        "local_rank": int(os.environ["LOCAL_RANK"]),
        "sum_of_ranks": int(total.item()),
    }


# --------------------------------------------------------------------------- launch costs


def launch_costs(rounds: int = 2, world_size: int = 4) -> dict:
    """Seconds to run :func:`all_reduce_ranks` on ``world_size`` ranks with
    :func:`launch` and with a one-node torchrun, timed in turns.

    Each round runs both, in alternating order, so that load from elsewhere slows both
    alike. Returns the times of each per round, and under ``"ratio"`` the median over
    the rounds of torchrun's time over launch's in the same round.
    """
    runs = {
        "launch": lambda: launch(all_reduce_ranks, world_size=world_size),
        "torchrun": lambda: torchrun_nodes(f"{__name__}:all_reduce_ranks", 1, world_size),
    }
    times = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    pairs = zip(times["torchrun"], times["launch"], strict=True)
    return {**times, "ratio": statistics.median(t / w for t, w in pairs)}


# --------------------------------------------------------------------------- exercises


@exercise
def check_global_rank(fn) -> str:
    """Exercise 1: ``fn(node_rank, local_rank, nproc_per_node)`` must give torchrun's rank."""
    for nproc in (1, 2, 4, 8):
        ranks = {}
        for node in range(4):
            for local in range(nproc):
                got = fn(node, local, nproc)
                case = f"node_rank={node}, local_rank={local}, nproc_per_node={nproc}"
                assert isinstance(got, int), f"{case}: got {got!r}, a rank is an int"
                assert got not in ranks, f"{case}: got {got}, the rank of {ranks.get(got)} too"
                ranks[got] = case
                assert got == global_rank(node, local, nproc), (
                    f"{case}: got {got}, but torchrun gives this process another rank "
                    "(which processes does it number first?)"
                )
    return "the rank of every process of 4 nodes with 1, 2, 4 or 8 processes each"


@exercise
def check_ring_sum(fn, world_sizes=(2, 3, 4), timeout: float = 30) -> str:
    """Exercise 2: ``fn()`` on every rank; rank 0 must return the sum of all ranks.

    Runs ``fn`` with :func:`labsupport.launch` at several world sizes (odd ones too).
    Ranks that wait forever (stopped after ``timeout`` seconds) or lose contact because
    a peer returned early are a wrong answer, reported as such.
    """
    for world in world_sizes:
        hint = (
            "A rank waited for a message that no rank sent, or from a rank that had already "
            "returned: does every send have its recv, and every recv its send?"
        )
        results = launch_answer(fn, world, hint, timeout)
        want = world * (world - 1) // 2
        hint = " (does each rank add its own rank before passing the total on?)"
        assert results[0] == want, (
            f"world_size={world}: rank 0 returned {results[0]!r}, expected {want} "
            f"(0 + ... + {world - 1}){hint if results[0] in (0, None) else ''}"
        )
    return f"rank 0 gets the sum of the ranks at world sizes {', '.join(map(str, world_sizes))}"
