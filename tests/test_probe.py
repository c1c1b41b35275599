"""Lab 1's pieces: FLOP and byte counts checked against PyTorch's own counter and tensor
sizes, the roofline against hand-worked numbers, datasheet entries against the published
values, and the measurements run for real on this machine."""

from __future__ import annotations

import math
import os
import time

import matplotlib
import numpy as np
import psutil
import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from labsupport import launch, probe

matplotlib.use("Agg")

# --------------------------------------------------------------------------- counting


def test_copy_and_add_move_the_bytes_their_tensors_hold():
    numel = 1000
    a, b = torch.ones(numel), torch.ones(numel)
    c = a + b
    tensor_bytes = [t.untyped_storage().nbytes() for t in (a, b, c)]
    assert probe.kernel_cost("copy", numel=numel) == {"flops": 0, "bytes": 2 * tensor_bytes[0]}
    assert probe.kernel_cost("add", numel=numel) == {"flops": numel, "bytes": sum(tensor_bytes)}
    assert probe.arithmetic_intensity("add", numel=numel) == pytest.approx(1 / 12)
    assert probe.arithmetic_intensity("add", numel=numel, itemsize=2) == pytest.approx(1 / 6)
    assert probe.arithmetic_intensity("copy", numel=numel) == 0


@pytest.mark.parametrize(("m", "k", "n"), [(64, 64, 64), (3, 5, 7), (128, 512, 32)])
def test_matmul_flops_match_pytorchs_flop_counter(m, k, n):
    a, b = torch.randn(m, k), torch.randn(k, n)
    with FlopCounterMode(display=False) as counter:
        c = a @ b
    cost = probe.kernel_cost("matmul", m=m, k=k, n=n)
    assert cost["flops"] == counter.get_total_flops() == 2 * m * n * k
    assert cost["bytes"] == sum(t.untyped_storage().nbytes() for t in (a, b, c))


def test_square_matmul_intensity_is_n_over_6_in_fp32_and_n_over_3_in_bf16():
    for n in (64, 1024, 8192):
        assert probe.arithmetic_intensity("matmul", m=n, k=n, n=n) == pytest.approx(n / 6)
        assert probe.arithmetic_intensity("matmul", m=n, k=n, n=n, itemsize=2) == pytest.approx(
            n / 3
        )


def test_unknown_kernel_is_refused_clearly():
    with pytest.raises(ValueError, match="unknown kernel"):
        probe.kernel_cost("conv", numel=4)


# --------------------------------------------------------------------------- the roofline


def test_roofline_is_the_lower_of_the_two_roofs():
    peak, bw = 100.0, 10.0  # ridge at 10 FLOP/byte
    assert probe.ridge_point(peak, bw) == 10
    assert probe.roofline(peak, bw, 1) == 10
    assert probe.roofline(peak, bw, 10) == 100
    assert probe.roofline(peak, bw, 1000) == 100
    got = probe.roofline(peak, bw, np.array([0.0, 5.0, 20.0]))
    np.testing.assert_array_equal(got, [0.0, 50.0, 100.0])


def test_h100_ridge_point_worked_number():
    h100 = probe.datasheet("H100 SXM")
    # 989e12 / 3.35e12 = 295.2 FLOP/byte (BF16 dense), 67e12 / 3.35e12 = 20 (FP32)
    assert probe.ridge_point(h100["tensor"], h100["bandwidth"]) == pytest.approx(295.22, abs=0.01)
    assert probe.ridge_point(h100["fp32"], h100["bandwidth"]) == pytest.approx(20.0)


