"""Pipeline schedules as data: the ordered list of actions each rank performs.

A schedule is a function of the number of stages ``p``, of micro-batches ``m``, the rank
and (interleaved only) the chunks per rank ``v``, that returns the rank's actions, as
DeepSpeed's ``runtime/pipe/schedule.py`` does with its instruction generators:

* ``Action("forward", k, c)`` / ``Action("backward", k, c)``: micro-batch ``k`` through
  the rank's model chunk ``c`` (chunk ``c`` of rank ``r`` is stage ``c * p + r``);
* ``Action("recv_act" | "send_act" | "recv_grad" | "send_grad", k, c)``: the activation
  coming in from (going out to) the previous (next) stage, the gradient the other way.

Schedules are drawn and checked before anything runs: :func:`simulate` plays every
rank's list against the others, message by message, finds lists that do not match,
and gives each action a time slot, from which the bubble is counted. The executor in
:mod:`labsupport.parallel.pipeline_parallel` runs any of them. Consecutive
communication actions of a rank are posted together (one ``batch_isend_irecv``), as
Megatron's ``send_forward_recv_backward`` does; :func:`simulate` models that grouping.

* :func:`naive`: no overlap at all: each micro-batch's forward and backward go through
  the whole pipeline before the next micro-batch starts;
* :func:`gpipe`: all forwards, then all backwards (Huang et al. 2019);
* :func:`one_f_one_b`: 1F1B, PipeDream-Flush (Narayanan et al. 2021): after a warm-up of
  ``p - rank - 1`` forwards, one forward and one backward in turn; at most ``p``
  micro-batches' activations alive per rank instead of ``m``;
* :func:`interleaved_1f1b`: 1F1B over ``v`` chunks per rank (Narayanan et al. 2021,
  section 2.2): the bubble divided by ``v``, for ``v`` times the messages.
"""

from __future__ import annotations

from collections import namedtuple

Action = namedtuple("Action", "kind microbatch chunk")
COMM = ("recv_act", "send_act", "recv_grad", "send_grad")


def _check(p: int, m: int, rank: int, v: int = 1) -> None:
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"stages, micro-batches and chunks must be positive: p={p}, m={m}, v={v}")
    if not 0 <= rank < p:
        raise ValueError(f"rank {rank} is not one of the {p} pipeline ranks")


def _forward(p: int, rank: int, k: int, c: int = 0, v: int = 1) -> list[Action]:
    stage = c * p + rank
    acts = [] if stage == 0 else [Action("recv_act", k, c)]
    acts.append(Action("forward", k, c))
    if stage < p * v - 1:
        acts.append(Action("send_act", k, c))
    return acts


def _backward(p: int, rank: int, k: int, c: int = 0, v: int = 1) -> list[Action]:
    stage = c * p + rank
    acts = [] if stage == p * v - 1 else [Action("recv_grad", k, c)]
    acts.append(Action("backward", k, c))
    if stage > 0:
        acts.append(Action("send_grad", k, c))
    return acts


def naive(p: int, m: int, rank: int) -> list[Action]:
    """Model parallelism without micro-batching: each micro-batch's forward and backward
    go through the whole pipeline before the next one starts."""
    _check(p, m, rank)
    return [a for k in range(m) for a in _forward(p, rank, k) + _backward(p, rank, k)]


def gpipe(p: int, m: int, rank: int) -> list[Action]:
    """GPipe: every micro-batch's forward, then every backward (in reverse order)."""
    _check(p, m, rank)
    forwards = [a for k in range(m) for a in _forward(p, rank, k)]
    return forwards + [a for k in reversed(range(m)) for a in _backward(p, rank, k)]


def one_f_one_b(p: int, m: int, rank: int) -> list[Action]:
    """1F1B: warm-up forwards, then one forward and one backward in turn, then the rest
    of the backwards."""
    _check(p, m, rank)
    warmup = min(p - rank - 1, m)
    acts = [a for k in range(warmup) for a in _forward(p, rank, k)]
    for k in range(m - warmup):
        acts += _forward(p, rank, warmup + k) + _backward(p, rank, k)
    return acts + [a for k in range(m - warmup, m) for a in _backward(p, rank, k)]


