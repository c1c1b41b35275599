"""Lab 7 and 8 helpers: labelled runs of each primitive, checkers, ring schedule, timing."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from labsupport import LaunchError, collectives, comm, launch, plotting, primitives


def every_primitive():
    return {name: primitives.run_primitive(name) for name in primitives.PRIMITIVES}


@pytest.mark.parametrize("world_size", [2, 3, 4])
def test_each_primitive_matches_torch_on_labelled_data(world_size):
    results = launch(every_primitive, world_size, timeout=120)
    for name in primitives.PRIMITIVES:
        per_rank = [r[name] for r in results]
        assert primitives.agreement(per_rank, name).endswith(f"on all {world_size} ranks")
    broadcast = [r["broadcast"]["ours"].tolist() for r in results]
    assert broadcast == [[0.0, 1.0]] * world_size
    all_to_all = [r["all_to_all"]["ours"].tolist() for r in results]
    assert all_to_all[1] == [10.0 * j + 1 for j in range(world_size)]


def test_agreement_raises_on_a_mismatch():
    results = [{"ours": torch.tensor([1.0]), "torch": torch.tensor([2.0])}]
    with pytest.raises(AssertionError, match="rank 0: ours"):
        primitives.agreement(results, "broadcast")
    with pytest.raises(LaunchError, match="ValueError: name must be one of"):
        launch(primitives.run_primitive, 1, args=("all_reduce_everything",))


def test_lab7_checkers_accept_solutions_and_reject_mistakes(capsys):
    def correct(tensor_list, tensor):
        dist.all_gather(tensor_list, tensor)

    def off_by_one(tensor_list, tensor):
        dist.all_gather(tensor_list, tensor + 1)

    primitives.check_ring_all_gather(correct, world_sizes=(2, 3))
    with pytest.raises(AssertionError, match="world_size=2, rank 0"):
        primitives.check_ring_all_gather(off_by_one, world_sizes=(2,))
    primitives.check_all_reduce_from_rs_ag(lambda t: dist.all_reduce(t), world_sizes=(3,))
    with pytest.raises(AssertionError, match="world_size=3"):
        primitives.check_all_reduce_from_rs_ag(lambda t: None, world_sizes=(3,))
    assert capsys.readouterr().out.count("Correct") == 2


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_ring_schedule_completes_each_chunk_where_the_code_says(world):
    steps = plotting.ring_states(world)
    assert len(steps) == 1 + 2 * (world - 1)
    after_reduce_scatter = steps[world - 1][2]
    for rank in range(world):  # rank r owns the fully reduced chunk r
        assert after_reduce_scatter[rank][rank] == set(range(world))
    assert all(who == set(range(world)) for row in steps[-1][2] for who in row)


def test_figures_of_collectives_and_the_ring_draw():
    results = launch(primitives.run_primitive, 3, args=("all_reduce",), timeout=60)
    ax = plotting.draw_collective(results, "all_reduce")
    labels = {t.get_text() for t in ax.texts}
    assert {"rank 0", "rank 2", "before", "after", "30"} <= labels  # 0 + 10 + 20
    fig = plotting.draw_ring_allreduce(3)
    assert sum(1 for ax in fig.axes if ax.get_title()) == 1 + 2 * 2


def test_time_all_reduce_reports_on_rank_zero_only():
    results = launch(comm.time_all_reduce, 3, args=([64, 4096], "ring", 2), timeout=60)
    assert results[1] is None and results[2] is None
    assert [r["bytes"] for r in results[0]] == [64, 4096]
    assert all(r["seconds"] > 0 for r in results[0])


def test_lab8_checkers_accept_solutions_and_reject_mistakes():
    comm.check_ring_bytes(lambda s, n: 2 * (n - 1) * s // n)
    with pytest.raises(AssertionError, match="expected"):
        comm.check_ring_bytes(lambda s, n: 2 * s)
    comm.check_ring_time(lambda s, n, a, b: 2 * (n - 1) * (a + s / n * b))
    with pytest.raises(AssertionError, match="expected"):
        comm.check_ring_time(lambda s, n, a, b: (n - 1) * (a + s / n * b))


def test_the_cost_models_follow_their_formulas():
    a, b, s = 1e-5, 1e-9, 1e6
    assert comm.all_reduce_time("ring", 4, s, a, b) == pytest.approx(6 * a + 1.5 * s * b)
    assert comm.all_reduce_time("naive", 4, s, a, b) == pytest.approx(6 * (a + s * b))
    assert comm.all_reduce_time("tree", 5, s, a, b) == pytest.approx(6 * (a + s * b))
    assert comm.all_reduce_time("halving_doubling", 8, s, a, b) == pytest.approx(
        6 * a + 1.75 * s * b
    )
    assert comm.bus_bandwidth(1e9, 1.0, 8) == pytest.approx(1.75e9)
    with pytest.raises(ValueError, match="unknown algorithm"):
        comm.all_reduce_time("carrier-pigeon", 4, s, a, b)
    assert collectives.bytes_sent("ring", 1000, 4, 1, 0) == 0
