"""labsupport.labs.cells, what every lab's cells share: the source of the code they run,
tables, and the decorator that turns a checker into an exercise."""

from __future__ import annotations

import re

import pytest
import torch
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
    assert capsys.readouterr().out.startswith("Not attempted yet: write stub()")


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


class Sharded:
    """A lab's class stub: the learner writes its methods."""

    def __init__(self, n):
        self.n = n

    def step(self):
        raise NotImplementedError


def calls_the_class_stub():
    Sharded(2).step()


def test_an_exercise_on_ranks_tells_a_stub_from_a_failure(capsys):
    assert not check_on_ranks(rank_zero_stub)
    assert capsys.readouterr().out.startswith("Not attempted yet: write rank_zero_stub(), then")
    assert not check_on_ranks(calls_the_class_stub)  # the rank's traceback names step only
    assert capsys.readouterr().out.startswith("Not attempted yet: write Sharded.step(), then")
    assert not check_double(lambda x: Sharded(x).step())
    assert capsys.readouterr().out.startswith("Not attempted yet: write Sharded.step(), then")
    with pytest.raises(LaunchError, match="a real mistake"):
        check_on_ranks(broken_on_rank_one)


def test_number_takes_what_float_takes_and_says_what_else_to_return():
    assert cells.number(3) == 3.0 and cells.number("2.5") == 2.5
    with pytest.raises(AssertionError, match=r"returned None: it should return a number$"):
        cells.number(None)
    with pytest.raises(AssertionError, match="returned 'a lot': it should return a fraction"):
        cells.number("a lot", "a fraction")


def only_rank_0_calls_all_reduce():  # the other rank never joins: the launch hangs
    total = torch.zeros(1)
    if dist.get_rank() == 0:
        dist.all_reduce(total)
    return total.item()


def test_expect_close_names_the_rank_the_tensor_and_the_first_differing_element():
    cells.expect_close(torch.tensor([1.0, 2.0]), torch.tensor([1.0, 2.0 + 1e-7]), "x")
    got, want = torch.tensor([[1.0, 2.0], [3.0, 4.0]]), torch.tensor([[1.0, 2.0], [3.0, 8.0]])
    with pytest.raises(AssertionError) as info:
        cells.expect_close(got, want, "w.grad", rank=2, hint="averaged twice?")
    assert str(info.value) == (
        "rank 2: w.grad differs at [1, 1] (and 0 more of 4 elements): expected 8, got 4 "
        "(averaged twice?)"
    )
    with pytest.raises(AssertionError, match=r"^b has shape \(3,\), expected \(2,\)$"):
        cells.expect_close(torch.zeros(3), torch.zeros(2), "b")


def test_launch_answer_reports_a_hang_as_a_wrong_answer_and_a_raise_as_it_is():
    assert cells.launch_answer(dist.get_rank, 2, "unused", timeout=60) == [0, 1]
    with pytest.raises(AssertionError) as info:
        cells.launch_answer(only_rank_0_calls_all_reduce, 2, "Does every rank join?", timeout=5)
    text = str(info.value)
    assert text.startswith("on 2 ranks, the ranks did not all finish within 5 s. Does every")
    assert text.split("\n", 1)[1].strip()  # the launcher's account of the ranks follows
    with pytest.raises(LaunchError, match="a real mistake"):
        cells.launch_answer(broken_on_rank_one, 2, "unused", timeout=60)


def shown(exc: BaseException) -> str:
    """What IPython shows for ``exc``: its ``_render_traceback_``, without colours."""
    assert hasattr(exc, "_render_traceback_"), "IPython would show the whole traceback"
    return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(exc._render_traceback_()))


@cells.exercise
def check_square(fn) -> str:
    """A checker that says what is wrong and hints at the fix, as the labs' do."""
    for x in (0, 1, 3):
        got = round(fn(x), 6)
        if got != x * x:
            hint = "that is 2x: multiply x by itself" if got == 2 * x else "multiply x by itself"
            raise AssertionError(f"x={x}: got {got}, expected {x * x}; {hint}")
    return "fn(x) = x²"


def test_a_wrong_answer_shows_the_verdict_alone():
    def doubled(x):
        return 2 * x

    with pytest.raises(AssertionError, match="x=1: got 2, expected 1") as raised:
        check_square(doubled)
    assert shown(raised.value).splitlines() == [
        "Not right yet: x=1: got 2, expected 1; that is 2x: multiply x by itself",
        "Change doubled() above, run its cell, then this one again.",
    ]


def test_an_error_in_the_learners_code_shows_only_the_learners_frames():
    def lookup(x):
        return {}[x]

    with pytest.raises(KeyError) as raised:
        check_square(lookup)
    text = shown(raised.value)
    assert text.startswith("check_square() ran your lookup(), which raised:\n")
    assert "return {}[x]" in text and text.rstrip().endswith("KeyError: 0")
    assert "labsupport" not in text and "round(fn(x), 6)" not in text, text


def test_an_answer_the_checker_cannot_use_is_a_verdict_too():
    def nothing(x):
        return None

    with pytest.raises(TypeError) as raised:
        check_square(nothing)
    assert shown(raised.value).splitlines() == [
        "Not right yet: check_square() could not use what nothing() gave it: "
        "TypeError: type NoneType doesn't define __round__ method",
        "Change nothing() above, run its cell, then this one again.",
    ]


def test_a_checkers_result_prints_nothing_in_a_notebook():
    from IPython.core.interactiveshell import InteractiveShell

    shell = InteractiveShell.instance()
    for passed in (True, False):
        assert shell.display_formatter.format(cells.Checked(passed)) == ({}, {})
    assert repr(cells.Checked(False)) == "Checked(passed=False)"


def test_a_real_kernel_shows_the_verdict_and_only_the_learners_frames():
    from jupyter_client.manager import start_new_kernel

    manager, client = start_new_kernel(kernel_name="python3")
    try:

        def run(code: str) -> list[str]:
            """The cell's error output, as JupyterLab shows it (colours removed)."""
            errors = []
            client.execute_interactive(
                code,
                timeout=60,
                output_hook=lambda msg: (
                    errors.append(msg["content"]) if msg["msg_type"] == "error" else None
                ),
            )
            assert len(errors) == 1
            return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(errors[0]["traceback"])).splitlines()

        client.execute_interactive("from labsupport.labs import lab14_zero as lab", timeout=60)
        shown = run(
            "def state_bytes(n, stage, dp):\n    return 16 * n\nlab.check_state_bytes(state_bytes)"
        )
        assert shown == [
            "Not right yet: num_params=7.5e+09, stage=1, dp=64: got 1.2e+11 bytes, expected "
            "3.14062e+10 (sharding divides some of the states by dp)",
            "Change state_bytes() above, run its cell, then this one again.",
        ]
        shown = run(
            "def state_bytes(n, stage, dp):\n"
            "    return {}[stage]\n"
            "lab.check_state_bytes(state_bytes)"
        )
        assert shown[0] == "check_state_bytes() ran your state_bytes(), which raised:"
        assert "----> 2     return {}[stage]" in shown and shown[-1] == "KeyError: 0"
        assert not any("labsupport" in line for line in shown), shown
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)
