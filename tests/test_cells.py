"""labsupport.labs.cells, what every lab's cells share: the source of the code they run,
tables, and the decorator that turns a checker into an exercise."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from labsupport import LaunchError, launch
from labsupport.labs import cells, lab06_launching


def test_format_table_aligns_columns():
    table = cells.format_table([{"rank": 0, "device": "cpu"}, {"rank": 10, "device": "cuda:1"}])
    assert table.splitlines() == [
        "rank  device",
        "----  ------",
        "0     cpu",
        "10    cuda:1",
    ]
    assert cells.format_table([{"a": 1, "b": 2}], columns=["b"]).splitlines() == ["b", "-", "2"]


def test_show_source_shows_the_real_function():
    code = cells.show_source(lab06_launching.world_info)
    assert code.data.startswith("def world_info() -> dict:")
    assert "dist.get_rank()" in code.data


@cells.exercise
def check_double(fn) -> str:
    """A checker as the labs write them: asserts, then says what it checked."""
    for x in (0, 1, 5):
        assert fn(x) == 2 * x, f"x={x}: got {fn(x)}, expected {2 * x}"
    return "fn(x) = 2x"


def stub(x):
    raise NotImplementedError


def test_an_exercise_says_correct_wrong_or_not_attempted(capsys):
    assert check_double(lambda x: x + x)
    assert capsys.readouterr().out == "Correct: fn(x) = 2x\n"
    with pytest.raises(AssertionError, match="x=1: got 1, expected 2"):
        check_double(lambda x: x * x)
    assert not check_double(stub)
    assert capsys.readouterr().out.startswith("Not attempted yet: write the body of stub()")


def rank_zero_stub():
    if dist.get_rank() == 0:
        raise NotImplementedError
    dist.barrier()


@cells.exercise
def check_on_ranks(fn) -> str:
    launch(fn, 2, timeout=60)
    return "ran on 2 ranks"


def broken_on_rank_one():
    if dist.get_rank() == 1:
        raise ValueError("a real mistake")
    dist.barrier()


def test_an_exercise_on_ranks_tells_a_stub_from_a_failure(capsys):
    assert not check_on_ranks(rank_zero_stub)
    assert "Not attempted yet" in capsys.readouterr().out
    with pytest.raises(LaunchError, match="a real mistake"):
        check_on_ranks(broken_on_rank_one)


def test_a_checkers_result_prints_nothing_in_a_notebook():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    for passed in (True, False):
        assert shell.display_formatter.format(cells.Checked(passed)) == ({}, {})
    assert repr(cells.Checked(False)) == "Checked(passed=False)"
