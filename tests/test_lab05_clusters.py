"""Lab 5, clusters: the ping-pong table, the numbers the lab and chapter 5 quote, and
the exercises' checkers (each accepts the solution and explains a common mistake)."""

from __future__ import annotations

import math

import numpy as np
import pytest
from notebook_solutions import solution, stub

from labsupport.comm.cost import all_reduce_time, half_bandwidth_size, hierarchical_all_reduce_time
from labsupport.estimate import datasheets
from labsupport.labs import lab05_clusters

LAB = "05-clusters.ipynb"


def accepted_solution(check, name, capsys):
    """The notebook's worked solution of ``name``, which ``check`` must accept."""
    fn = solution(LAB, name)
    assert check(fn)
    assert capsys.readouterr().out.startswith("Correct:")
    return fn


def assert_not_attempted(check, name, capsys):
    """The lab's stub is not an answer: the checker says so and returns False."""
    capsys.readouterr()
    assert not check(stub(name))
    assert capsys.readouterr().out.startswith("Not attempted yet")


def test_p2p_rows_report_time_bandwidth_and_model_ratio():
    results = [{"bytes": 4, "seconds": 50e-6}, {"bytes": 2**20, "seconds": 400e-6}]
    plain = lab05_clusters.p2p_rows(results)
    assert plain[0] == {"size": "4 B", "time (µs)": "50.0", "bandwidth (GB/s)": "0.000"}
    assert plain[1] == {"size": "1 MiB", "time (µs)": "400.0", "bandwidth (GB/s)": "2.621"}
    modelled = lab05_clusters.p2p_rows(results, alpha=50e-6, beta=1 / 2.9959e9)
    assert modelled[0]["model (µs)"] == "50.0" and modelled[0]["measured / model"] == "1.00"
    assert modelled[1]["measured / model"] == "1.00"


def test_link_rows_quote_the_datasheet_and_give_one_direction():
    rows = {r["link"]: r for r in lab05_clusters.link_rows()}
    assert list(rows) == list(datasheets.LINKS)
    assert rows["NVLink 4 (H100)"]["GB/s per direction"] == "450.0"
    assert rows["InfiniBand NDR"]["GB/s per direction"] == "50.0"
    assert rows["PCIe 4.0 x16"]["GB/s per direction"] == "31.5"
    assert "bidirectional" in rows["NVLink 4 (H100)"]["datasheet says"]


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
    fn = accepted_solution(lab05_clusters.check_bytes_per_second, "bytes_per_second", capsys)

    def bits_as_bytes(value, unit):
        return value * 1e9 / (2 if unit == "GB/s bidirectional" else 1)

    with pytest.raises(AssertionError, match="8 bits make a byte"):
        lab05_clusters.check_bytes_per_second(bits_as_bytes)

    def both_directions(value, unit):
        return value * 1e9 / (8 if unit == "Gb/s" else 1)

    with pytest.raises(AssertionError, match="counts both directions"):
        lab05_clusters.check_bytes_per_second(both_directions)

    def in_gigabytes(value, unit):
        return fn(value, unit) / 1e9

    with pytest.raises(AssertionError, match="not GB/s"):
        lab05_clusters.check_bytes_per_second(in_gigabytes)

    def halves_ports_too(value, unit):
        return value * 1e9 / (16 if unit == "Gb/s" else 2 if "bidirectional" in unit else 1)

    with pytest.raises(AssertionError, match="already per direction"):
        lab05_clusters.check_bytes_per_second(halves_ports_too)

    assert_not_attempted(lab05_clusters.check_bytes_per_second, "bytes_per_second", capsys)


def test_check_min_bucket_bytes_accepts_the_solution_and_rejects_mistakes(capsys):
    fn = accepted_solution(lab05_clusters.check_min_bucket_bytes, "min_bucket_bytes", capsys)
    # the number the worked solution quotes for the 64-node NDR cluster
    assert fn(64, datasheets.ASSUMED_ALPHA, datasheets.beta("InfiniBand NDR"), 0.1) == (
        pytest.approx(144e6)
    )

    def forgets_one_minus_f(world_size, alpha, beta, latency_share):
        return world_size * alpha / (latency_share * beta)

    with pytest.raises(AssertionError, match="latency part is"):
        lab05_clusters.check_min_bucket_bytes(forgets_one_minus_f)

    def forgets_the_world_size(world_size, alpha, beta, latency_share):
        return alpha * (1 - latency_share) / (latency_share * beta)

    with pytest.raises(AssertionError, match="latency part is"):
        lab05_clusters.check_min_bucket_bytes(forgets_the_world_size)

    def negative(world_size, alpha, beta, latency_share):
        return -1.0

    with pytest.raises(AssertionError, match="must be positive"):
        lab05_clusters.check_min_bucket_bytes(negative)

    assert_not_attempted(lab05_clusters.check_min_bucket_bytes, "min_bucket_bytes", capsys)


