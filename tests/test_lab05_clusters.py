"""Lab 5, clusters: the ping-pong table, the numbers the lab and chapter 5 quote, and
the exercises' checkers (each accepts the solution and explains a common mistake)."""

from __future__ import annotations

import math

import numpy as np
import pytest

from labsupport.comm.cost import all_reduce_time, half_bandwidth_size
from labsupport.estimate import datasheets
from labsupport.labs import lab05_clusters


def test_p2p_rows_report_time_bandwidth_and_model_ratio():
    results = [{"bytes": 4, "seconds": 50e-6}, {"bytes": 2**20, "seconds": 400e-6}]
    plain = lab05_clusters.p2p_rows(results)
    assert plain[0] == {"size": "4 B", "time (µs)": "50.0", "bandwidth (GB/s)": "0.000"}
    assert plain[1] == {"size": "1 MiB", "time (µs)": "400.0", "bandwidth (GB/s)": "2.621"}
    modelled = lab05_clusters.p2p_rows(results, alpha=50e-6, beta=1 / 2.9959e9)
    assert modelled[0]["model (µs)"] == "50.0" and modelled[0]["measured / model"] == "1.00"
    assert modelled[1]["measured / model"] == "1.00"


def test_the_lab_numbers_quoted_in_the_text_hold():
    """Lab 5 and chapter 5 quote these modelled numbers; keep them true."""
    a = datasheets.ASSUMED_ALPHA
    nvlink, ndr = datasheets.beta("NVLink 4 (H100)"), datasheets.beta("InfiniBand NDR")
    one_gb_nvlink = float(all_reduce_time("ring", 8, 10**9, a, nvlink))
    one_gb_ndr = float(all_reduce_time("ring", 64, 10**9, a, ndr))
    assert one_gb_nvlink * 1e3 == pytest.approx(3.959, abs=5e-4)
    assert one_gb_ndr * 1e3 == pytest.approx(40.005, abs=5e-4)
    assert math.isclose(one_gb_ndr / one_gb_nvlink, 10.1, rel_tol=0.01)
    gpt3 = float(all_reduce_time("ring", 8, 350 * 10**9, a, nvlink))
    assert 1.3 < gpt3 < 1.4
    latency = float(all_reduce_time("ring", 64, 2**20, a, 0.0))
    assert latency / float(all_reduce_time("ring", 64, 2**20, a, ndr)) > 0.9
    assert np.isclose(half_bandwidth_size(a, nvlink), 2.25e6)


# --------------------------------------------------------------------------- exercises


def test_check_bytes_per_second_accepts_the_solution_and_explains_mistakes(capsys):
    lab05_clusters.check_bytes_per_second(datasheets.per_direction)
    assert "Correct" in capsys.readouterr().out

    def bits_as_bytes(value, unit):
        return value * 1e9 / (2 if unit == "GB/s bidirectional" else 1)

    with pytest.raises(AssertionError, match="8 bits make a byte"):
        lab05_clusters.check_bytes_per_second(bits_as_bytes)

    def both_directions(value, unit):
        return value * 1e9 / (8 if unit == "Gb/s" else 1)

    with pytest.raises(AssertionError, match="counts both directions"):
        lab05_clusters.check_bytes_per_second(both_directions)

    def in_gigabytes(value, unit):
        return datasheets.per_direction(value, unit) / 1e9

    with pytest.raises(AssertionError, match="not GB/s"):
        lab05_clusters.check_bytes_per_second(in_gigabytes)


def test_check_min_bucket_bytes_accepts_the_solution_and_rejects_mistakes(capsys):
    def solution(world_size, alpha, beta, latency_share):
        return world_size * alpha * (1 - latency_share) / (latency_share * beta)

    lab05_clusters.check_min_bucket_bytes(solution)
    assert "Correct" in capsys.readouterr().out
    assert solution(64, datasheets.ASSUMED_ALPHA, 1 / 50e9, 0.1) == pytest.approx(144e6)

    def forgets_one_minus_f(world_size, alpha, beta, latency_share):
        return world_size * alpha / (latency_share * beta)

    with pytest.raises(AssertionError, match="latency part is"):
        lab05_clusters.check_min_bucket_bytes(forgets_one_minus_f)

    def negative(world_size, alpha, beta, latency_share):
        return -1.0

    with pytest.raises(AssertionError, match="must be positive"):
        lab05_clusters.check_min_bucket_bytes(negative)


def test_check_hierarchical_all_reduce_accepts_the_solution_and_rejects_mistakes(capsys):
    def solution(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        inside = all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
        across = all_reduce_time("ring", nodes, nbytes / gpus_per_node, alpha, beta_inter)
        return inside + across

    lab05_clusters.check_hierarchical_all_reduce(solution)
    assert "Correct" in capsys.readouterr().out

    def whole_tensor_across(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        inside = all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
        return inside + all_reduce_time("ring", nodes, nbytes, alpha, beta_inter)

    with pytest.raises(AssertionError, match="expected"):
        lab05_clusters.check_hierarchical_all_reduce(whole_tensor_across)