def interleaved_1f1b(p: int, m: int, rank: int, v: int = 2) -> list[Action]:
    """Interleaved 1F1B with ``v`` model chunks per rank (Megatron's
    ``forward_backward_pipelining_with_interleaving``). Micro-batches go through the
    chunks in groups of ``p``, so ``m`` must be a multiple of ``p``. As in Megatron, each
    steady-state step runs a forward and a backward and then posts, as one batch, both
    their sends and the receives the next forward and backward need: with chunks, a
    rank's neighbours are the same two ranks for every chunk, and sends and receives
    posted in separate batches could wait for each other forever."""
    _check(p, m, rank, v)
    if p < 2:
        raise ValueError("the interleaved schedule needs at least 2 pipeline stages")
    if m % p:
        raise ValueError(
            f"the interleaved schedule needs the micro-batches to be a multiple of the "
            f"pipeline stages: m={m}, p={p}; use m={m + p - m % p} or another schedule"
        )
    total = m * v

    def fwd(i):  # the i-th forward of this rank: micro-batch, chunk
        group, within = divmod(i, p * v)
        return Action("forward", group * p + within % p, within // p)

    def bwd(i):
        f = fwd(i)
        return Action("backward", f.microbatch, v - 1 - f.chunk)

    def recv(a):  # what compute ``a`` receives before it runs
        first, last = a.chunk * p + rank == 0, a.chunk * p + rank == p * v - 1
        if a.kind == "forward":
            return [] if first else [Action("recv_act", a.microbatch, a.chunk)]
        return [] if last else [Action("recv_grad", a.microbatch, a.chunk)]

    def send(a):  # what compute ``a`` sends after it ran
        first, last = a.chunk * p + rank == 0, a.chunk * p + rank == p * v - 1
        if a.kind == "forward":
            return [] if last else [Action("send_act", a.microbatch, a.chunk)]
        return [] if first else [Action("send_grad", a.microbatch, a.chunk)]

    warmup = min((p - rank - 1) * 2 + (v - 1) * p, total)
    acts = recv(fwd(0))
    for i in range(warmup):
        acts += [fwd(i), *send(fwd(i))]
        acts += recv(fwd(i + 1)) if i + 1 < total else []
        acts += recv(bwd(0)) if i == warmup - 1 else []
    for j in range(total - warmup):  # steady state: one forward, one backward
        acts += [fwd(warmup + j), bwd(j), *send(fwd(warmup + j)), *send(bwd(j))]
        acts += recv(fwd(warmup + j + 1)) if warmup + j + 1 < total else []
        acts += recv(bwd(j + 1))
    for j in range(total - warmup, total):  # cool-down: the remaining backwards
        acts += [bwd(j), *send(bwd(j))]
        acts += recv(bwd(j + 1)) if j + 1 < total else []
    return acts


SCHEDULES = {"naive": naive, "gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved_1f1b}


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list for schedule ``name``."""
    if name not in SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(SCHEDULES)}, got {name!r}")
    if name == "interleaved":
        return [interleaved_1f1b(p, m, r, v) for r in range(p)]
    if v != 1:
        raise ValueError(f"only the interleaved schedule has several chunks per rank (v={v})")
    return [SCHEDULES[name](p, m, r) for r in range(p)]


def batches(actions: list[Action]) -> list[list[Action]]:
    """Group a rank's actions: each compute action alone, consecutive communications
    together (the executor posts them as one ``batch_isend_irecv``)."""
    grouped: list[list[Action]] = []
    for a in actions:
        if a.kind in COMM and grouped and grouped[-1][0].kind in COMM:
            grouped[-1].append(a)
        else:
            grouped.append([a])
    return grouped


def peer(a: Action, p: int, rank: int) -> tuple[int, int]:
    """The (rank, chunk) a communication action talks to."""
    stage = a.chunk * p + rank + (1 if a.kind in ("send_act", "recv_grad") else -1)
    return stage % p, stage // p


def simulate(lists: list[list[Action]]) -> list[list[tuple[Action, int]]]:
    """Play the schedule, message by message: each compute action takes one time slot; a
    rank posts each batch of messages when it reaches it and waits until every message in
    it has been posted by the peer too (in any of the peer's batches, earlier or later).
    A message matches the peer's message for the same micro-batch and chunk: stricter
    than NCCL and gloo, which pair the messages between two ranks in posting order, so
    lists that disagree on the order would, run for real, swap micro-batches silently.
    Returns each rank's compute actions with their slot; raises ``RuntimeError`` naming
    what every rank waits for when none can go on: the lists do not match."""
    p = len(lists)
    queues = [batches(acts) for acts in lists]
    position, clock = [0] * p, [0] * p
    posted: dict[tuple[int, Action], int] = {}  # (rank, action) -> slot it was posted at
    timeline: list[list[tuple[Action, int]]] = [[] for _ in range(p)]
    while any(position[r] < len(queues[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(queues[r]):
                batch = queues[r][position[r]]
                if batch[0].kind not in COMM:
                    timeline[r].append((batch[0], clock[r]))
                    clock[r] += 1
                else:
                    for a in batch:
                        posted.setdefault((r, a), clock[r])
                    matches = [_match(a, r, p) for a in batch]
                    if not all(m in posted for m in matches):
                        break
                    clock[r] = max(clock[r], *(posted[m] for m in matches))
                position[r] += 1
                progressed = True
        if not progressed:
            waiting = "; ".join(
                f"rank {r} waits in {queues[r][position[r]]}"
                for r in range(p)
                if position[r] < len(queues[r])
            )
            raise RuntimeError(
                f"the ranks' lists do not match: {waiting}. Run for real, they would hang, "
                "or pair messages of different micro-batches (NCCL and gloo pair two ranks' "
                "messages in the order they are posted) and train on swapped tensors"
            )
    return timeline


_MATCH = {
    "send_act": "recv_act",
    "recv_act": "send_act",
    "send_grad": "recv_grad",
    "recv_grad": "send_grad",
}


def _match(a: Action, rank: int, p: int) -> tuple[int, Action]:
    """The (rank, action) at the other end of communication action ``a``."""
    other, chunk = peer(a, p, rank)
    return other, Action(_MATCH[a.kind], a.microbatch, chunk)


def bubble_fraction(p: int, m: int, v: int = 1) -> dict:
    """The pipeline bubble, both ways the literature writes it: idle time over the total,
    ``(p-1)/(v·m + p-1)``, and over the ideal (busy) time, ``(p-1)/(v·m)``
    (Narayanan et al. 2021, section 2.2, with v = 1 for GPipe and 1F1B)."""
    return {"of_total": (p - 1) / (v * m + p - 1), "of_ideal": (p - 1) / (v * m)}


def measured_bubble(timeline: list[list[tuple[Action, int]]]) -> float:
    """Idle share of the pipeline's span in a simulated timeline (every action one slot)."""
    span = max(slot + 1 for rank in timeline for _, slot in rank)
    busy = sum(len(rank) for rank in timeline)
    return 1 - busy / (span * len(timeline))
