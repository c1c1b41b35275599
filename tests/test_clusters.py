"""Lab 5's pieces: the ping-pong and the alpha-beta fit (comm), datasheet numbers
(hardware), the lab's helpers and the exercises' checkers (clusters).

The ping-pong runs on real ranks; everything else is arithmetic, checked against numbers
worked out by hand.
"""

from __future__ import annotations

import math

import matplotlib
import numpy as np
import pytest

from labsupport import clusters, comm, hardware, launch, launcher

matplotlib.use("Agg")

# --------------------------------------------------------------------------- comm


def test_fit_alpha_beta_recovers_known_alpha_and_beta_exactly():
    alpha, beta = 25e-6, 1 / 12.5e9  # 25 µs, 12.5 GB/s
    sizes = [4**k for k in range(1, 13)]
    seconds = [alpha + beta * n for n in sizes]
    got_alpha, got_beta = comm.fit_alpha_beta(sizes, seconds)
    assert got_alpha == pytest.approx(alpha, rel=1e-9)
    assert got_beta == pytest.approx(beta, rel=1e-9)
    # two points determine the line
    assert comm.fit_alpha_beta([0, 1000], [1e-3, 2e-3]) == pytest.approx((1e-3, 1e-6), rel=1e-9)


def test_fit_alpha_beta_weighs_relative_errors():
    """One 10x outlier among small messages must not drag alpha far (weights 1/t)."""
    alpha, beta = 50e-6, 1 / 3e9
    sizes = [4**k for k in range(1, 13)]
    seconds = [alpha + beta * n for n in sizes]
    seconds[1] *= 10
    got_alpha, got_beta = comm.fit_alpha_beta(sizes, seconds)
    assert 0.5 * alpha < got_alpha < 2 * alpha
    assert 0.5 * beta < got_beta < 2 * beta


@pytest.mark.parametrize(
    ("nbytes", "seconds", "message"),
    [
        ([4, 8], [1e-5], "equally long"),
        ([4], [1e-5], "at least 2 points"),
        ([[4, 8]], [[1e-5, 2e-5]], "equally long"),
        ([4, 8], [1e-5, 0.0], "positive"),
        ([4, 8], [1e-5, -1e-5], "positive"),
        ([-4, 8], [1e-5, 2e-5], "positive"),
        ([8, 8], [1e-5, 2e-5], "2 distinct sizes"),
    ],
)
def test_fit_alpha_beta_rejects_bad_input_clearly(nbytes, seconds, message):
    with pytest.raises(ValueError, match=message):
        comm.fit_alpha_beta(nbytes, seconds)


SIZES = (4, 1024, 16 * 2**20)


@pytest.mark.parametrize("world_size", [2, 3])
def test_measure_p2p_returns_sizes_in_order_on_rank_zero_only(world_size):
    results = launch(
        comm.measure_p2p,
        world_size,
        kwargs={"sizes": SIZES, "rounds": 5, "warmup": 5},
        timeout=120,
    )
    first, *others = results
    assert others == [None] * (world_size - 1)
    assert [r["bytes"] for r in first] == list(SIZES)
    times = [r["seconds"] for r in first]
    assert all(t > 0 for t in times)
    assert times[-1] > times[0], f"16 MiB should take longer than 4 B: {times}"


def test_measure_p2p_rejects_one_rank_and_odd_sizes():
    with pytest.raises(launcher.LaunchError, match="at least 2 ranks"):
        launch(comm.measure_p2p, 1, timeout=60)
    with pytest.raises(launcher.LaunchError, match="multiples of 4 bytes"):
        launch(comm.measure_p2p, 2, kwargs={"sizes": (4, 6)}, timeout=60)


# --------------------------------------------------------------------------- hardware


def test_datasheet_units_convert_to_bytes_per_second_per_direction():
    assert hardware.per_direction(400, "Gb/s") == 50e9
    assert hardware.per_direction(900, "GB/s bidirectional") == 450e9
    assert hardware.per_direction(50, "GB/s") == 50e9
    with pytest.raises(ValueError, match="unknown unit"):
        hardware.per_direction(400, "Gbps")


