"""Lab 1, hardware: the datasheet table, the roofline's kernels timed side by side, two
ranks sharing memory bandwidth, and the exercises' checkers (each accepts the notebook's
worked solution, rejects plausible mistakes and says "not attempted yet" for the stub)."""

from __future__ import annotations

import itertools
import math

import pytest
import torch
from notebook_solutions import solution, stub

from labsupport import launch
from labsupport.estimate.units import MiB
from labsupport.labs import lab01_hardware

LAB = "01-hardware.ipynb"


def test_datasheet_rows_show_ridge_points():
    rows = {r["device"]: r for r in lab01_hardware.datasheet_rows()}
    assert rows["H100 SXM"]["ridge 16-bit"] == "295"
    assert rows["H100 SXM"]["16-bit tensor TFLOP/s"] == "989 (BF16)"
    assert rows["A100 SXM 80GB"]["ridge FP32"] == "9.6"
    assert rows["A100 SXM 80GB"]["GB/s"] == "2,039"
    assert rows["Ryzen 7 7840U (laptop CPU)"]["ridge 16-bit"] == "-"
    assert rows["Ryzen 7 7840U (laptop CPU)"]["GB/s"] == "89.6"


@pytest.mark.parametrize(
    ("name", "entry"),
    [
        ("NVIDIA H100 80GB HBM3", "H100 SXM"),
        ("NVIDIA H100 PCIe", None),
        ("NVIDIA H100 NVL", None),
        ("NVIDIA H200", "H200 SXM"),
        ("NVIDIA H200 NVL", None),
        ("NVIDIA A100-SXM4-80GB", "A100 SXM 80GB"),
        ("NVIDIA A100-SXM4-40GB", None),
        ("NVIDIA A100 80GB PCIe", None),
        ("Tesla V100-SXM2-32GB", "V100 SXM2"),
        ("NVIDIA GeForce RTX 4090", "RTX 4090"),
        ("AMD Ryzen 7 7840U w/ Radeon 780M Graphics", "Ryzen 7 7840U (laptop CPU)"),
        ("AMD EPYC", None),
    ],
)
def test_datasheet_for_matches_only_the_exact_part(name, entry):
    found = lab01_hardware.datasheet_for(name)
    assert (found and found["name"]) == entry


def test_device_name_of_the_cpu_is_its_model():
    assert lab01_hardware.device_name("cpu") == lab01_hardware.cpu_model()


def test_min_tokens_worked_numbers():
    # H100 BF16, d = 8192: b >= 295.2 * 8192 / (8192 - 2 * 295.2) = 318.1 -> 319 tokens
    assert lab01_hardware.min_tokens_compute_bound(8192, 8192, 989e12, 3.35e12, 2) == 319
    # a 256 x 256 bf16 layer tops out at 2*256*256 / (2 * 512) = 128 FLOP/byte < 295
    assert lab01_hardware.min_tokens_compute_bound(256, 256, 989e12, 3.35e12, 2) is None


@pytest.fixture
def one_thread():
    """One torch thread for the test: under ``make unit`` another pytest worker shares
    the two cores, and a kernel split over two threads then waits for whichever thread
    the other worker's process held off its core, in one kernel more than in another."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_roofline_side_by_side_counts_and_ratios(one_thread):
    race = lab01_hardware.roofline_side_by_side("cpu", rounds=7)
    add, copy, matmul = race["add"], race["copy"], race["matmul"]
    assert (add["flops"], add["bytes"]) == (16 * 2**20, 12 * 16 * 2**20)
    assert (copy["flops"], copy["bytes"]) == (0, 8 * 64 * 2**20)
    assert (matmul["flops"], matmul["bytes"]) == (2 * 1024**3, 4 * 3 * 1024**2)
    assert add["vs add"] == 1.0
    assert all(k["seconds"] > 0 for k in race.values())
    # what the lab asserts, on ratios measured in the same rounds: they hold under load
    assert 0.5 < add["bytes"] / copy["bytes"] * copy["vs add"] < 2
    assert add["flops"] / matmul["flops"] * matmul["vs add"] < 0.1


class SteppingClock:
    """Each read of ``perf_counter`` moves the clock by the next of ``steps``, in a cycle."""

    def __init__(self, steps):
        self.times = itertools.accumulate(itertools.cycle(steps))

    def perf_counter(self) -> float:
        return next(self.times)


def copies_on_a_stepping_clock(nbytes, rounds):
    """shared_copy_bandwidth with real copies and barriers, on a clock that makes each
    rank's copy alone take 2^-10 s (about 1 ms) and each copy together 2^-8 s."""
    lab01_hardware.time = SteppingClock([0.0, 2.0**-10, 0.0, 2.0**-8])
    return lab01_hardware.shared_copy_bandwidth(nbytes=nbytes, rounds=rounds)


