"""The GPU path: the launcher, every collective and the labs' distributed functions on CUDA
tensors over NCCL. Runs where this process sees at least two GPUs, skips elsewhere.

On a machine with a GPU per rank, ``backend="auto"`` gives each rank gloo for CPU
tensors and NCCL for CUDA tensors, and :func:`labsupport.device` is the rank's GPU: the
same lab code runs unchanged. These tests check that promise where it can be checked.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsupport import comm, device, launch
from labsupport.comm import allreduce
from labsupport.comm.measure import measure_p2p, time_all_reduce
from labsupport.labs import lab06_launching, lab07_collectives
from labsupport.launch.runtime import GPU_BACKEND

GPUS = torch.cuda.device_count() if torch.cuda.is_available() else 0
pytestmark = pytest.mark.skipif(
    GPUS < 2, reason=f"needs at least 2 CUDA GPUs, this machine has {GPUS}"
)
WORLD_SIZES = sorted({2, min(GPUS, 4)})


def where_and_sums():
    cpu = torch.ones(1)
    gpu = torch.ones(1, device=device())
    dist.all_reduce(cpu)  # gloo
    dist.all_reduce(gpu)  # NCCL
    return dist.get_backend(), str(device()), cpu.item(), gpu.item(), gpu.device.index


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_auto_backend_puts_each_rank_on_its_own_gpu(world_size):
    results = launch(where_and_sums, world_size, timeout=120)
    for rank, (backend, where, cpu_sum, gpu_sum, index) in enumerate(results):
        assert backend == GPU_BACKEND
        assert where == f"cuda:{rank}" and index == rank
        assert cpu_sum == gpu_sum == world_size


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("name", lab07_collectives.PRIMITIVES)
def test_every_collective_matches_torch_on_cuda(world_size, name):
    results = launch(lab07_collectives.run_primitive, world_size, args=(name,), timeout=120)
    lab07_collectives.agreement(results, name)


def all_reduce_on_gpu(algorithm):
    t = torch.arange(1001, dtype=torch.float32, device=device()) + dist.get_rank()
    reference = t.clone()
    dist.all_reduce(reference)
    with comm.count_traffic() as traffic:
        comm.all_reduce(t, algorithm=algorithm)
    sent = allreduce.bytes_sent(algorithm, 1001, 4, dist.get_world_size(), dist.get_rank())
    return torch.equal(t, reference), traffic.bytes_sent == sent


@pytest.mark.parametrize("world_size", WORLD_SIZES)
@pytest.mark.parametrize("algorithm", allreduce.ALGORITHMS)
def test_all_reduce_algorithms_pair_their_messages_for_nccl(world_size, algorithm):
    """Two ranks that send to and receive from each other must group the two calls on
    NCCL, or both wait forever: the ring on 2 ranks, halving-doubling, "ps"."""
    if algorithm == "halving_doubling" and world_size & (world_size - 1):
        pytest.skip("halving-doubling needs a power-of-two world")
    for equal, counted in launch(all_reduce_on_gpu, world_size, args=(algorithm,), timeout=120):
        assert equal and counted


def test_ring_pass_on_two_gpus_where_both_neighbours_are_one_rank():
    results = launch(lab06_launching.ring_pass, 2, timeout=120)
    assert [r["received"] for r in results] == [1, 0]


def test_measurements_synchronise_and_time_nccl():
    p2p = launch(measure_p2p, 2, kwargs={"sizes": (4, 2**20), "rounds": 3}, timeout=120)
    assert [r["bytes"] for r in p2p[0]] == [4, 2**20] and p2p[1] is None
    # a MiB through NCCL cannot arrive faster than 1 TB/s: the clock waited for it
    assert p2p[0][1]["seconds"] > 2**20 / 1e12
    timed = launch(time_all_reduce, 2, args=([2**20],), kwargs={"repeats": 2}, timeout=120)
    assert timed[0][0]["bytes"] == 2**20 and timed[0][0]["seconds"] > 2**20 / 1e12
