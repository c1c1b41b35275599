"""Zero-bubble pipeline schedules: the backward pass split into B, the gradient of a
stage's input (``backward_input``), and W, the gradients of its weights
(``backward_weight``, :mod:`labsupport.parallel.split_backward`), and the Ws moved into
the slots where a rank would wait.

* :func:`zb_h1`: ZB-H1 (Qi et al. 2024, "Zero Bubble Pipeline Parallelism", section 2.1),
  1F1B's memory and a third of its bubble when ``T_F = T_B = T_W``;
* :func:`zbv`: ZB-V (the same paper, section 6), two chunks per rank in a V;
* :func:`dualpipev`: DualPipeV, DeepSeek-V3's DualPipe (DeepSeek-AI 2024, section 3.2.1)
  cut in half onto the same V.

Each returns one rank's list of :class:`~labsupport.parallel.schedules.Action`, as the
schedules of :mod:`labsupport.parallel.schedules` do; the order of the computations is
torch's (``torch/distributed/pipelining/schedules.py``), the messages are placed by
:func:`labsupport.parallel.schedules.with_messages`, and
:func:`labsupport.parallel.schedules.build` builds them by name.
"""

from __future__ import annotations

from labsupport.parallel.schedules import Action, _check, with_messages


def zb_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1: see :func:`_zb_h1`."""
    return with_messages([_zb_h1(p, m, r) for r in range(p)], rank)


def zbv(p: int, m: int, rank: int) -> list[Action]:
    """ZB-V: see :func:`_zbv`."""
    return with_messages([_zbv(p, m, r) for r in range(p)], rank, 2, "v")


def dualpipev(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV: see :func:`_dualpipev`."""
    return with_messages([_dualpipev(p, m, r) for r in range(p)], rank, 2, "v")


def _split(kind: str, k: int, c: int = 0) -> Action:
    return Action({"F": "forward", "B": "backward", "I": "backward_input",
                   "W": "backward_weight"}[kind], k, c)  # fmt: skip


def _zb_h1(p: int, m: int, rank: int) -> list[Action]:
    """ZB-H1 (Qi et al. 2024, section 2.1; torch's ``ScheduleInterleavedZeroBubble`` on
    one chunk per rank): 1F1B with each backward split into B (``backward_input``) and W
    (``backward_weight``). B goes back as fast as it can; rank ``r`` holds back its first
    ``r`` Ws to the end, where the other ranks' drain leaves it idle. Every rank then holds
    ``p`` micro-batches (to their W), rank 0's count in 1F1B."""
    _check(p, m, rank)
    warmup = min(p - rank - 1, m)
    order, w = [_split("F", k) for k in range(warmup)], 0
    for i in range(m):
        order += [_split("F", warmup + i)] if warmup + i < m else []
        order.append(_split("I", i))
        if i >= rank:
            order.append(_split("W", w))
            w += 1
    order += [_split("W", k) for k in range(w, m)]
    return order


def _zbv(p: int, m: int, rank: int) -> list[Action]:
    """ZB-V (Qi et al. 2024, section 6; torch's ``ScheduleZBVZeroBubble``, whose order this
    is): two chunks per rank placed as a V (:func:`stage_of`), so that rank 0 holds the
    first and the last stage and a micro-batch turns on the last rank without a message.
    Forwards of chunk 0, then of chunk 1 each followed by its B and W, a steady state of
    ``F B W`` on each chunk in turn, and a drain whose Ws fill the bubble."""
    _check(p, m, rank)
    n = max(2 * p - 1, m)  # generated for enough micro-batches, the extra ones dropped
    order, f, b = [], [0, 0], [0, 0]  # per chunk: forwards and Bs done

    def forward(c):
        order.append(_split("F", f[c], c))
        f[c] += 1

    def backward(c, weight=True):  # B, then its W unless held back
        order.extend(_split(kind, b[c], c) for kind in ("IW" if weight else "I"))
        b[c] += 1

    for _ in range(2 * (p - rank) - 1):
        forward(0)
    for _ in range(rank):
        forward(1), forward(0)
    for _ in range(p - rank):
        forward(1), backward(1)
    while f[1] < f[0] or f[0] < n:  # steady state
        if f[0] < n:
            forward(0)
        backward(0), forward(1), backward(1)
    w = list(b)  # the Ws held back from here on
    for _ in range(rank):
        backward(0, False), backward(1, False)
    for _ in range(p - rank):
        backward(0, False)
        order.append(_split("W", w[0], 0))
        w[0] += 1
    order += [_split("W", k, 1) for k in range(w[1], b[1])]
    order += [_split("W", k, 0) for k in range(w[0], b[0])]
    return [a for a in order if a.microbatch < m]