def test_predicted_seconds_takes_the_longer_of_compute_and_memory():
    assert probe.predicted_seconds(1e12, 1e9, 1e12, 1e11) == 1.0  # compute-bound
    assert probe.predicted_seconds(1e9, 1e12, 1e12, 1e11) == 10.0  # memory-bound
    add = probe.kernel_cost("add", numel=2**28)
    h100 = probe.datasheet("H100 SXM")
    # 3 GiB through 3.35 TB/s: 0.96 ms; its 2^28 FLOPs would take 4 µs at 67 TFLOP/s
    assert probe.predicted_seconds(add["flops"], add["bytes"], h100["fp32"], h100["bandwidth"]) == (
        pytest.approx(3 * 2**30 / 3.35e12)
    )


def test_min_tokens_worked_numbers():
    # H100 BF16, d = 8192: b >= 295.2 * 8192 / (8192 - 2 * 295.2) = 318.1 -> 319 tokens
    assert probe.min_tokens_compute_bound(8192, 8192, 989e12, 3.35e12, 2) == 319
    # a 256 x 256 bf16 layer tops out at 2*256*256 / (2 * 512) = 128 FLOP/byte < 295
    assert probe.min_tokens_compute_bound(256, 256, 989e12, 3.35e12, 2) is None


# --------------------------------------------------------------------------- datasheets


@pytest.mark.parametrize(
    ("name", "gb_s", "fp32_tflops", "tensor_tflops"),
    [
        ("V100 SXM2", 900, 15.7, 125),
        ("A100 SXM 80GB", 2039, 19.5, 312),  # 624 with sparsity
        ("H100 SXM", 3350, 67, 989),  # 1,979 with sparsity
        ("H200 SXM", 4800, 67, 989),
        ("RTX 4090", 1008, 82.6, 165.2),
    ],
)
def test_datasheet_entries_hold_the_published_dense_numbers(name, gb_s, fp32_tflops, tensor_tflops):
    entry = probe.datasheet(name)
    assert entry["bandwidth"] == pytest.approx(gb_s * 1e9)
    assert entry["fp32"] == pytest.approx(fp32_tflops * 1e12)
    assert entry["tensor"] == pytest.approx(tensor_tflops * 1e12)
    assert entry["source"].startswith("https://")


def test_laptop_cpu_peaks_are_computed_from_its_specifications():
    flops, bandwidth = probe.laptop_cpu_peaks()
    assert flops == pytest.approx(8 * 3.3e9 * 32)  # 844.8 GFLOP/s
    assert bandwidth == pytest.approx(89.6e9)  # 2 channels x 8 bytes x 5600 MT/s
    assert probe.datasheet("Ryzen 7 7840U (laptop CPU)")["fp32"] == pytest.approx(844.8e9)
    with pytest.raises(KeyError, match="known"):
        probe.datasheet("H100")


def test_datasheet_rows_show_ridge_points():
    rows = {r["device"]: r for r in probe.datasheet_rows()}
    assert rows["H100 SXM"]["ridge 16-bit"] == "295"
    assert rows["A100 SXM 80GB"]["ridge FP32"] == "9.6"
    assert rows["Ryzen 7 7840U (laptop CPU)"]["ridge 16-bit"] == "-"


# --------------------------------------------------------------------------- the machine


def test_machine_info_describes_this_machine():
    info = probe.machine_info()
    assert 1 <= info["cores"] <= os.cpu_count()
    assert info["ram_bytes"] == psutil.virtual_memory().total > 2**28
    assert len(info["gpus"]) == (torch.cuda.device_count() if torch.cuda.is_available() else 0)
    assert isinstance(info["cpu_model"], str) and info["cpu_model"]
    assert probe.devices()[0] == "cpu"
    assert len(probe.devices()) == 1 + len(info["gpus"])


def test_time_op_measures_a_known_duration():
    seconds = probe.time_op(lambda: time.sleep(0.004), repeats=3)
    assert 0.004 <= seconds < 0.05
    calls = []
    probe.time_op(lambda: calls.append(1), repeats=3, min_sample_s=1e-3)
    assert len(calls) > 3 * 2, "a fast function is called many times per sample"
    durations = iter([0.001, 0.001, 0.001, 0.004, 0.001, 0.002])  # warm-up, probe, 4 samples
    best = probe.time_op(
        lambda: time.sleep(next(durations)), repeats=4, min_sample_s=1e-4, best=True
    )
    assert 0.001 <= best < 0.0018, "best keeps the shortest sample"


