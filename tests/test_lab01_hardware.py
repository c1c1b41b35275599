"""Lab 1, hardware: the datasheet table, two ranks sharing memory bandwidth, and the
exercises' checkers (each accepts the reference and rejects a common mistake)."""

from __future__ import annotations

import itertools
import math

import pytest

from labsupport import launch
from labsupport.estimate.roofline import predicted_seconds, roofline
from labsupport.estimate.units import MiB
from labsupport.labs import lab01_hardware


def test_datasheet_rows_show_ridge_points():
    rows = {r["device"]: r for r in lab01_hardware.datasheet_rows()}
    assert rows["H100 SXM"]["ridge 16-bit"] == "295"
    assert rows["H100 SXM"]["16-bit tensor TFLOP/s"] == "989 (BF16)"
    assert rows["A100 SXM 80GB"]["ridge FP32"] == "9.6"
    assert rows["A100 SXM 80GB"]["GB/s"] == "2,039"
    assert rows["Ryzen 7 7840U (laptop CPU)"]["ridge 16-bit"] == "-"
    assert rows["Ryzen 7 7840U (laptop CPU)"]["GB/s"] == "89.6"


def test_min_tokens_worked_numbers():
    # H100 BF16, d = 8192: b >= 295.2 * 8192 / (8192 - 2 * 295.2) = 318.1 -> 319 tokens
    assert lab01_hardware.min_tokens_compute_bound(8192, 8192, 989e12, 3.35e12, 2) == 319
    # a 256 x 256 bf16 layer tops out at 2*256*256 / (2 * 512) = 128 FLOP/byte < 295
    assert lab01_hardware.min_tokens_compute_bound(256, 256, 989e12, 3.35e12, 2) is None


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
        {"rank": rank, "alone": moved / 2.0**-10, "together": moved / 2.0**-8} for rank in (0, 1)
    ]


def test_shared_copy_bandwidth_runs_for_real():
    results = launch(
        lab01_hardware.shared_copy_bandwidth, 2, kwargs={"nbytes": 16 * MiB, "rounds": 3},
        timeout=120,
    )  # fmt: skip
    assert [sorted(r) for r in results] == [["alone", "rank", "together"]] * 2
    assert [r["rank"] for r in results] == [0, 1]
    assert all(math.isfinite(r["alone"]) and math.isfinite(r["together"]) for r in results)


def test_checkers_accept_the_reference_and_reject_common_mistakes(capsys):
    lab01_hardware.check_roofline(roofline)
    lab01_hardware.check_min_tokens(lab01_hardware.min_tokens_compute_bound)
    lab01_hardware.check_predicted_seconds(predicted_seconds)
    assert capsys.readouterr().out.count("Correct") == 3
    with pytest.raises(AssertionError, match="compute roof caps"):
        lab01_hardware.check_roofline(lambda peak, bw, intensity: bw * intensity)
    with pytest.raises(AssertionError, match="memory bandwidth caps"):
        lab01_hardware.check_roofline(lambda peak, bw, intensity: peak)
    with pytest.raises(AssertionError, match="take the longer"):
        lab01_hardware.check_predicted_seconds(lambda f, b, peak, bw: f / peak + b / bw)
    with pytest.raises(AssertionError, match="below the ridge"):
        lab01_hardware.check_min_tokens(
            lambda d_in, d_out, peak, bw, s: math.ceil(peak / bw)  # the ridge, not tokens
        )

    def never_none(*args):  # right where a batch exists, 1 token where none does
        return lab01_hardware.min_tokens_compute_bound(*args) or 1

    with pytest.raises(AssertionError, match="return None"):
        lab01_hardware.check_min_tokens(never_none)