def test_shared_copy_bandwidth_reports_each_rank_alone_and_together():
    nbytes = 4 * MiB
    results = launch(copies_on_a_stepping_clock, 2, args=(nbytes, 3), timeout=120)
    moved = 2 * nbytes  # a copy reads and writes every byte
    assert results == [
        {
            "rank": rank,
            "alone": moved / 2.0**-10,
            "together": moved / 2.0**-8,
            "together / alone": 0.25,
        }
        for rank in (0, 1)
    ]


def test_shared_copy_bandwidth_runs_for_real():
    results = launch(
        lab01_hardware.shared_copy_bandwidth,
        2,
        kwargs={"nbytes": 16 * MiB, "rounds": 3},
        timeout=120,
    )
    assert [sorted(r) for r in results] == [["alone", "rank", "together", "together / alone"]] * 2
    assert [r["rank"] for r in results] == [0, 1]
    assert all(math.isfinite(r["alone"]) and math.isfinite(r["together"]) for r in results)


# --------------------------------------------------------------------------- exercises


def accepts(check, fn, capsys) -> None:
    """``check`` passes ``fn`` and says so, without giving the answer away."""
    assert check(fn)
    out = capsys.readouterr().out
    assert out.startswith("Correct: ") and out.count("\n") == 1
    assert "min(" not in out and "max(" not in out


def says_not_attempted(check, name, capsys) -> None:
    assert not check(stub(name))
    assert capsys.readouterr().out.startswith(f"Not attempted yet: write {name}()")


def test_check_roofline(capsys):
    accepts(lab01_hardware.check_roofline, solution(LAB, "attainable"), capsys)
    says_not_attempted(lab01_hardware.check_roofline, "attainable", capsys)
    with pytest.raises(AssertionError, match="compute roof caps"):
        lab01_hardware.check_roofline(lambda peak, bw, intensity: bw * intensity)
    with pytest.raises(AssertionError, match="memory bandwidth caps"):
        lab01_hardware.check_roofline(lambda peak, bw, intensity: peak)
    with pytest.raises(AssertionError, match="lower than the model allows"):  # the harmonic sum
        lab01_hardware.check_roofline(lambda peak, bw, i: 1 / (1 / peak + 1 / (bw * i + 1e-300)))


def test_check_min_tokens(capsys):
    accepts(lab01_hardware.check_min_tokens, solution(LAB, "min_tokens"), capsys)
    says_not_attempted(lab01_hardware.check_min_tokens, "min_tokens", capsys)
    with pytest.raises(AssertionError, match="below the ridge"):
        lab01_hardware.check_min_tokens(
            lambda d_in, d_out, peak, bw, s: math.ceil(peak / bw)  # the ridge, not tokens
        )

    def never_none(*args):  # right where a batch exists, 1 token where none does
        return lab01_hardware.min_tokens_compute_bound(*args) or 1

    with pytest.raises(AssertionError, match="return None"):
        lab01_hardware.check_min_tokens(never_none)

    def one_too_many(*args):  # rounds up past the boundary
        b = lab01_hardware.min_tokens_compute_bound(*args)
        return None if b is None else b + 1

    with pytest.raises(AssertionError, match="is not the fewest"):
        lab01_hardware.check_min_tokens(one_too_many)

    def ignores_itemsize(d_in, d_out, peak, bw, itemsize):  # always 2 bytes per number
        return lab01_hardware.min_tokens_compute_bound(d_in, d_out, peak, bw, 2)

    with pytest.raises(AssertionError, match="4 bytes per number"):
        lab01_hardware.check_min_tokens(ignores_itemsize)


def test_check_predicted_seconds(capsys):
    accepts(lab01_hardware.check_predicted_seconds, solution(LAB, "predicted_seconds"), capsys)
    says_not_attempted(lab01_hardware.check_predicted_seconds, "predicted_seconds", capsys)
    with pytest.raises(AssertionError, match="overlap"):
        lab01_hardware.check_predicted_seconds(lambda f, b, peak, bw: f / peak + b / bw)
    with pytest.raises(AssertionError, match="no less time than its arithmetic"):
        lab01_hardware.check_predicted_seconds(lambda f, b, peak, bw: min(f / peak, b / bw))
    with pytest.raises(AssertionError, match="got"):  # the bytes alone
        lab01_hardware.check_predicted_seconds(lambda f, b, peak, bw: b / bw)
