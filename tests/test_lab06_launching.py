"""Lab 6, launching: what each rank sees, ranks at work, a ring pass, a failure, a hang,
a mismatch, other init methods, the Slurm script, launch costs, and the exercises'
checkers, on real ranks. (torchrun itself is tested in tests/test_run.py.)"""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from notebook_solutions import solution, stub

from labsupport import LaunchError, launch
from labsupport.labs import lab06_launching
from labsupport.launch import loopback
from labsupport.launch.nodes import free_port

LAB = "06-launching.ipynb"


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


def test_ring_pass_on_two_ranks_where_both_neighbours_are_one_rank():
    ring = launch(lab06_launching.ring_pass, 2, timeout=60)
    assert [(r["sent_to"], r["received_from"], r["received"]) for r in ring] == [
        (1, 1, 1),
        (0, 0, 0),
    ]


def test_uneven_steps_prints_the_same_lines_and_the_fast_rank_waits(capsys):
    work = launch(lab06_launching.uneven_steps, 2, kwargs={"steps": 5, "step_s": 0.05})
    assert [w["rank"] for w in work] == [0, 1]
    # sleeps last at least their duration: rank 1 works 5 x 50 ms more than rank 0,
    # and rank 0 waits for it in the all-reduce
    assert work[0]["worked_s"] >= 0.25 and work[1]["worked_s"] >= 0.5
    assert work[0]["waited_s"] > work[1]["waited_s"]
    out = capsys.readouterr().out  # outside Jupyter, lines are printed as they come
    for rank, ms in ((0, 50), (1, 100)):
        assert f"[rank {rank}] 5 steps of {ms} ms each" in out
        assert f"[rank {rank}] steps |########################| 5/5" in out
        assert f"[rank {rank}] all_reduce done: 2 ranks took part" in out


def test_failing_step_fails_on_the_bad_rank_only():
    with pytest.raises(LaunchError, match="rank 1 ran out of memory") as info:
        launch(lab06_launching.failing_step, 3, kwargs={"bad_rank": 1}, timeout=60)
    assert info.value.root_rank == 1
    assert launch(lab06_launching.failing_step, 2, kwargs={"bad_rank": 5}, timeout=60) == [1.0] * 2


def test_one_rank_late_is_named_by_the_monitored_barrier():
    late = launch(lab06_launching.one_rank_late, 3, kwargs={"late_s": 2.0, "timeout_s": 0.5})
    assert late[0]["outcome"] == "[Rank 0]: Rank 2 failed to pass monitoredBarrier in 500 ms"
    assert "Rank 1 successfully reached monitoredBarrier" in late[1]["outcome"]
    assert late[2]["outcome"] == "was late" and late[2]["seconds"] >= 2.0


def debug_level():
    return str(dist.get_debug_level())


def test_torch_distributed_debug_set_for_a_launch_reaches_its_ranks():
    """torch.distributed reads the variable when it is imported, in the forkserver, before
    a rank's environment exists: the rank must read it again before initialising."""
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    assert launch(debug_level, 2, env=detail) == ["DebugLevel.DETAIL"] * 2
    assert launch(debug_level, 2) == ["DebugLevel.OFF"] * 2
    with pytest.raises(LaunchError, match="Detected mismatch between collectives") as info:
        launch(lab06_launching.mismatched_all_reduce, 2, env=detail, timeout=60)
    assert "Tensor shapes" in info.value.failures[info.value.root_rank].summary


def all_reduce_via_and_hold(init_method):
    result = lab06_launching.all_reduce_via(init_method)
    time.sleep(0.5)  # rank 0's store and the ranks' sockets are up meanwhile
    return result


def test_all_reduce_via_file_and_tcp_init_methods(tmp_path):
    via_file = launch(
        lab06_launching.all_reduce_via, 3, kwargs={"init_method": f"file://{tmp_path}/meet"}
    )
    port = free_port()
    with loopback.watch_listening() as seen:
        via_tcp = launch(all_reduce_via_and_hold, 2, args=(f"tcp://127.0.0.1:{port}",))
    assert via_file == [{"rank": r, "sum_of_ranks": 3} for r in range(3)]
    assert via_tcp == [{"rank": r, "sum_of_ranks": 1} for r in range(2)]
    # rank 0 hosted the tcp:// store, on loopback only
    assert port in {p for _, address, p in seen if address == "127.0.0.1"}
    assert loopback.exposed(seen) == set()