@pytest.mark.parametrize(
    ("name", "gb_per_s"),
    [
        ("PCIe 3.0 x16", 15.754),  # 16 x 8 GT/s x 128/130 / 8
        ("PCIe 4.0 x16", 31.508),
        ("PCIe 5.0 x16", 63.015),
        ("PCIe 6.0 x16", 128.0),  # raw 64 GT/s
        ("NVLink 2 (V100)", 150.0),  # 300 GB/s bidirectional
        ("NVLink 3 (A100)", 300.0),
        ("NVLink 4 (H100)", 450.0),
        ("NVLink 5 (B200)", 900.0),
        ("InfiniBand EDR", 12.5),  # 100 Gb/s
        ("InfiniBand HDR", 25.0),
        ("InfiniBand NDR", 50.0),
        ("InfiniBand XDR", 100.0),
        ("RoCE 400 GbE", 50.0),
    ],
)
def test_links_hold_per_direction_bandwidth(name, gb_per_s):
    assert hardware.link(name)["gb_per_s"] == pytest.approx(gb_per_s, abs=5e-4)
    assert hardware.beta(name) == pytest.approx(1 / (gb_per_s * 1e9), rel=1e-4)


def test_every_link_cites_its_source_and_invents_no_latency():
    assert len(hardware.LINKS) == 13
    for name, entry in hardware.LINKS.items():
        assert entry["name"] == name
        assert entry["source"].startswith("https://"), name
        assert entry["latency_s"] is None, name
        assert entry["datasheet"], name
    with pytest.raises(KeyError, match="known links"):
        hardware.link("NVLink 9")


# --------------------------------------------------------------------------- clusters


def test_human_bytes_uses_decimal_and_binary_units_where_exact():
    cases = {4: "4 B", 1024: "1 KiB", 2**20: "1 MiB", 25 * 2**20: "25 MiB", 10**9: "1 GB",
             350 * 10**9: "350 GB", 128_000: "128 kB", 999: "999 B"}  # fmt: skip
    assert {n: clusters.human_bytes(n) for n in cases} == cases


def test_half_bandwidth_size_is_where_effective_bandwidth_is_half_the_peak():
    alpha, beta = 5e-6, 1 / 50e9
    n = clusters.half_bandwidth_size(alpha, beta)
    assert n == pytest.approx(250e3)
    assert n / float(comm.p2p_time(n, alpha, beta)) == pytest.approx(0.5 / beta)


def test_p2p_rows_report_time_bandwidth_and_model_ratio():
    results = [{"bytes": 4, "seconds": 50e-6}, {"bytes": 2**20, "seconds": 400e-6}]
    plain = clusters.p2p_rows(results)
    assert plain[1] == {"size": "1 MiB", "time (µs)": "400.0", "bandwidth (GB/s)": "2.621"}
    modelled = clusters.p2p_rows(results, alpha=50e-6, beta=1 / 2.9959e9)
    assert modelled[0]["model (µs)"] == "50.0" and modelled[0]["measured / model"] == "1.00"
    assert modelled[1]["measured / model"] == "1.00"


def test_plot_fit_draws_measurements_and_model_on_log_axes():
    results = [{"bytes": 4**k, "seconds": 50e-6 + 4**k / 3e9} for k in range(1, 13)]
    ax = clusters.plot_fit(results, 50e-6, 1 / 3e9)
    assert ax.get_xscale() == "log" and ax.get_yscale() == "log"
    (measured,) = [line for line in ax.lines if line.get_marker() == "o"]
    assert list(measured.get_xdata()) == [r["bytes"] for r in results]
    assert len(ax.lines) == 5  # model, two asymptotes, measured, and n½ (150 kB here)
    assert [line.get_xdata()[0] for line in ax.lines if line.get_linestyle() == "-"][-1] == (
        pytest.approx(150e3)
    )


def test_hierarchical_all_reduce_is_a_ring_inside_plus_a_ring_per_rail():
    a, nvlink, ndr = clusters.ASSUMED_ALPHA, hardware.beta("NVLink 4 (H100)"), 1 / 50e9
    got = clusters.hierarchical_all_reduce_time(10**9, 64, 8, a, nvlink, ndr)
    inside = 2 * 7 * a + 2 * 7 / 8 * 1e9 / 450e9
    across = 2 * 63 * a + 2 * 63 / 64 * (1e9 / 8) / 50e9
    assert float(got) == pytest.approx(inside + across, rel=1e-12)
    # one node: only the ring inside; one GPU per node: only the ring across
    assert float(clusters.hierarchical_all_reduce_time(10**9, 1, 8, a, nvlink, ndr)) == (
        pytest.approx(inside)
    )
    assert float(clusters.hierarchical_all_reduce_time(10**9, 16, 1, a, nvlink, ndr)) == (
        pytest.approx(float(comm.all_reduce_time("ring", 16, 10**9, a, ndr)))
    )
    flat = comm.all_reduce_time("ring", 512, 10**9, a, ndr)
    assert flat > 4 * got, "the rails should beat a flat ring through one NIC per node"


