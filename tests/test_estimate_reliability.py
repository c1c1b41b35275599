"""labsupport.estimate.reliability: Llama 3's failure record as published, MTBF as the
cluster grows, and Young's and Daly's checkpoint intervals against their formulas and
against the models they optimize."""

from __future__ import annotations

import math

import pytest

from labsupport.estimate import reliability as rel

HOUR = 3600.0


def argmin(f, lo: float, hi: float) -> float:
    """The minimum of a unimodal ``f`` on [lo, hi], by golden-section search."""
    g = (math.sqrt(5) - 1) / 2
    for _ in range(200):
        a, b = hi - g * (hi - lo), lo + g * (hi - lo)
        lo, hi = (lo, b) if f(a) < f(b) else (a, hi)
    return (lo + hi) / 2


# --------------------------------------------------------------------------- Llama 3


def test_the_snapshot_adds_up_as_published():
    snap = rel.LLAMA3_SNAPSHOT
    assert (snap["days"], snap["gpus"], snap["interruptions"]) == (54, 16_384, 466)
    assert snap["planned"] + snap["unexpected"] == snap["interruptions"] == 466
    assert sum(count for _, _, count, _ in rel.LLAMA3_CAUSES) == snap["unexpected"] == 419
    assert len(rel.LLAMA3_CAUSES) == 18
    assert rel.by_category() == {
        "GPU": 268,
        "Dependency": 56,
        "Network": 35,
        "Unplanned Maintenance": 32,
        "Host": 21,
        "Unknown": 7,
    }


def test_the_printed_percentages_are_counts_over_419_except_the_first():
    rows = rel.percent_check()
    off = [r for r in rows if abs(r["printed %"] - r["count / total %"]) > 0.05]
    assert [(r["component"], r["printed %"], r["count / total %"]) for r in off] == [
        ("Faulty GPU", 30.1, 35.3)
    ]
    # the paper's "GPU issues ... 58.7%" is the sum of the printed GPU rows; by the
    # counts they are 268 / 419 = 64.0%
    printed_gpu = sum(p for _, cat, _, p in rel.LLAMA3_CAUSES if cat == "GPU")
    assert round(printed_gpu, 1) == 58.7
    assert rel.LLAMA3_SNAPSHOT["gpu_share_printed"] == pytest.approx(printed_gpu / 100)
    assert round(100 * 268 / 419, 1) == 64.0
    # the printed column adds up to 94.9, not 100: the first row lost 5.2 points
    assert round(sum(p for *_, p in rel.LLAMA3_CAUSES), 1) == 94.9


def test_mtbf_of_the_job_and_per_gpu():
    job = rel.mtbf(54 * 24 * HOUR, 419)
    assert job / HOUR == pytest.approx(3.093, abs=1e-3)  # "one failure every three hours"
    per_gpu = rel.device_mtbf(job, 16_384)
    assert per_gpu / (365 * 24 * HOUR) == pytest.approx(5.78, abs=0.01)  # years
    assert rel.job_mtbf(per_gpu, 16_384) == pytest.approx(job)
    with pytest.raises(ValueError, match="no failures"):
        rel.mtbf(HOUR, 0)


def test_mtbf_falls_as_one_over_the_number_of_devices():
    per_gpu = 50_000 * HOUR
    for n in (8, 1_024, 16_384, 100_000):
        assert rel.job_mtbf(per_gpu, 2 * n) == pytest.approx(rel.job_mtbf(per_gpu, n) / 2)
        assert rel.job_mtbf(per_gpu, n) * n == pytest.approx(per_gpu)
    # Llama 3's rate per GPU on 100,000 GPUs: about half an hour
    job = rel.mtbf(54 * 24 * HOUR, 419)
    assert rel.job_mtbf(rel.device_mtbf(job, 16_384), 100_000) / HOUR == pytest.approx(
        0.507, abs=1e-3
    )


def test_the_chance_of_a_day_without_a_failure():
    job = rel.mtbf(54 * 24 * HOUR, 419)
    assert rel.no_failure_probability(job, job) == pytest.approx(math.exp(-1))
    assert rel.no_failure_probability(0, job) == 1
    assert rel.no_failure_probability(24 * HOUR, job) == pytest.approx(4.3e-4, rel=0.01)


# --------------------------------------------------------------------------- BLOOM


def test_bloom_checkpoints_are_consistent_with_its_logs():
    bloom = rel.BLOOM_CHECKPOINTS
    # "176*10**9*14/2**30 = 2294.77GB"
    assert bloom["params"] * bloom["bytes_per_param"] / 2**30 == pytest.approx(2294.77, abs=0.01)
    # "we lost 7.3h of work, it failed 2 iterations before checkpoint saving time",
    # with a save every 250 iterations of about 105 s
    lost = (bloom["save_intervals"][0] - 2) * bloom["iteration_s"] / HOUR
    assert lost == pytest.approx(bloom["lost_hours"], abs=0.1)
    # "A checkpoint is saved in 40 secs, which is about 1/2 iteration duration"
    assert bloom["save_s"] / bloom["iteration_s"] == pytest.approx(0.4, abs=0.05)
    # "Every week or so ... one of the gpus dies": Llama 3's rate per GPU on BLOOM's 384
    # GPUs gives 5.5 days, the same order
    llama_per_gpu = rel.device_mtbf(rel.mtbf(54 * 24 * HOUR, 419), 16_384)
    days = rel.job_mtbf(llama_per_gpu, bloom["gpus"]) / (24 * HOUR)
    assert days == pytest.approx(5.5, abs=0.05)
    assert 0.5 < days / bloom["gpu_dies_every_days"] < 1


