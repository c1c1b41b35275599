"""Lab 4's FP8 section: what its table and its delayed-scaling run claim, with margins that
hold on any CPU (the FP8 casts and products are exact; only fp32 sums round)."""

from __future__ import annotations

import pytest

from labsupport.labs import lab04_fp8 as lab


def test_the_lab_s_table_per_tensor_breaks_where_e4m3_s_range_ends_and_blocks_do_not():
    table = lab.error_table((0, 1e4, 1e6))
    base = table[0]["E4M3 blocks"]
    assert 0.03 < base < 0.045  # about 2^-4 / sqrt(3): one E4M3 rounding of each input
    for errors in table.values():
        assert errors["E4M3 blocks"] == pytest.approx(base, rel=0.05)
        assert errors["bf16"] < base / 10
        assert 1.5 * base < errors["E5M2 per tensor"] < 3 * base  # one bit less, any range
    assert table[1e4]["E4M3 per tensor"] < 1.1 * base  # 10^4 fits E4M3's 2^17.8 range
    assert table[1e6]["E4M3 per tensor"] > 10 * base  # 10^6 does not


def test_the_lab_s_delayed_scaling_clips_the_step_after_a_jump_only():
    rows = lab.delayed_scaling_run()
    clipped = [r["clipped"] for r in rows]
    assert clipped[:3] == [0, 0, 0] and clipped[3] > 1000 and clipped[5] == 0
