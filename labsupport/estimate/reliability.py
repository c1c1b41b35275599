"""Failures in long runs, and how often to checkpoint (chapter 16).

* :data:`LLAMA3_SNAPSHOT` and :data:`LLAMA3_CAUSES`: the interruptions of a 54-day snapshot
  of Llama 3 405B pre-training on up to 16,384 H100 GPUs (Grattafiori et al. 2024, "The
  Llama 3 Herd of Models", arXiv:2407.21783, section 3.3.4 and Table 5), as published; the
  paper does not say how many GPUs the job held during the snapshot (one stage used 8,192,
  its Table 4), so an MTBF per GPU from 16,384 of them is an upper bound;
  :data:`BLOOM_CHECKPOINTS`: BLOOM-176B's checkpoints, from its training logs;
* :func:`mtbf`, :func:`job_mtbf`, :func:`device_mtbf`, :func:`no_failure_probability`:
  mean time between failures. If each of ``n`` devices fails independently, at a constant
  rate, the job stops at ``n`` times the rate of one device: ``MTBF_job = MTBF_device / n``;
* :func:`wasted_fraction`, :func:`young_interval`: checkpointing every ``τ`` seconds of
  work costs ``C`` per checkpoint, and each failure loses on average half a segment plus
  the restart ``R``. To first order the fraction of time wasted is
  ``C/τ + τ/(2M) + R/M``, least at ``τ = √(2·C·M)`` (Young 1974, "A first order
  approximation to the optimum checkpoint interval", CACM 17(9));
* :func:`expected_wall_time`, :func:`daly_interval`: Daly's complete model of the run
  time with exponentially distributed failures, and his higher-order estimate of its
  optimum, for checkpoints that are not short next to ``M`` (Daly 2006, "A higher order
  estimate of the optimum checkpoint interval for restart dumps", Future Generation
  Computer Systems 22(3), 303-312).

Times are in seconds unless a name says otherwise.
"""

from __future__ import annotations

import math

#: Llama 3 405B pre-training, a 54-day snapshot (section 3.3.4 of the paper; the checkpoint
#: sizes are from section 3.3.1). ``gpus`` is the most the job used, "up to 16K".
LLAMA3_SNAPSHOT = {
    "days": 54,
    "gpus": 16_384,
    "interruptions": 466,
    "planned": 47,  # automated maintenance (firmware), operator-initiated (configuration, data)
    "unexpected": 419,
    "hardware_share": 0.78,  # "approximately 78%": confirmed or suspected hardware issues
    "gpu_share_printed": 0.587,  # "GPU issues ... 58.7%": the sum of Table 5's GPU rows
    "manual_interventions": 3,
    "effective_training_time": 0.90,  # "higher than 90%"
    "checkpoint_bytes_per_gpu": (1e6, 4e9),  # "ranging from 1 MB to 4 GB per GPU"
    "source": "https://arxiv.org/abs/2407.21783",
}

#: Table 5 of the paper, as printed: (component, category, interruptions, % printed).
#: The counts add up to 419. The printed percentages are counts / 419, except the first
#: row's: 148 / 419 is 35.3%, not 30.1% (see :func:`percent_check`).
LLAMA3_CAUSES = [
    ("Faulty GPU", "GPU", 148, 30.1),
    ("GPU HBM3 Memory", "GPU", 72, 17.2),
    ("Software Bug", "Dependency", 54, 12.9),
    ("Network Switch/Cable", "Network", 35, 8.4),
    ("Host Maintenance", "Unplanned Maintenance", 32, 7.6),
    ("GPU SRAM Memory", "GPU", 19, 4.5),
    ("GPU System Processor", "GPU", 17, 4.1),
    ("NIC", "Host", 7, 1.7),
    ("NCCL Watchdog Timeouts", "Unknown", 7, 1.7),
    ("Silent Data Corruption", "GPU", 6, 1.4),
    ("GPU Thermal Interface + Sensor", "GPU", 6, 1.4),
    ("SSD", "Host", 3, 0.7),
    ("Power Supply", "Host", 3, 0.7),
    ("Server Chassis", "Host", 2, 0.5),
    ("IO Expansion Board", "Host", 2, 0.5),
    ("Dependency", "Dependency", 2, 0.5),
    ("CPU", "Host", 2, 0.5),
    ("System Memory", "Host", 2, 0.5),
]

