"""Lab 13, hybrid parallelism: the traffic of each mesh axis counted on real ranks against
the formulas, PyTorch's DeviceMesh against Mesh, the planner's tables, and the exercises'
checkers against the notebook's worked solutions and wrong answers."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from notebook_solutions import solution, stub
from test_lab07_collectives import checks

from labsupport import launch
from labsupport.estimate.memory import training_memory
from labsupport.estimate.published import PUBLISHED
from labsupport.estimate.runs import runs
from labsupport.labs import lab13_hybrid as lab
from labsupport.labs import lab13_mesh
from labsupport.labs.cells import format_table
from labsupport.parallel.parallel_state import AXES, Mesh

LAB = "13-hybrid-parallel.ipynb"


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (2, 1, 2), (1, 2, 1)])
def test_the_traffic_of_each_axis_is_the_formula(dp, tp, pp):
    results = launch(
        lab.train_3d_counted, dp * tp * pp, args=(lab.lab_train, dp, tp, pp), timeout=300
    )
    for r in results:
        want = lab.expected_traffic(r["coords"], dp, tp, pp)
        assert r["traffic"] == want, r["rank"]
        assert (want["tp"] > 0) == (tp > 1) and (want["pp"] > 0) == (pp > 1)
        assert (want["dp"] > 0) == (dp > 1)


def test_init_device_mesh_makes_the_groups_of_mesh_in_both_orders():
    for r in launch(lab.device_mesh_groups, 8, timeout=120):
        for name, order in lab.ORDERS.items():
            mesh = Mesh(lab.DP, lab.TP, lab.PP, order)
            for axis in ("tp", "dp", "pp"):
                assert r["groups"][name][axis] == mesh.group_of(axis, r["rank"])


def test_the_planners_tables():
    checks = lab.checked()
    rows = lab.published_rows(checks)
    assert [row["run"] for row in rows] == [e["name"] for e in PUBLISHED]
    for row in rows:
        if row["rank"] != "-":
            rank, of = row["rank"].split(" of ")
            assert 1 <= int(rank) <= int(of)
    table = lab.calibration_rows()
    assert {row["sample"] for row in table} == {"in", "out"}
    assert len(table) == len(runs())
    sensitivity = lab.sensitivity_rows()
    assert [row["run"] for row in sensitivity] == list(lab.SENSITIVITY)
    printed = [lab.published_tables(checks), format_table(table), format_table(sensitivity)]
    for text in printed:
        assert max(len(line) for line in text.splitlines()) <= 80
    top = lab.plan_rows("BLOOM-176B", "Jean Zay (BLOOM)", 2048, top=3)
    assert len(top) == 3
    steps = [float(row["step (s)"]) for row in top]
    assert steps == sorted(steps)
    explorer = lab.explorer()
    assert explorer.describe() == format_table(
        lab.plan_rows("GPT-3 175B", "Selene, 1,536 GPUs", 1536, top=8)
    )
    assert max(len(line) for line in explorer.describe().splitlines()) <= 80
    assert "live widget" in repr(explorer)


def test_the_assumption_checker_wants_one_assumption_that_moves_the_ranking():
    assert lab.check_assumption(lambda: {"dp_overlap": (False,)})
    assert lab.check_assumption(lambda: {"gemm": 0.3})
    with pytest.raises(AssertionError, match="one assumption"):
        lab.check_assumption(lambda: {"dp_overlap": (False,), "gemm": 0.3})
    with pytest.raises(AssertionError, match="not an assumption"):
        lab.check_assumption(lambda: {"speed": 2})
    with pytest.raises(AssertionError, match="does not change the ranking"):
        lab.check_assumption(lambda: {"fp8": (False,)})


@pytest.mark.parametrize(
    ("check", "name"),
    [
        (lab.check_tp_bytes, "tp_bytes"),
        (lab.check_states_per_gpu, "states_per_gpu"),
        (lab.check_assumption, "one_assumption"),
    ],
)
def test_checkers_accept_the_solutions_and_say_not_attempted_to_the_stub(check, name, capsys):
    assert check(solution(LAB, name))
    assert "Correct" in capsys.readouterr().out
    assert not check(stub(name))
    assert "Not attempted yet" in capsys.readouterr().out


def reversed_order(dp, tp, pp, order):
    """Reads the order slowest-first: tensor-parallel groups strided, not consecutive."""
    return {a: Mesh(dp, tp, pp, "-".join(order.split("-")[::-1])).groups(a) for a in AXES}


def sizes_swapped(dp, tp, pp, order):
    """Takes dp for tp and tp for dp: groups of the wrong size."""
    return {a: Mesh(tp, dp, pp, order).groups(a) for a in AXES}


def own_groups_only(dp, tp, pp, order):
    """Each rank returns only the groups it belongs to: the ranks create different
    groups, and dist.new_group waits for ranks that never join."""
    rank, mesh = dist.get_rank(), Mesh(dp, tp, pp, order)
    return {a: [mesh.group_of(a, rank)] for a in AXES}


def test_check_mesh_groups(capsys):
    mistakes = [
        (
            reversed_order,
            r"on 6 ranks, dp=3, tp=2, pp=1, order 'tp-dp-pp': your tp group of rank 0 is "
            r"\[0, 3\], expected \[0, 1\] \(tp varies fastest: its groups are consecutive "
            r"ranks\); init_device_mesh\(mesh_dim_names=\('pp', 'dp', 'tp'\)\) makes Mesh's",
        ),
        (
            sizes_swapped,
            r"dp=3, tp=2, pp=1, order 'tp-dp-pp': your tp group \[0, 1, 2\] has 3 ranks; a tp "
            r"group has tp=2 ranks",
        ),
        (lambda dp, tp, pp, order: [], "return a dict with the keys 'tp', 'dp' and 'pp'"),
    ]
    check = lab13_mesh.check_mesh_groups
    checks(
        capsys, check, LAB, "mesh_groups", "on 6 ranks your groups are init_device_mesh's", mistakes
    )
    with pytest.raises(AssertionError, match="did not all finish within 20 s") as info:
        check(own_groups_only, timeout=20)
    assert "every rank must create every group" in str(info.value)


def test_the_mesh_checker_names_a_larger_mesh_it_checks_offline():
    def wrong_beyond_six(dp, tp, pp, order):
        if dp * tp * pp <= 6:
            return {a: Mesh(dp, tp, pp, order).groups(a) for a in AXES}
        return reversed_order(dp, tp, pp, order)

    with pytest.raises(AssertionError, match=r"offline, dp=2, tp=2, pp=2, order 'tp-dp-pp': your "
                       r"tp group of rank 0 is \[0, 4\], expected \[0, 1\]"):  # fmt: skip
        lab13_mesh.check_mesh_groups(wrong_beyond_six)


def test_tp_bytes_checker_rejects_half_the_all_reduces_and_whole_tensors():
    with pytest.raises(AssertionError, match="two all-reduces forward"):
        lab.check_tp_bytes(lambda b, s, h, t, e: 4 * (t - 1) / t * b * s * h * e)
    with pytest.raises(AssertionError, match=r"2\(t-1\)/t"):
        lab.check_tp_bytes(lambda b, s, h, t, e: 4 * b * s * h * e)


def test_states_checker_rejects_the_whole_model_and_sharding_everything():
    def whole_model(n, t, p, d, z):
        return sum(training_memory(n, "mixed", z, d).values())

    with pytest.raises(AssertionError, match="each hold a part"):
        lab.check_states_per_gpu(whole_model)
    with pytest.raises(AssertionError, match="expected"):
        lab.check_states_per_gpu(lambda n, t, p, d, z: 16 * n / (t * p * d))
