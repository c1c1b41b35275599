"""Lab 6, launching: what each rank sees, a ring pass, a ping-pong, and the exercises'
checkers, on real ranks. (torchrun itself is tested in tests/test_run.py.)"""

from __future__ import annotations

import pytest
import torch.distributed as dist

from labsupport import LaunchError, launch
from labsupport.labs import lab06_launching


def test_global_rank_fills_node_zero_first():
    ranks = [lab06_launching.global_rank(n, k, 4) for n in range(2) for k in range(4)]
    assert ranks == list(range(8))
    assert lab06_launching.global_rank(2, 5, 8) == 21


def test_world_info_and_ring_pass_on_three_ranks():
    infos = launch(lab06_launching.world_info, 3, timeout=60)
    assert [(i["rank"], i["local_rank"], i["node_rank"]) for i in infos] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 2, 0),
    ]
    assert {(i["world_size"], i["local_world_size"]) for i in infos} == {(3, 3)}
    assert len({i["master"] for i in infos}) == 1 and len({i["pid"] for i in infos}) == 3
    assert {i["backend"] for i in infos} == {"gloo"}
    ring = launch(lab06_launching.ring_pass, 3, timeout=60)
    assert [r["received"] for r in ring] == [2, 0, 1]
    assert [(r["sent_to"], r["received_from"]) for r in ring] == [(1, 2), (2, 0), (0, 1)]


def test_ping_pong_times_a_round_trip_on_rank_zero_only():
    small, other, idle = launch(lab06_launching.ping_pong, 3, kwargs={"rounds": 5}, timeout=60)
    # A 4-byte round trip between two processes of one machine takes tens of
    # microseconds; a second is far beyond what any load makes of it, and would catch a
    # time reported in the wrong unit (milliseconds or microseconds).
    assert 0 < small < 1 and other is None and idle is None
    with pytest.raises(LaunchError, match="at least 2 ranks"):
        launch(lab06_launching.ping_pong, 1, timeout=60)


def test_failing_step_fails_on_the_bad_rank_only():
    with pytest.raises(LaunchError, match="rank 1 ran out of memory") as info:
        launch(lab06_launching.failing_step, 3, kwargs={"bad_rank": 1}, timeout=60)
    assert info.value.root_rank == 1
    assert launch(lab06_launching.failing_step, 2, kwargs={"bad_rank": 5}, timeout=60) == [1.0] * 2


# --------------------------------------------------------------------------- exercises


def test_the_exercise_checkers_accept_solutions_and_reject_mistakes(capsys):
    lab06_launching.check_global_rank(lambda node, local, n: node * n + local)
    with pytest.raises(AssertionError, match="torchrun gives rank"):
        lab06_launching.check_global_rank(lambda node, local, n: local * n + node)

    def ring_sum():  # rank 0 collects the total passed around the ring
        import torch

        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.zeros(1)
        if rank == 0:
            dist.send(total, dst=1)
            dist.recv(total, src=world - 1)
        else:
            dist.recv(total, src=rank - 1)
            total += rank
            dist.send(total, dst=(rank + 1) % world)
        return int(total.item())

    lab06_launching.check_ring_sum(ring_sum, world_sizes=(2, 3))
    assert capsys.readouterr().out.count("Correct") == 2
    with pytest.raises(AssertionError, match="world_size=3: rank 0 returned 0, expected 3"):
        lab06_launching.check_ring_sum(lambda: 0, world_sizes=(3,))
