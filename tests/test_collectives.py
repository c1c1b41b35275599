"""labsupport.collectives against torch.distributed, on real ranks, several world sizes.

Each test launches once and runs every case on every rank; a rank returns the list of
cases where ours and torch's disagree, so one launch checks dozens of calls.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.distributed import ReduceOp

from labsupport import collectives as C
from labsupport import launch

OPS = (ReduceOp.SUM, ReduceOp.PRODUCT, ReduceOp.MIN, ReduceOp.MAX)
DTYPES = (torch.float32, torch.float64, torch.int64)
WORLD_SIZES = (1, 2, 3, 4, 5)


def sample(rank: int, shape, dtype, salt: int = 0, transpose: bool = False) -> torch.Tensor:
    """Small integer values (exact in every dtype and op), optionally non-contiguous."""
    g = torch.Generator().manual_seed(1000 * rank + salt)
    t = torch.randint(1, 4, shape, generator=g).to(dtype)
    if transpose and t.dim() == 2:
        t = t.t()  # a non-contiguous view
        assert not t.is_contiguous()
    return t


CASES = [((7,), False), ((10,), False), ((3, 4), True), ((1,), False)]


def compare_all():
    rank, world = dist.get_rank(), dist.get_world_size()
    bad = []

    def check(name, ours, theirs):
        if not torch.equal(ours, theirs):
            bad.append(f"rank {rank}: {name}: {ours.tolist()} != {theirs.tolist()}")

    for dtype in DTYPES:
        for case, (shape, transpose) in enumerate(CASES):
            label = f"{dtype} {shape}{' transposed' if transpose else ''}"
            for src in {0, world - 1}:
                ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                C.broadcast(ours, src=src)
                dist.broadcast(theirs, src=src)
                check(f"broadcast src={src} {label}", ours, theirs)
            for op in OPS:
                for algorithm in C.ALGORITHMS:
                    if algorithm == "halving_doubling" and world & (world - 1):
                        continue
                    ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                    C.all_reduce(ours, op=op, algorithm=algorithm)
                    dist.all_reduce(theirs, op=op)
                    check(f"all_reduce {algorithm} {op} {label}", ours, theirs)
                dst = world // 2
                ours, theirs = (sample(rank, shape, dtype, case, transpose) for _ in range(2))
                C.reduce(ours, dst=dst, op=op)
                dist.reduce(theirs, dst=dst, op=op)
                if rank == dst:
                    check(f"reduce dst={dst} {op} {label}", ours, theirs)
                inputs = [sample(rank, shape, dtype, case + 10 * i) for i in range(world)]
                ours, theirs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
                C.reduce_scatter(ours, inputs, op=op)
                dist.reduce_scatter(theirs, [t.clone() for t in inputs], op=op)
                check(f"reduce_scatter {op} {label}", ours, theirs)
            mine = sample(rank, shape, dtype, case, transpose)
            ours = [torch.zeros_like(mine) for _ in range(world)]
            theirs = [torch.zeros_like(mine) for _ in range(world)]
            C.all_gather(ours, mine)
            dist.all_gather(theirs, mine.contiguous())
            check(f"all_gather {label}", torch.stack(ours), torch.stack(theirs))
            root = world - 1
            pieces = [sample(rank, shape, dtype, case + 10 * i) for i in range(world)]
            ours, theirs = torch.zeros(shape, dtype=dtype), torch.zeros(shape, dtype=dtype)
            C.scatter(ours, pieces if rank == root else None, src=root)
            dist.scatter(theirs, pieces if rank == root else None, src=root)
            check(f"scatter {label}", ours, theirs)
            ours = [torch.zeros_like(mine) for _ in range(world)] if rank == 0 else None
            theirs = [torch.zeros_like(mine) for _ in range(world)] if rank == 0 else None
            C.gather(mine, ours, dst=0)
            dist.gather(mine.contiguous(), theirs, dst=0)
            if rank == 0:
                check(f"gather {label}", torch.stack(ours), torch.stack(theirs))
            ours = [torch.zeros(shape, dtype=dtype) for _ in range(world)]
            theirs = [torch.zeros(shape, dtype=dtype) for _ in range(world)]
            C.all_to_all(ours, pieces)
            dist.all_to_all(theirs, [p.clone() for p in pieces])
            check(f"all_to_all {label}", torch.stack(ours), torch.stack(theirs))
    return bad


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_every_collective_matches_torch_distributed(world_size):
    results = launch(compare_all, world_size, timeout=240)
    mismatches = [line for rank_bad in results for line in rank_bad]
    assert mismatches == [], "\n".join(mismatches[:20])


def float_all_reduce(algorithm):
    g = torch.Generator().manual_seed(dist.get_rank())
    ours = torch.randn(1000, generator=g)
    theirs = ours.clone()
    C.all_reduce(ours, algorithm=algorithm)
    dist.all_reduce(theirs)
    return torch.allclose(ours, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("algorithm", C.ALGORITHMS)
def test_float_all_reduce_agrees_up_to_rounding(algorithm):
    assert launch(float_all_reduce, 4, args=(algorithm,), timeout=120) == [True] * 4


def on_a_subgroup():
    members = [1, 2, 3]
    group = dist.new_group(members)
    rank = dist.get_rank()
    if rank not in members:
        return None
    ours = torch.tensor([float(rank), 10.0 * rank])
    theirs = ours.clone()
    C.all_reduce(ours, group=group)
    dist.all_reduce(theirs, group=group)
    bcast_ours = torch.tensor([float(rank)])
    bcast_theirs = bcast_ours.clone()
    C.broadcast(bcast_ours, src=3, group=group)  # src is a global rank, as in torch
    dist.broadcast(bcast_theirs, src=3, group=group)
    gathered = [torch.zeros(1) for _ in members]
    C.all_gather(gathered, torch.tensor([float(rank)]), group=group)
    return (
        torch.equal(ours, theirs),
        torch.equal(bcast_ours, bcast_theirs),
        [t.item() for t in gathered],
    )


def test_collectives_work_on_a_subgroup_with_global_src():
    results = launch(on_a_subgroup, 4, timeout=120)
    assert results[0] is None
    assert results[1:] == [(True, True, [1.0, 2.0, 3.0])] * 3


def counted_bytes(algorithm, numel):
    t = torch.ones(numel)
    with C.count_traffic() as traffic:
        C.all_reduce(t, algorithm=algorithm)
    return traffic.bytes_sent


@pytest.mark.parametrize("algorithm", C.ALGORITHMS)
@pytest.mark.parametrize("numel", [1024, 1001])
def test_bytes_on_the_wire_match_the_formula_exactly(algorithm, numel):
    world = 4
    counted = launch(counted_bytes, world, args=(algorithm, numel), timeout=120)
    expected = [C.bytes_sent(algorithm, numel, 4, world, r) for r in range(world)]
    assert counted == expected


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_bandwidth_optimal_algorithms_send_two_n_minus_one_over_n(world):
    size = 4 * 8 * 105  # divisible by every world size here
    for algorithm in ("ring", "ps") + (("halving_doubling",) if world & (world - 1) == 0 else ()):
        for rank in range(world):
            assert (
                C.bytes_sent(algorithm, size // 4, 4, world, rank)
                == 2 * (world - 1) * size // world
            )
    assert C.bytes_sent("naive", size // 4, 4, world, 0) == (world - 1) * size
    total_tree = sum(C.bytes_sent("tree", size // 4, 4, world, r) for r in range(world))
    assert total_tree == 2 * (world - 1) * size  # every edge of two trees carries S


def bad_calls():
    errors = []
    for call in (
        lambda: C.all_reduce(torch.ones(3), algorithm="carrier-pigeon"),
        lambda: C.all_reduce(torch.ones(3), op="sum"),
        lambda: C.all_reduce(torch.ones(3), algorithm="halving_doubling"),
        lambda: C.all_gather([torch.ones(1)], torch.ones(1)),
    ):
        try:
            call()
            errors.append("no error")
        except ValueError as exc:
            errors.append(str(exc))
    return errors


def test_bad_arguments_are_clear_errors():
    errors = launch(bad_calls, 3, timeout=60)[0]
    assert "algorithm must be one of ring" in errors[0]
    assert "op must be ReduceOp.SUM" in errors[1]
    assert "power-of-two number of ranks, got 3" in errors[2]
    assert "tensor_list of 3 tensors" in errors[3]