def test_chapter_numbers_bloom_at_its_own_failure_rate():
    """C = 40 s, a failure a week: Young's interval 1.9 h, 1.15% wasted; BLOOM's save
    every 100 iterations (2.9 h) wastes 1.25%, near the flat bottom."""
    bloom = rel.BLOOM_CHECKPOINTS
    m = bloom["gpu_dies_every_days"] * 24 * HOUR
    young = rel.young_interval(bloom["save_s"], m)
    assert young / HOUR == pytest.approx(1.93, abs=0.01)
    assert rel.wasted_fraction(young, bloom["save_s"], m) == pytest.approx(0.0115, abs=1e-4)
    theirs = 100 * bloom["iteration_s"]
    assert rel.wasted_fraction(theirs, bloom["save_s"], m) == pytest.approx(0.0125, abs=1e-4)


# --------------------------------------------------------------------------- Young


@pytest.mark.parametrize(("c", "m"), [(40.0, 11_130.0), (1.0, HOUR), (300.0, 24 * HOUR)])
def test_young_is_the_minimum_of_the_first_order_waste(c, m):
    young = rel.young_interval(c, m)
    assert young == pytest.approx(math.sqrt(2 * c * m))
    best = argmin(lambda t: rel.wasted_fraction(t, c, m), c / 10, m)
    assert best == pytest.approx(young, rel=1e-6)
    for factor in (0.5, 0.9, 1.1, 2.0):
        assert rel.wasted_fraction(factor * young, c, m) > rel.wasted_fraction(young, c, m)
    # at the optimum both terms are equal, and the waste is sqrt(2C/M)
    assert c / young == pytest.approx(young / (2 * m))
    assert rel.wasted_fraction(young, c, m) == pytest.approx(math.sqrt(2 * c / m))
    # a flat bottom: twice or half as often wastes (2 + 1/2) / 2 = 1.25 times as much
    for factor in (0.5, 2.0):
        ratio = rel.wasted_fraction(factor * young, c, m) / rel.wasted_fraction(young, c, m)
        assert ratio == pytest.approx(1.25)


def test_restarts_add_r_over_m_and_do_not_move_the_optimum():
    c, m, r = 40.0, 11_130.0, 600.0
    young = rel.young_interval(c, m)
    with_restart = rel.wasted_fraction(young, c, m, restart_s=r)
    assert with_restart - rel.wasted_fraction(young, c, m) == pytest.approx(r / m)
    assert argmin(lambda t: rel.wasted_fraction(t, c, m, r), 1, m) == pytest.approx(young)


def test_chapter_numbers_bloom_save_at_llama_3_rate():
    job = rel.mtbf(54 * 24 * HOUR, 419)
    young = rel.young_interval(40, job)
    assert young / 60 == pytest.approx(15.7, abs=0.1)  # minutes
    assert rel.wasted_fraction(young, 40, job) == pytest.approx(0.085, abs=0.001)


# --------------------------------------------------------------------------- Daly


def test_daly_formula():
    c, m = 40.0, 11_130.0
    x = c / (2 * m)
    want = math.sqrt(2 * c * m) * (1 + math.sqrt(x) / 3 + x / 9) - c
    assert rel.daly_interval(c, m) == pytest.approx(want)
    assert rel.daly_interval(3 * m, m) == m  # C >= 2M: checkpoint every M
    assert rel.daly_interval(2 * m, m) == m


@pytest.mark.parametrize(("m_min", "tau_min"), [(24 * 60, 117), (6 * 60, 57), (15, 9.1)])
def test_daly_reproduces_the_papers_examples(m_min, tau_min):
    """Daly (2006), figures 3 to 5: dump time 5 min, R = 10 min, M = 24 h, 6 h, 15 min:
    "The new model predicts τopt = 117 min", 57 min, 9.1 min."""
    got = rel.daly_interval(5 * 60, m_min * 60) / 60
    assert round(got, 0 if tau_min > 10 else 1) == tau_min


@pytest.mark.parametrize("ratio", [1e-4, 1e-3, 1e-2, 0.1, 1 / 3])
def test_daly_is_the_optimum_of_the_complete_model_and_young_drifts(ratio):
    m = 10 * HOUR
    c = ratio * m
    exact = argmin(lambda t: rel.expected_wall_time(1.0, t, c, m, restart_s=600), c / 100, 3 * m)
    daly, young = rel.daly_interval(c, m), rel.young_interval(c, m)
    assert daly == pytest.approx(exact, rel=5e-3)
    assert abs(daly - exact) <= abs(young - exact)
    # Young's is too long as C grows: with x = C/2M and C = √x·√(2CM), Daly's is
    # √(2CM)·(1 − 2√x/3 + x/9), so Young's is 1/(1 − 2√x/3 + x/9) of it (5% at C = M/100)
    x = ratio / 2
    assert young / exact - 1 == pytest.approx(1 / (1 - 2 * math.sqrt(x) / 3 + x / 9) - 1, rel=0.02)


def test_the_complete_model_agrees_with_the_first_order_waste_for_short_checkpoints():
    c, m = 1.0, 10 * HOUR
    for tau in (60.0, rel.young_interval(c, m), 600.0):
        overhead = rel.expected_wall_time(1.0, tau, c, m) - 1
        assert overhead == pytest.approx(rel.wasted_fraction(tau, c, m), rel=0.01)
    # and drifts above it as τ nears M: the failures' second order, (τ/M)² terms
    assert rel.expected_wall_time(1.0, 3_600.0, c, m) - 1 > rel.wasted_fraction(3_600.0, c, m)
    # no failures at all (M -> infinity): only the checkpoints cost, C per τ
    assert rel.expected_wall_time(1.0, 100.0, 1.0, 1e12) == pytest.approx(1.01)
