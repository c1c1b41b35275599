"""Lab 7, collectives: each primitive run on labelled data, ours next to torch's, and the
exercises' checkers, on real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsupport import LaunchError, launch
from labsupport.labs import lab07_collectives


def test_labelled_values_say_which_rank_they_came_from():
    assert lab07_collectives.labelled(2, 3).tolist() == [20.0, 21.0, 22.0]
    assert lab07_collectives.labelled(1, 2, start=4).tolist() == [14.0, 15.0]
    assert set(lab07_collectives.USED_BY) == set(lab07_collectives.PRIMITIVES)


def every_primitive():
    return {name: lab07_collectives.run_primitive(name) for name in lab07_collectives.PRIMITIVES}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_primitive_matches_torch_on_labelled_data(world_size):
    results = launch(every_primitive, world_size, timeout=120)
    for name in lab07_collectives.PRIMITIVES:
        per_rank = [r[name] for r in results]
        assert lab07_collectives.agreement(per_rank, name).endswith(f"on all {world_size} ranks")
    broadcast = [r["broadcast"]["ours"].tolist() for r in results]
    assert broadcast == [[0.0, 1.0]] * world_size
    all_to_all = [r["all_to_all"]["ours"].tolist() for r in results]
    assert all_to_all[1] == [10.0 * j + 1 for j in range(world_size)]
    total = sum(10.0 * r for r in range(world_size))  # rank r holds 10 r and 10 r + 1
    assert [r["all_reduce"]["ours"].tolist() for r in results] == [
        [total, total + world_size]
    ] * world_size


def test_agreement_raises_on_a_mismatch():
    results = [{"ours": torch.tensor([1.0]), "torch": torch.tensor([2.0])}]
    with pytest.raises(AssertionError, match="rank 0: ours"):
        lab07_collectives.agreement(results, "broadcast")
    with pytest.raises(LaunchError, match="ValueError: name must be one of"):
        launch(lab07_collectives.run_primitive, 1, args=("all_reduce_everything",))


def test_checkers_accept_solutions_and_reject_mistakes(capsys):
    def correct(tensor_list, tensor):
        dist.all_gather(tensor_list, tensor)

    def off_by_one(tensor_list, tensor):
        dist.all_gather(tensor_list, tensor + 1)

    lab07_collectives.check_ring_all_gather(correct, world_sizes=(2, 3))
    with pytest.raises(AssertionError, match="world_size=2, rank 0"):
        lab07_collectives.check_ring_all_gather(off_by_one, world_sizes=(2,))
    lab07_collectives.check_all_reduce_from_rs_ag(lambda t: dist.all_reduce(t), world_sizes=(3,))
    with pytest.raises(AssertionError, match="world_size=3"):
        lab07_collectives.check_all_reduce_from_rs_ag(lambda t: None, world_sizes=(3,))
    assert capsys.readouterr().out.count("Correct") == 2