#: BLOOM-176B on 384 A100s (BigScience's tr11-176B-ml training logs: README and
#: chronicles): a full checkpoint of 14 bytes per parameter (bf16 and fp32 weights, fp32
#: Adam states), saved in about 40 s, every 250, then 200, then 100 iterations of about
#: 105 s. A GPU crash two iterations before a save cost 7.3 hours of work; later, "every
#: week or so ... one of the gpus dies".
BLOOM_CHECKPOINTS = {
    "params": 176e9,
    "bytes_per_param": 14,
    "gpus": 384,
    "save_s": 40,
    "iteration_s": 105,
    "save_intervals": (250, 200, 100),
    "lost_hours": 7.3,
    "gpu_dies_every_days": 7,
    "source": "https://github.com/bigscience-workshop/bigscience/blob/master/"
    "train/tr11-176B-ml/chronicles.md",
}


def percent_check(causes=LLAMA3_CAUSES) -> list[dict]:
    """Each row's printed percentage next to its count's share of the total."""
    total = sum(count for _, _, count, _ in causes)
    return [
        {"component": c, "count": n, "printed %": p, "count / total %": round(100 * n / total, 1)}
        for c, _, n, p in causes
    ]


def by_category(causes=LLAMA3_CAUSES) -> dict:
    """Interruptions per category (GPU, Host, Network, ...), largest first."""
    totals: dict[str, int] = {}
    for _, category, count, _ in causes:
        totals[category] = totals.get(category, 0) + count
    return dict(sorted(totals.items(), key=lambda kv: -kv[1]))


def mtbf(period_s: float, failures: int) -> float:
    """Mean time between failures over an observed ``period_s`` with ``failures``."""
    if failures <= 0:
        raise ValueError("no failures observed: the MTBF is only bounded below by the period")
    return period_s / failures


def job_mtbf(device_mtbf_s: float, devices: int) -> float:
    """MTBF of a job that stops when any of ``devices`` independent devices fails."""
    return device_mtbf_s / devices


def device_mtbf(job_mtbf_s: float, devices: int) -> float:
    """The MTBF per device implied by a job's MTBF on ``devices`` devices."""
    return job_mtbf_s * devices


def no_failure_probability(duration_s: float, mtbf_s: float) -> float:
    """The chance that a job runs ``duration_s`` without a failure, when failures come
    at a constant rate (a Poisson process): ``exp(-t/M)``."""
    return math.exp(-duration_s / mtbf_s)


def wasted_fraction(interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s=0.0):
    """First-order fraction of time not spent on useful work: writing checkpoints
    (``C/τ``), redoing the half segment a failure loses on average (``τ/(2M)``), and
    restarting (``R/M``). Valid while ``τ`` and ``C`` are small next to ``M``."""
    return checkpoint_s / interval_s + interval_s / (2 * mtbf_s) + restart_s / mtbf_s


def young_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Young's optimum: the ``τ`` that minimizes :func:`wasted_fraction`, ``√(2·C·M)``."""
    return math.sqrt(2 * checkpoint_s * mtbf_s)


def expected_wall_time(
    solve_s: float, interval_s: float, checkpoint_s: float, mtbf_s: float, restart_s=0.0
) -> float:
    """Daly's complete model: the expected wall-clock time of a run of ``solve_s``
    seconds of work, checkpointed every ``interval_s`` of work, with failures at
    exponentially distributed times of mean ``mtbf_s``:
    ``M·e^(R/M)·(e^((τ+C)/M) − 1)·T_s/τ``. Each segment of work and its checkpoint must
    run ``τ + C`` without a failure; each failure costs the time since the last
    checkpoint and a restart ``R`` (which may itself fail)."""
    m, tau = mtbf_s, interval_s
    return m * math.exp(restart_s / m) * math.expm1((tau + checkpoint_s) / m) * solve_s / tau


def daly_interval(checkpoint_s: float, mtbf_s: float) -> float:
    """Daly's higher-order optimum of :func:`expected_wall_time`: for ``C < 2M``,
    ``√(2CM)·[1 + ⅓·√(C/2M) + ⅑·(C/2M)] − C``, and ``M`` otherwise."""
    if checkpoint_s >= 2 * mtbf_s:
        return mtbf_s
    x = checkpoint_s / (2 * mtbf_s)
    return math.sqrt(2 * checkpoint_s * mtbf_s) * (1 + math.sqrt(x) / 3 + x / 9) - checkpoint_s
