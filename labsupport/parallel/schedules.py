"""Pipeline schedules as data: the ordered list of actions each rank performs.

A schedule is a function of the number of stages ``p``, of micro-batches ``m``, the rank
and (interleaved only) the chunks per rank ``v``, that returns the rank's actions, as
DeepSpeed's ``runtime/pipe/schedule.py`` does with its instruction generators:

* ``Action("forward", k, c)`` / ``Action("backward", k, c)``: micro-batch ``k`` through
  the rank's model chunk ``c`` (chunk ``c`` of rank ``r`` is stage ``c * p + r``, or
  as :func:`stage_of` places a V); ``"backward_input"`` and ``"backward_weight"`` split
  the backward, for the schedules of :mod:`labsupport.parallel.zero_bubble`;
* ``Action("recv_act" | "send_act" | "recv_grad" | "send_grad", k, c)``: the activation
  coming in from (going out to) the previous (next) stage, the gradient the other way.

Schedules are checked and drawn before anything runs: :mod:`labsupport.parallel.
simulator` plays every rank's list against the others, message by message. The
executor in :mod:`labsupport.parallel.pipeline_parallel` runs any of them. Consecutive
communication actions of a rank are posted together (one ``batch_isend_irecv``), as
Megatron's ``send_forward_recv_backward`` does.

* :func:`naive`: no overlap at all: each micro-batch's forward and backward go through
  the whole pipeline before the next micro-batch starts;
* :func:`gpipe`: all forwards, then all backwards (Huang et al. 2019);
* :func:`one_f_one_b`: 1F1B, PipeDream-Flush (Narayanan et al. 2021): after a warm-up of
  ``p - rank - 1`` forwards, one forward and one backward in turn; at most ``p``
  micro-batches' activations alive per rank instead of ``m``;
* :func:`interleaved_1f1b`: 1F1B over ``v`` chunks per rank (Narayanan et al. 2021,
  section 2.2): the bubble divided by ``v``, for ``v`` times the messages; depth-first:
  a micro-batch goes on to the next chunk as soon as it can;
* :func:`looped_bfs`: breadth-first over ``v`` chunks: every micro-batch through a chunk
  before the next chunk starts.
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


def stage_of(p: int, rank: int, chunk: int, style: str = "loop") -> int:
    """The stage that chunk ``chunk`` of ``rank`` runs. ``"loop"``: chunk ``c`` is stage
    ``c * p + rank`` (the interleaved schedule's placement); ``"v"``: two chunks, stages
    ``rank`` and ``2p - 1 - rank``, so that the last rank holds the two middle stages and
    rank 0 the first and the last (torch's ``generate_stage_to_rank_mapping(style="v")``)."""
    return (rank if chunk == 0 else 2 * p - 1 - rank) if style == "v" else chunk * p + rank


def place(stage: int, p: int, style: str = "loop") -> tuple[int, int]:
    """The (rank, chunk) that runs ``stage``: the inverse of :func:`stage_of`."""
    if style == "v":
        return (stage, 0) if stage < p else (2 * p - 1 - stage, 1)
    return stage % p, stage // p


def messages(a: Action, p: int, rank: int, v: int = 1, style: str = "loop") -> tuple[list, list]:
    """What compute action ``a`` receives before it runs and sends after: nothing to or
    from a neighbouring stage on the same rank (the V's turn), nothing for a W."""
    stage = stage_of(p, rank, a.chunk, style)
    before = stage > 0 and place(stage - 1, p, style)[0] != rank
    after = stage < p * v - 1 and place(stage + 1, p, style)[0] != rank
    k, c = a.microbatch, a.chunk
    if a.kind == "forward":
        return [Action("recv_act", k, c)] * before, [Action("send_act", k, c)] * after
    if a.kind in ("backward", "backward_input"):
        return [Action("recv_grad", k, c)] * after, [Action("send_grad", k, c)] * before
    return [], []


def _forward(p: int, rank: int, k: int, c: int = 0, v: int = 1) -> list[Action]:
    recv, send = messages(Action("forward", k, c), p, rank, v)
    return [*recv, Action("forward", k, c), *send]


def _backward(p: int, rank: int, k: int, c: int = 0, v: int = 1) -> list[Action]:
    recv, send = messages(Action("backward", k, c), p, rank, v)
    return [*recv, Action("backward", k, c), *send]


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


def with_messages(orders: list[list[Action]], rank: int, v: int = 1, style: str = "loop"):
    """Rank ``rank``'s computations (``orders[rank]``, every rank's given) with their
    messages: after each computation its sends, and the receives the next one reads,
    posted together (Megatron's ``send_forward_recv_backward``). Messages between two
    ranks pair in the order they are posted, so a rank posts its receives from a peer in
    the order the peer sends: with two chunks in a V, a rank receives activations and
    gradients from the same neighbour, in the neighbour's order, and may post a receive
    early, before one its next computation reads (torch's ``_add_send_recv`` places its
    receives by the same rule: when the sender sends)."""
    p = len(orders)
    coming = {}  # peer -> what it sends this rank, in its order (as this rank receives it)
    for src, order in enumerate(orders):
        for a in order:
            for send in messages(a, p, src, v, style)[1]:
                dst, chunk = peer(send, p, src, style)
                kind = send.kind.replace("send", "recv")
                coming.setdefault(dst, {}).setdefault(src, []).append(
                    Action(kind, send.microbatch, chunk)
                )
    coming, posted = coming.get(rank, {}), {src: 0 for src in coming.get(rank, {})}
    acts = []
    for a in orders[rank]:
        for receive in messages(a, p, rank, v, style)[0]:
            src = peer(receive, p, rank, style)[0]
            upto = coming[src].index(receive) + 1
            acts += coming[src][posted[src] : upto]  # this one, and those sent before it
            posted[src] = max(posted[src], upto)
        acts += [a, *messages(a, p, rank, v, style)[1]]
    return acts


def looped_bfs(p: int, m: int, rank: int, v: int = 2) -> list[Action]:
    """Breadth-first over ``v`` chunks per rank (Lamy-Poirier 2023, "Breadth-First
    Pipeline Parallelism"; torch's ``ScheduleLoopedBFS``): every micro-batch through
    chunk 0, then through chunk 1, and so on, then the backwards chunk by chunk in
    reverse: GPipe over the chunks. It holds all ``m v`` chunks' activations, where the
    depth-first :func:`interleaved_1f1b` holds about ``p``; in exchange each chunk's
    forward (and backward) runs once for the whole batch in one stretch, which is what
    FSDP wants: one gather of a chunk's weights, one reduce-scatter of its gradients."""
    _check(p, m, rank, v)
    order = [Action("forward", k, c) for c in range(v) for k in range(m)]
    order += [Action("backward", k, c) for c in reversed(range(v)) for k in reversed(range(m))]
    return with_messages([order] * p, rank, v)


SCHEDULES = {
    "naive": naive,
    "gpipe": gpipe,
    "1f1b": one_f_one_b,
    "interleaved": interleaved_1f1b,
    "looped-bfs": looped_bfs,
}
#: The zero-bubble schedules of :mod:`labsupport.parallel.zero_bubble`, which split the
#: backward pass; the V-shaped ones place their two chunks per rank as a V (:func:`stage_of`).
ZERO_BUBBLE, V_SHAPED = ("zb-h1", "zbv", "dualpipev"), ("zbv", "dualpipev")


def build(name: str, p: int, m: int, v: int = 1) -> list[list[Action]]:
    """Every rank's action list for schedule ``name`` (the V-shaped ones: ``v = 2``)."""
    if name not in (*SCHEDULES, *ZERO_BUBBLE):
        names = ", ".join((*SCHEDULES, *ZERO_BUBBLE))
        raise ValueError(f"schedule must be one of {names}, got {name!r}")
    if name in ("interleaved", "looped-bfs"):
        return [SCHEDULES[name](p, m, r, v) for r in range(p)]
    if v != (2 if name in V_SHAPED else 1):
        raise ValueError(
            f"{name} runs {2 if name in V_SHAPED else 1} chunk(s) per rank, got v={v}; only "
            "the interleaved and the looped breadth-first schedules take any v"
        )
    if name in ZERO_BUBBLE:
        from labsupport.parallel import zero_bubble  # it builds on this module

        return [zero_bubble.SCHEDULES[name](p, m, r) for r in range(p)]
    return [SCHEDULES[name](p, m, r) for r in range(p)]


def style(name: str) -> str:
    """How schedule ``name`` places its chunks on the ranks (:func:`stage_of`)."""
    return "v" if name in V_SHAPED else "loop"


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


def peer(a: Action, p: int, rank: int, style: str = "loop") -> tuple[int, int]:
    """The (rank, chunk) a communication action talks to."""
    step = 1 if a.kind in ("send_act", "recv_grad") else -1
    return place(stage_of(p, rank, a.chunk, style) + step, p, style)


def bubble_fraction(p: int, m: int, v: int = 1) -> dict:
    """The pipeline bubble, both ways the literature writes it: idle time over the total,
    ``(p-1)/(v·m + p-1)``, and over the ideal (busy) time, ``(p-1)/(v·m)``
    (Narayanan et al. 2021, section 2.2, with v = 1 for GPipe and 1F1B)."""
    return {"of_total": (p - 1) / (v * m + p - 1), "of_ideal": (p - 1) / (v * m)}
