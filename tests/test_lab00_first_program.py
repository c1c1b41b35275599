"""Lab 0, a first distributed program: hello, send and receive, all-reduce, barrier, and
the exercises' checkers, on real ranks."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.labs import lab00_first_program as lab00

LAB = "00-first-program.ipynb"


def test_hello_names_every_rank_and_process(capsys):
    hellos = launch(lab00.hello, 3, timeout=60)
    assert [(h["rank"], h["world_size"]) for h in hellos] == [(0, 3), (1, 3), (2, 3)]
    assert len({h["pid"] for h in hellos}) == 3
    assert "[rank 2] hello from rank 2 of 3" in capsys.readouterr().out


def test_send_to_rank_1_changes_rank_1_only():
    assert launch(lab00.send_to_rank_1, 3, timeout=60) == [1.0, 1.0, 0.0]


def test_all_reduce_sum_leaves_the_sum_everywhere():
    results = launch(lab00.all_reduce_sum, 4, timeout=60)
    assert [r["before"].item() for r in results] == [1.0, 2.0, 3.0, 4.0]
    assert [r["after"].item() for r in results] == [10.0] * 4


def test_no_rank_leaves_the_barrier_before_the_last_arrives():
    times = launch(lab00.barrier_times, 3, kwargs={"step_s": 0.05}, timeout=60)
    last_arrival = max(t["arrived"] for t in times)
    assert all(t["left"] >= last_arrival for t in times)


# --------------------------------------------------------------------------- exercises


def test_check_mean_of_ranks_accepts_the_solution_and_rejects_mistakes(capsys):
    assert lab00.check_mean_of_ranks(solution(LAB, "mean_of_ranks"), world_sizes=(2, 3))
    assert capsys.readouterr().out.endswith(
        "Correct: every rank returns the mean at world sizes 2, 3\n"
    )

    def sum_of_ranks():
        total = torch.tensor([float(dist.get_rank())])
        dist.all_reduce(total)
        return total.item()

    with pytest.raises(AssertionError, match="every rank holds the sum"):
        lab00.check_mean_of_ranks(sum_of_ranks, world_sizes=(3,))

    def own_rank():
        return float(dist.get_rank())

    with pytest.raises(AssertionError, match="each rank returned its own number"):
        lab00.check_mean_of_ranks(own_rank, world_sizes=(2,))

    def reduce_to_rank_0():
        total = torch.tensor([float(dist.get_rank())])
        dist.reduce(total, dst=0)
        return total.item() / dist.get_world_size()

    with pytest.raises(AssertionError, match="rank 0 is right"):
        lab00.check_mean_of_ranks(reduce_to_rank_0, world_sizes=(3,))

    assert not lab00.check_mean_of_ranks(stub("mean_of_ranks"), world_sizes=(2,))
    assert "Not attempted yet" in capsys.readouterr().out


def test_check_shared_sum_accepts_the_solution_and_rejects_mistakes(capsys):
    assert lab00.check_shared_sum(solution(LAB, "shared_sum"), cases=((1, 10), (3, 37)))
    assert capsys.readouterr().out.endswith(
        "Correct: every rank returns the whole sum, at world sizes 1, 3\n"
    )

    def everyone_adds_everything(n):
        total = torch.tensor([float(sum(i * i for i in range(n)))])
        dist.all_reduce(total)
        return total.item()

    with pytest.raises(AssertionError, match="each rank should add its share only"):
        lab00.check_shared_sum(everyone_adds_everything, cases=((2, 10),))

    def never_combines(n):
        rank, world = dist.get_rank(), dist.get_world_size()
        return float(sum(i * i for i in range(rank, n, world)))

    with pytest.raises(AssertionError, match="never combined them"):
        lab00.check_shared_sum(never_combines, cases=((3, 37),))

    def only_rank_0_calls_all_reduce(n):  # the others never join: the launch hangs
        total = torch.zeros(1)
        if dist.get_rank() == 0:
            dist.all_reduce(total)
        return total.item()

    with pytest.raises(AssertionError, match="the ranks did not all finish"):
        lab00._run(only_rank_0_calls_all_reduce, 2, {"n": 4}, timeout=5)

    assert not lab00.check_shared_sum(stub("shared_sum"), cases=((2, 10),))
    assert "Not attempted yet" in capsys.readouterr().out