@pytest.mark.parametrize("device", probe.devices())
def test_measure_bandwidth_counts_read_and_write(device):
    result = probe.measure_bandwidth(32 * probe.MiB, device=device, repeats=3)
    assert result["bytes_moved"] == 2 * 32 * probe.MiB
    assert result["bandwidth"] == pytest.approx(result["bytes_moved"] / result["seconds"])
    assert 1e8 < result["bandwidth"] < 1e14, "between 0.1 GB/s and 100 TB/s"


@pytest.mark.parametrize("device", probe.devices())
def test_measure_matmul_flops_counts_2n_cubed(device):
    result = probe.measure_matmul_flops(256, device=device, repeats=3)
    assert result["flops"] == 2 * 256**3
    assert result["dtype"] == "float32"
    assert 1e8 < result["flop_per_s"] < 1e16
    bf16 = probe.measure_matmul_flops(128, dtype=torch.bfloat16, device=device, repeats=3)
    assert bf16["dtype"] == "bfloat16" and bf16["flop_per_s"] > 0


def test_measured_kernels_sit_under_the_measured_roof():
    bandwidth = probe.measure_bandwidth(64 * probe.MiB, repeats=3)["bandwidth"]
    peak = probe.measure_matmul_flops(512, repeats=3)["flop_per_s"]
    add = probe.measure_kernel("add", numel=2**22, repeats=3)
    assert add["intensity"] == pytest.approx(1 / 12)
    # an addition is memory-bound: it streams at a rate comparable to a copy's
    assert 0.2 < add["bandwidth"] / bandwidth < 3
    small = probe.measure_kernel("matmul", m=32, k=32, n=32, repeats=3)
    assert small["flops"] == 2 * 32**3
    for kernel in (add, small):
        assert kernel["flop_per_s"] < 3 * probe.roofline(peak, bandwidth, kernel["intensity"])
    copy = probe.measure_kernel("copy", numel=2**20, repeats=3)
    assert copy["flop_per_s"] == 0 and copy["bytes"] == 8 * 2**20


def test_shared_copy_bandwidth_measures_every_rank_alone_and_together():
    results = launch(
        probe.shared_copy_bandwidth, 2, kwargs={"nbytes": 16 * probe.MiB, "rounds": 3}, timeout=120
    )
    assert [r["rank"] for r in results] == [0, 1]
    assert all(r["alone"] > 1e8 and r["together"] > 1e8 for r in results)


# --------------------------------------------------------------------------- checkers, figures


def test_checkers_accept_the_reference_and_reject_common_mistakes():
    probe.check_roofline(probe.roofline)
    probe.check_min_tokens(probe.min_tokens_compute_bound)
    probe.check_predicted_seconds(probe.predicted_seconds)
    with pytest.raises(AssertionError, match="compute roof caps"):
        probe.check_roofline(lambda peak, bw, intensity: bw * intensity)
    with pytest.raises(AssertionError, match="take the longer"):
        probe.check_predicted_seconds(lambda f, b, peak, bw: f / peak + b / bw)
    with pytest.raises(AssertionError):
        probe.check_min_tokens(
            lambda d_in, d_out, peak, bw, s: math.ceil(peak / bw)  # the ridge, not tokens
        )


def test_figures_draw_one_roof_per_device():
    fig = probe.datasheet_rooflines()
    left, right = fig.axes
    assert len(left.get_legend().get_texts()) == len(probe.DATASHEETS)
    assert len(right.get_legend().get_texts()) == len(probe.DATASHEETS) - 1  # no CPU tensor
    fig = probe.memory_hierarchy()
    assert [len(ax.patches) for ax in fig.axes] == [len(v) for v in probe.HIERARCHY.values()]