def test_check_hierarchical_all_reduce_accepts_the_solution_and_rejects_mistakes(capsys):
    fn = accepted_solution(
        lab05_clusters.check_hierarchical_all_reduce, "two_level_all_reduce_time", capsys
    )

    def whole_tensor_across(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        inside = all_reduce_time("ring", gpus_per_node, nbytes, alpha, beta_intra)
        return inside + all_reduce_time("ring", nodes, nbytes, alpha, beta_inter)

    with pytest.raises(AssertionError, match="one shard"):
        lab05_clusters.check_hierarchical_all_reduce(whole_tensor_across)

    def flat_ring(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        return all_reduce_time("ring", nodes * gpus_per_node, nbytes, alpha, beta_inter)

    with pytest.raises(AssertionError, match="1022 latencies .*flat ring through all 512"):
        lab05_clusters.check_hierarchical_all_reduce(flat_ring)

    def one_ring_per_nic(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        share = nbytes / gpus_per_node
        return all_reduce_time("ring", nodes * gpus_per_node, share, alpha, beta_inter)

    with pytest.raises(AssertionError, match="flat ring through all 512"):
        lab05_clusters.check_hierarchical_all_reduce(one_ring_per_nic)

    def swapped_links(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        return fn(nbytes, nodes, gpus_per_node, alpha, beta_inter, beta_intra)

    with pytest.raises(AssertionError, match="NVLink carries"):
        lab05_clusters.check_hierarchical_all_reduce(swapped_links)

    def across_only(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        return all_reduce_time("ring", nodes, nbytes / gpus_per_node, alpha, beta_inter)

    with pytest.raises(AssertionError, match="126 latencies .*add up"):
        lab05_clusters.check_hierarchical_all_reduce(across_only)

    def one_latency_per_phase(nbytes, nodes, gpus_per_node, alpha, beta_intra, beta_inter):
        return fn(nbytes, nodes, gpus_per_node, 0.0, beta_intra, beta_inter) + 3 * alpha

    with pytest.raises(AssertionError, match="3 latencies .*count the steps"):
        lab05_clusters.check_hierarchical_all_reduce(one_latency_per_phase)

    assert_not_attempted(
        lab05_clusters.check_hierarchical_all_reduce, "two_level_all_reduce_time", capsys
    )


def test_the_two_level_numbers_quoted_in_lab_5_hold():
    """Lab 5 and chapter 5 compare the two-level all-reduce on 64 nodes x 8 GPUs with a
    flat ring run as 8 rings at once, one per NIC, each with 1/8 of the data."""
    a = datasheets.ASSUMED_ALPHA
    nvlink, ndr = datasheets.beta("NVLink 4 (H100)"), datasheets.beta("InfiniBand NDR")

    def flat(size):
        return float(all_reduce_time("ring", 512, size / 8, a, ndr)) * 1e3

    def two_level(size):
        return float(hierarchical_all_reduce_time(size, 64, 8, a, nvlink, ndr)) * 1e3

    # the latencies alone: 2 x 511 steps against 2 x 7 + 2 x 63
    assert flat(0) == pytest.approx(5.110) and two_level(0) == pytest.approx(0.700)
    quoted = {  # size: (flat ms, two-level ms), as the lab prints them
        2**20: (5.115, 0.709),
        25 * 2**20: (5.241, 0.931),
        10**9: (10.100, 9.511),
        350 * 10**9: (1751.692, 3084.467),
    }
    for size, (flat_ms, two_level_ms) in quoted.items():
        assert flat(size) == pytest.approx(flat_ms, abs=5e-4)
        assert two_level(size) == pytest.approx(two_level_ms, abs=5e-4)
    # each GPU's NVLink carries 7 of the 8 flat rings' hops inside the node: 3.9 ms per
    # GB at 450 GB/s, below the 5 ms per GB of its NIC, so the NIC sets the pace
    nvlink_per_gb = 7 / 8 * 2 * 511 / 512 * 1e9 * nvlink * 1e3
    nic_per_gb = 2 * 511 / 512 * 1e9 / 8 * ndr * 1e3
    assert nvlink_per_gb == pytest.approx(3.88, abs=0.01) and nic_per_gb == pytest.approx(
        4.99, abs=0.01
    )
