"""Lab 7, collectives: each primitive run on labelled data, ours next to torch's, and the
exercises' checkers, on real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from notebook_solutions import solution, stub

from labsupport import LaunchError, launch
from labsupport.labs import lab07_collectives


def test_labelled_values_are_chapter_7s_running_example():
    assert lab07_collectives.labelled(0, 4).tolist() == [1.0, 2.0, 3.0, 4.0]
    assert lab07_collectives.labelled(2, 3).tolist() == [100.0, 200.0, 300.0]
    assert set(lab07_collectives.USED_BY) == set(lab07_collectives.PRIMITIVES)


def every_primitive():
    return {name: lab07_collectives.run_primitive(name) for name in lab07_collectives.PRIMITIVES}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_primitive_matches_torch_on_labelled_data(world_size):
    results = launch(every_primitive, world_size, timeout=120)
    for name in lab07_collectives.PRIMITIVES:
        per_rank = [r[name] for r in results]
        assert lab07_collectives.agreement(per_rank, name).endswith(f"on {world_size} ranks")
    x0 = [float(j + 1) for j in range(world_size)]  # rank 0's values: 1, 2, ...
    assert [r["broadcast"]["ours"].tolist() for r in results] == [x0] * world_size
    assert [r["scatter"]["ours"].tolist() for r in results] == [[v] for v in x0]
    diagonal = [(r + 1) * 10.0**r for r in range(world_size)]  # piece r of rank r's values
    assert [r["all_gather"]["ours"].tolist() for r in results] == [diagonal] * world_size
    assert results[0]["gather"]["ours"].tolist() == diagonal
    ones = sum(10.0**r for r in range(world_size))  # 11, 111, 1111: a digit per rank
    total = [(j + 1) * ones for j in range(world_size)]
    assert [r["all_reduce"]["ours"].tolist() for r in results] == [total] * world_size
    assert results[0]["reduce"]["ours"].tolist() == total
    assert [r["reduce_scatter"]["ours"].tolist() for r in results] == [[t] for t in total]
    all_to_all = [r["all_to_all"]["ours"].tolist() for r in results]
    assert all_to_all[1] == [2 * 10.0**r for r in range(world_size)]


@pytest.mark.parametrize("world_size", [3, 4])
def test_the_bytes_each_collective_sends_are_chapter_7s_table(world_size):
    nbytes = 4 * world_size * 8  # 8 float32 values per piece
    counted = launch(lab07_collectives.bytes_per_collective, world_size, args=(nbytes,))
    for name in lab07_collectives.PRIMITIVES:
        table = [
            lab07_collectives.table_bytes(name, r, world_size, nbytes) for r in range(world_size)
        ]
        assert [counted[r][name][0] for r in range(world_size)] == table, name
    piece = nbytes // world_size
    if world_size == 4:  # the root's 2 children; rank 1's child 3
        assert [counted[r]["broadcast"] for r in range(4)] == [
            (2 * nbytes, 2),
            (nbytes, 1),
            (0, 0),
            (0, 0),
        ]
    assert counted[1]["all_to_all"] == ((world_size - 1) * piece, world_size - 1)
    assert counted[0]["all_reduce"][1] == 2 * (world_size - 1)  # messages of the ring
    with pytest.raises(ValueError, match="name must be one of"):
        lab07_collectives.table_bytes("allreduce", 0, 4, nbytes)


def test_agreement_raises_on_a_mismatch():
    results = [{"ours": torch.tensor([1.0]), "torch": torch.tensor([2.0])}]
    with pytest.raises(AssertionError, match="rank 0: ours"):
        lab07_collectives.agreement(results, "broadcast")
    with pytest.raises(LaunchError, match="ValueError: name must be one of"):
        launch(lab07_collectives.run_primitive, 1, args=("all_reduce_everything",))


# --------------------------------------------------------------------------- exercises

LAB = "07-collectives.ipynb"


def forgets_own_block(tensor_list, tensor):
    """The ring of the solution, without first copying the rank's own tensor in."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for step in range(world - 1):
        send = tensor_list[(rank - step) % world]
        recv = tensor_list[(rank - step - 1) % world]
        ops = [dist.P2POp(dist.isend, send, (rank + 1) % world)]
        ops.append(dist.P2POp(dist.irecv, recv, (rank - 1) % world))
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def resends_own_block(tensor_list, tensor):
    """Sends its own block at every step instead of passing on the one it received."""
    rank, world = dist.get_rank(), dist.get_world_size()
    tensor_list[rank].copy_(tensor)
    for step in range(world - 1):
        recv = tensor_list[(rank - step - 1) % world]
        ops = [dist.P2POp(dist.isend, tensor_list[rank], (rank + 1) % world)]
        ops.append(dist.P2POp(dist.irecv, recv, (rank - 1) % world))
        for request in dist.batch_isend_irecv(ops):
            request.wait()


def checks(capsys, checker, lab, name, verified, mistakes):
    """The worked solution of ``name`` in notebook ``lab`` passes ``checker``, which says
    what it verified; each ``(mistake, message)`` fails with an assertion that matches
    ``message``; the stub is not attempted yet. (Lab 8's tests use it too.)"""
    assert checker(solution(lab, name))
    assert capsys.readouterr().out.startswith(f"Correct: {verified}")
    for mistake, message in mistakes:
        with pytest.raises(AssertionError, match=message):
            checker(mistake)
    assert not checker(stub(name))
    assert capsys.readouterr().out.startswith(f"Not attempted yet: write {name}()")


def test_ring_all_gather_checker(capsys):
    mistakes = [
        (forgets_own_block, "should hold the rank's own tensor"),
        (resends_own_block, "with 3 ranks, rank 0 ended with"),
    ]
    verified = "every rank holds every rank's block"
    check = lab07_collectives.check_ring_all_gather
    checks(capsys, check, LAB, "ring_all_gather", verified, mistakes)


def returns_a_new_tensor(tensor):
    """Computes the sum, but returns it instead of writing it into ``tensor``."""
    total = tensor.clone()
    dist.all_reduce(total)
    return total


def averages(tensor):
    """The mean, as DDP wants its gradients, rather than the sum asked for."""
    dist.all_reduce(tensor)
    tensor /= dist.get_world_size()


def reduce_scatter_only(tensor):
    """Stops after the reduce-scatter: only the rank's own block is summed."""
    world, rank = dist.get_world_size(), dist.get_rank()
    block = -(-tensor.numel() // world)
    padded = torch.zeros(block * world)
    padded[: tensor.numel()] = tensor
    mine = torch.empty(block)
    dist.reduce_scatter(mine, list(padded.split(block)))
    padded[rank * block : (rank + 1) * block] = mine
    tensor.copy_(padded[: tensor.numel()])


def test_all_reduce_from_rs_ag_checker(capsys):
    mistakes = [
        (returns_a_new_tensor, "in place .a tensor you return is not looked at"),
        (averages, "that is the mean"),
        (reduce_scatter_only, "with 2 ranks, rank 0 ended with"),
    ]
    verified = "every rank's 7 values became their sum"
    check = lab07_collectives.check_all_reduce_from_rs_ag
    checks(capsys, check, LAB, "all_reduce_via_rs_ag", verified, mistakes)