def _dualpipev(p: int, m: int, rank: int) -> list[Action]:
    """DualPipeV (DeepSeek's ``dualpipe/dualpipev.py``; torch's ``ScheduleDualPipeV``,
    whose order this is): DualPipe (DeepSeek-AI 2024, section 3.2.1) cut in half onto a V
    of two chunks per rank. Its steady state pairs a forward of one chunk with a full
    backward of the other (DualPipe runs each pair at once, one's all-to-all hidden behind
    the other's compute; here they run one after the other); the warm-up and the drain
    split backwards into B and W and fill the bubble with the Ws. Needs ``m >= 2p``."""
    _check(p, m, rank)
    if m < 2 * p:
        raise ValueError(
            f"DualPipeV needs at least as many micro-batches as stages (2p = {2 * p}), got "
            f"m={m}; use m={2 * p} or another schedule"
        )
    order, f, b, held_back = [], [0, 0], [0, 0], []

    def forward(c):
        order.append(_split("F", f[c], c))
        f[c] += 1

    def backward(c, split=False):  # a full backward, or a B whose W waits in line
        order.append(_split("I" if split else "B", b[c], c))
        held_back.extend([_split("W", b[c], c)] * split)
        b[c] += 1

    def weight():
        order.extend(held_back[:1])
        del held_back[:1]

    for _ in range(2 * (p - rank - 1)):
        forward(0)
    for _ in range(rank + 1):
        forward(0), forward(1)
    for _ in range(p - rank - 1):
        backward(1, True), weight(), forward(1)
    for _ in range(m - 2 * p + rank + 1):  # the steady state, in pairs
        forward(0), backward(1), forward(1), backward(0)
    for _ in range(p - rank - 1):
        backward(1), forward(1), backward(0)
    split = False
    for i in range(rank + 1):  # the second half of these split
        split = split or (i == (rank + 1) // 2 and rank % 2 == 1)
        backward(1, split)
        split = split or (i == (rank + 1) // 2 and rank % 2 == 0)
        backward(0, split)
    for _ in range(p - rank - 1):
        weight(), backward(0, True)
    for _ in range(rank + 1):
        weight()
    return order


SCHEDULES = {"zb-h1": zb_h1, "zbv": zbv, "dualpipev": dualpipev}


def idle_slots(name: str, p: int) -> int:
    """Slots a rank waits in a step (``T_F = T_B = T_W`` = 1 slot, a full backward 2;
    with two chunks, slots of a chunk, half a stage), enough micro-batches given:
    1F1B's ``(p-1)(T_F + T_B + T_W)``; ZB-H1's ``(p-1)(T_F + T_B - T_W)`` (Qi et al. 2024,
    section 2.1); ZB-V and DualPipeV ``p - 1``, the chunk forwards before the last rank's
    first input (ZB-V leaves no other gap: "zero bubble" in Qi et al.'s sense, section 6)."""
    return {"1f1b": 3 * (p - 1), "zb-h1": p - 1, "zbv": p - 1, "dualpipev": p - 1}[name]


def bubble_fraction(name: str, p: int, m: int) -> float:
    """Idle over the total time of a step of ``m`` micro-batches (:func:`idle_slots`)."""
    busy = 3 * m * (2 if name in ("zbv", "dualpipev") else 1)
    return idle_slots(name, p) / (busy + idle_slots(name, p))