# --------------------------------------------------------------------------- exercises


def test_check_bytes_per_second_accepts_the_solution_and_explains_mistakes(capsys):
    clusters.check_bytes_per_second(hardware.per_direction)
    assert "Correct" in capsys.readouterr().out

    def bits_as_bytes(value, unit):
        return value * 1e9 / (2 if unit == "GB/s bidirectional" else 1)

    with pytest.raises(AssertionError, match="8 bits make a byte"):
        clusters.check_bytes_per_second(bits_as_bytes)

    def both_directions(value, unit):
        return value * 1e9 / (8 if unit == "Gb/s" else 1)

    with pytest.raises(AssertionError, match="counts both directions"):
        clusters.check_bytes_per_second(both_directions)

    def in_gigabytes(value, unit):
        return hardware.per_direction(value, unit) / 1e9

    with pytest.raises(AssertionError, match="not GB/s"):
        clusters.check_bytes_per_second(in_gigabytes)


def test_check_min_bucket_bytes_accepts_the_solution_and_rejects_mistakes(capsys):
    def solution(world_size, alpha, beta, latency_share):
        return world_size * alpha * (1 - latency_share) / (latency_share * beta)

    clusters.check_min_bucket_bytes(solution)
    assert "Correct" in capsys.readouterr().out
    assert solution(64, clusters.ASSUMED_ALPHA, 1 / 50e9, 0.1) == pytest.approx(144e6)

    def forgets_one_minus_f(world_size, alpha, beta, latency_share):
        return world_size * alpha / (latency_share * beta)

    with pytest.raises(AssertionError, match="latency part is"):
        clusters.check_min_bucket_bytes(forgets_one_minus_f)

    def negative(world_size, alpha, beta, latency_share):
        return -1.0

    with pytest.raises(AssertionError, match="must be positive"):
        clusters.check_min_bucket_bytes(negative)


def test_check_hierarchical_all_reduce_accepts_the_solution_and_rejects_mistakes(capsys):
    def solution(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        inside = comm.all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
        across = comm.all_reduce_time("ring", nodes, nbytes / gpus_per_node, alpha, beta_inter)
        return inside + across

    clusters.check_hierarchical_all_reduce(solution)
    assert "Correct" in capsys.readouterr().out

    def whole_tensor_across(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        inside = comm.all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
        return inside + comm.all_reduce_time("ring", nodes, nbytes, alpha, beta_inter)

    with pytest.raises(AssertionError, match="expected"):
        clusters.check_hierarchical_all_reduce(whole_tensor_across)


def test_the_lab_numbers_quoted_in_the_text_hold():
    """Lab 5 and chapter 5 quote these modelled numbers; keep them true."""
    a = clusters.ASSUMED_ALPHA
    nvlink, ndr = hardware.beta("NVLink 4 (H100)"), hardware.beta("InfiniBand NDR")
    one_gb_nvlink = float(comm.all_reduce_time("ring", 8, 10**9, a, nvlink))
    one_gb_ndr = float(comm.all_reduce_time("ring", 64, 10**9, a, ndr))
    assert one_gb_nvlink * 1e3 == pytest.approx(3.959, abs=5e-4)
    assert one_gb_ndr * 1e3 == pytest.approx(40.005, abs=5e-4)
    assert math.isclose(one_gb_ndr / one_gb_nvlink, 10.1, rel_tol=0.01)
    gpt3 = float(comm.all_reduce_time("ring", 8, 350 * 10**9, a, nvlink))
    assert 1.3 < gpt3 < 1.4
    latency = float(comm.all_reduce_time("ring", 64, 2**20, a, 0.0))
    assert latency / float(comm.all_reduce_time("ring", 64, 2**20, a, ndr)) > 0.9
    assert np.isclose(clusters.half_bandwidth_size(a, nvlink), 2.25e6)