def test_the_slurm_script_runs_two_nodes_here_and_is_the_one_chapter_6_shows():
    script = lab06_launching.SBATCH_TWO_NODES
    subprocess.run(["bash", "-n"], input=script, text=True, check=True)
    chapter = Path(__file__).resolve().parents[1] / "chapters" / "06-launching.md"
    assert f"```bash\n{script}```" in chapter.read_text()
    lines = lab06_launching.sbatch_here(nodes=2, gpus_per_node=1)
    assert [line.split(" -> ")[0] for line in lines] == ["[rank 0]", "[rank 1]"]
    assert "'node_rank': 1, 'local_rank': 0, 'sum_of_ranks': 1" in lines[1]
    with pytest.raises(RuntimeError, match="failed"):
        lab06_launching.sbatch_here("#!/bin/bash\nsrun false\n")


def test_launch_costs_times_both_launchers_in_turns(monkeypatch):
    calls = []
    monkeypatch.setattr(lab06_launching, "launch", lambda fn, world_size: calls.append("launch"))
    monkeypatch.setattr(
        lab06_launching, "torchrun_nodes", lambda target, n, k: calls.append(("torchrun", target))
    )
    costs = lab06_launching.launch_costs(rounds=3, world_size=2)
    target = ("torchrun", "labsupport.labs.lab06_launching:all_reduce_ranks")
    assert calls == ["launch", target, target, "launch", "launch", target]
    assert len(costs["launch"]) == len(costs["torchrun"]) == 3 and costs["ratio"] > 0


# --------------------------------------------------------------------------- exercises


def test_check_global_rank_accepts_the_solution_and_rejects_mistakes(capsys):
    fn = solution(LAB, "my_global_rank")
    assert lab06_launching.check_global_rank(fn)
    assert capsys.readouterr().out.startswith("Correct:")
    with pytest.raises(AssertionError, match="torchrun gives this process another rank"):
        lab06_launching.check_global_rank(lambda node, local, n: local * n + node)
    with pytest.raises(AssertionError, match="the rank of node_rank=0, local_rank=1"):
        lab06_launching.check_global_rank(lambda node, local, n: node + local)
    with pytest.raises(AssertionError, match="a rank is an int"):
        lab06_launching.check_global_rank(lambda node, local, n: float(node * n + local))
    assert not lab06_launching.check_global_rank(stub("my_global_rank"))
    assert "Not attempted yet" in capsys.readouterr().out


def ring_with(first=0, own=1, extra=0, closes=True):
    """A ring sum with a learner's mistake: rank 0 starts from ``first``, each rank adds
    ``own`` times its rank plus ``extra``; unless ``closes``, the last rank does not send
    back to rank 0. (The defaults are right.)"""

    def ring_sum():
        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.zeros(1) + (first if rank == 0 else 0)
        if rank == 0:
            dist.send(total, dst=1)
            dist.recv(total, src=world - 1)
        else:
            dist.recv(total, src=rank - 1)
            total += own * rank + extra
            if closes or rank < world - 1:
                dist.send(total, dst=(rank + 1) % world)
        return int(total.item())

    return ring_sum


def everyone_receives_first():  # every rank waits for a message: nobody sends
    total = torch.zeros(1)
    dist.recv(total, src=(dist.get_rank() - 1) % dist.get_world_size())
    return int(total.item())


def test_check_ring_sum_accepts_the_solution_and_rejects_mistakes(capsys):
    fn = solution(LAB, "ring_sum")
    assert lab06_launching.check_ring_sum(fn, world_sizes=(2, 3))
    assert capsys.readouterr().out.endswith(
        "Correct: rank 0 gets the sum of the ranks at world sizes 2, 3\n"
    )
    with pytest.raises(AssertionError, match="world_size=3: rank 0 returned 0, expected 3"):
        lab06_launching.check_ring_sum(ring_with(own=0), world_sizes=(3,))
    with pytest.raises(AssertionError, match="world_size=2: rank 0 returned 3, expected 1"):
        lab06_launching.check_ring_sum(ring_with(first=1, extra=1), world_sizes=(2,))
    with pytest.raises(AssertionError, match="the ranks did not all finish"):
        lab06_launching.check_ring_sum(ring_with(closes=False), world_sizes=(2,))
    with pytest.raises(AssertionError, match="the ranks did not all finish") as info:
        lab06_launching.check_ring_sum(everyone_receives_first, world_sizes=(2,), timeout=10)
    assert "timed out after 10 s" in str(info.value)
    assert not lab06_launching.check_ring_sum(stub("ring_sum"), world_sizes=(2,))
    assert "Not attempted yet" in capsys.readouterr().out
