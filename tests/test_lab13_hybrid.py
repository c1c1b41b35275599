"""Lab 13, hybrid parallelism: the traffic of each mesh axis counted on real ranks against
the formulas, PyTorch's DeviceMesh against Mesh, the planner's tables, and the exercises'
checkers against the notebook's worked solutions and wrong answers."""

from __future__ import annotations

import pytest
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.estimate.memory import training_memory
from labsupport.estimate.published import PUBLISHED
from labsupport.estimate.runs import runs
from labsupport.labs import lab13_hybrid as lab
from labsupport.labs.cells import format_table
from labsupport.parallel.parallel_state import Mesh

LAB = "13-hybrid-parallel.ipynb"


@pytest.mark.parametrize(("dp", "tp", "pp"), [(2, 2, 2), (2, 1, 2), (1, 2, 1)])
def test_the_traffic_of_each_axis_is_the_formula(dp, tp, pp):
    results = launch(lab.train_3d_counted, dp * tp * pp, args=(dp, tp, pp), timeout=300)
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
        (lab.check_coords, "my_coords"),
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


def test_coords_checker_rejects_wrong_orders():
    def slowest_first(rank, dp, tp, pp):
        return Mesh(dp, tp, pp, "pp-dp-tp").coords(rank)

    def dp_fastest(rank, dp, tp, pp):
        return Mesh(dp, tp, pp, "dp-tp-pp").coords(rank)

    with pytest.raises(AssertionError, match="varies fastest"):
        lab.check_coords(slowest_first)
    with pytest.raises(AssertionError, match="rank 1"):
        lab.check_coords(dp_fastest)


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
