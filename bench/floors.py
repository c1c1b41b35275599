"""The floors the benches hold their figures against: what the machine allows, computed
from what the same run measured. Pure functions; :mod:`bench.report` prints them.

* all-reduce on one machine: every byte a rank sends over loopback is at least copied
  from its memory into the receiver's, and a bandwidth-optimal ring sends ``2(N-1)/N`` of
  the tensor (:func:`labsupport.comm.cost.ring_all_reduce_bytes`): at the rate the ranks
  copy their own tensors, all at once, that takes ``2(N-1)/N`` of one copy's time;
* DDP: chapter 10's overlap limit, :func:`labsupport.estimate.overlap.overlap_schedule`
  (backward produces the buckets, each all-reduce costs ``a + b * bytes``, the last
  bucket never hides), then the optimizer's step;
* a pipeline: lab 11's model, the schedule played by
  :func:`labsupport.parallel.simulator.simulate` with each stage's measured forward and
  backward times and free messages;
* ranks that compute and communicate (context and expert parallelism): the same ranks
  computing their own shares with the messages taken away, timed in turns with the step
  in the same launch (:func:`bench.context_parallel.local_ring`,
  :class:`bench.expert_parallel.LocalExperts`, paired by
  :func:`bench.report.against_floor`). Load on the machine lands on both alike, so no
  load lets the step beat it, as it could beat one process's time spread over the
  ranks' cores: a busy machine gives several processes a larger share of its cores than
  one;
* ZeRO's traffic: the paper's ``2 Psi`` (stages 1 and 2: reduce-scatter the gradients,
  all-gather the weights) or ``3 Psi`` (stage 3: weights gathered twice) of each rank's
  ``(N-1)/N`` share, Rajbhandari et al. 2020, section 7.
"""

from __future__ import annotations

from labsupport.comm.cost import ring_all_reduce_bytes
from labsupport.estimate.overlap import overlap_schedule
from labsupport.parallel import schedules, simulator


def ring_floor_seconds(nbytes: int, world: int, copy_seconds: float) -> float:
    """An all-reduce of ``nbytes`` on ``world`` ranks of one machine can take no less than
    copying its ring's ``2(N-1)/N`` share, when copying ``nbytes`` takes ``copy_seconds``
    (each rank copying its own tensor, all at the same time)."""
    if nbytes <= 0 or copy_seconds <= 0:
        raise ValueError("the bytes and the copy's seconds must be positive")
    return float(ring_all_reduce_bytes(nbytes, world)) / nbytes * copy_seconds


def ddp_floor_seconds(
    bucket_bytes: list[int],
    forward_s: float,
    backward_s: float,
    optimizer_s: float,
    a: float,
    b: float,
) -> float:
    """A DDP step of one rank's compute (forward, backward, optimizer step) whose buckets
    are all-reduced at ``a + b * bytes`` each, overlapped with backward as chapter 10's
    model allows: at least the compute plus the last bucket's all-reduce."""
    if not bucket_bytes:
        raise ValueError("a DDP step has at least one bucket")
    return overlap_schedule(bucket_bytes, forward_s, backward_s, a, b)[1] + optimizer_s


def pipeline_floor_seconds(microbatches: int, forward_s: list, backward_s: list) -> float:
    """1F1B on ``len(forward_s)`` stages, stage ``s``'s forward taking ``forward_s[s]`` and
    its backward ``backward_s[s]`` seconds, messages free: the simulated step's span."""
    p = len(forward_s)
    if p != len(backward_s) or p < 1:
        raise ValueError("give one forward and one backward time per stage")
    lists = [schedules.one_f_one_b(p, microbatches, rank) for rank in range(p)]

    def duration(rank, action):
        return forward_s[rank] if action.kind == "forward" else backward_s[rank]

    timeline = simulator.simulate(lists, durations=duration)
    return simulator.span(timeline, duration)


def zero_traffic_bytes(numel: int, stage: int, world: int, itemsize: int = 4) -> float:
    """Bytes each rank sends in one ZeRO step of ``numel`` parameters (as sharded, padding
    included): ``2 Psi`` for stages 1 and 2, ``3 Psi`` for stage 3, times ``(N-1)/N``."""
    if stage not in (1, 2, 3):
        raise ValueError(f"ZeRO has stages 1, 2 and 3, not {stage}")
    return (3 if stage == 3 else 2) * numel * itemsize * (world - 1) / world
