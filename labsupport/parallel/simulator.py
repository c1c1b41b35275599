"""Pipeline schedules, played before they run: every rank's list of actions against the
others', message by message, one time slot per computation.

:func:`simulate` runs the lists as the executor
(:func:`labsupport.parallel.pipeline_parallel.run`) does: a rank posts each batch of
messages when it reaches it and goes on, and a computation waits for the message it
reads. It finds lists that cannot run, a deadlock or two ranks whose messages would pair
up wrong, and gives each computation its slot, from which :func:`measured_bubble` counts
the bubble. The schedules are in :mod:`labsupport.parallel.schedules` and
:mod:`labsupport.parallel.zero_bubble`.
"""

from __future__ import annotations

from labsupport.parallel.schedules import COMM, Action, batches, peer


def simulate(
    lists: list[list[Action]], style: str = "loop", durations=None
) -> list[list[tuple[Action, int]]]:
    """Play the schedule, message by message, as the executor runs it: each compute action
    takes one time slot (``durations[kind]`` slots if given, :data:`SPLIT` for split
    backwards; or ``durations(rank, action)``, for stages that take different times); a
    rank posts each batch of messages when it reaches it, and goes on; a
    compute waits until the message it reads has been sent. No send waits for its
    receive (torch's ``_PipelineScheduleRuntime`` too waits for its sends only at the end
    of the step).

    Between two ranks, messages pair in the order they are posted, as gloo and NCCL pair
    them: a receive that would get another micro-batch's tensor, or an activation where
    the peer sends a gradient, raises ``RuntimeError`` (the lists do not match; run for
    real, same-shaped tensors would be swapped without an error). So does a schedule in
    which no rank can go on, naming what each waits for (a :class:`Deadlock`). Returns each rank's
    compute actions with the slot each starts at."""
    p = len(lists)
    queues = [batches(acts) for acts in lists]
    position, clock = [0] * p, [0] * p
    sent: dict[tuple[int, int], list] = {}  # (from, to) -> [(what the receiver gets, slot)]
    received: dict[tuple[int, int], list] = {}  # (from, to) -> the receives posted, in order
    inbox: list[dict] = [{} for _ in range(p)]  # per rank: receive posted -> its place
    timeline: list[list[tuple[Action, int]]] = [[] for _ in range(p)]
    while any(position[r] < len(queues[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            while position[r] < len(queues[r]):
                batch = queues[r][position[r]]
                if batch[0].kind in COMM:
                    for a in batch:
                        inbox[r][a] = _post(a, r, p, style, clock[r], sent, received)
                else:
                    waited = inbox[r].get(_input(batch[0]))
                    arrival = 0 if waited is None else _arrival(waited, r, sent)
                    if arrival is None:
                        break
                    inbox[r].pop(_input(batch[0]), None)
                    clock[r] = max(clock[r], arrival)
                    timeline[r].append((batch[0], clock[r]))
                    clock[r] += _duration(durations, r, batch[0])
                position[r] += 1
                progressed = True
        if not progressed:
            _pair_up(sent, received, complete=False)  # lists that disagree, if that is why
            stuck = [
                (r, sum(map(len, queues[r][: position[r]])), queues[r][position[r]][0], clock[r])
                for r in range(p)
                if position[r] < len(queues[r])
            ]
            raise Deadlock(stuck)
    _pair_up(sent, received, complete=True)
    return timeline


class Deadlock(RuntimeError):
    """No rank can go on. ``stuck`` holds, for each rank not done, ``(rank, index,
    action, slot)``: the compute ``action``, number ``index`` of the rank's list, that
    waits at time ``slot`` for a message no rank will send."""

    def __init__(self, stuck: list[tuple[int, int, Action, int]]):
        self.stuck = stuck
        super().__init__(
            "the schedule deadlocks: "
            + "; ".join(
                f"rank {r} waits for {_input(a)} (its action {i}, {a.kind} {a.microbatch}, "
                f"at slot {slot})"
                for r, i, a, slot in stuck
            )
        )


def _pair_up(sent: dict, received: dict, complete: bool) -> None:
    """Pair every receive posted with the message sent at its place (all of them, if
    ``complete``): ``RuntimeError`` where two ranks' lists disagree."""
    for src, dst in set(sent) | set(received):
        receives, messages_sent = received.get((src, dst), []), sent.get((src, dst), [])
        for index, a in enumerate(receives[: len(messages_sent)]):
            _arrival((src, index, a), dst, sent)
        if complete and len(receives) != len(messages_sent):
            extra = len(messages_sent) - len(receives)
            raise RuntimeError(
                f"the lists do not match: rank {src if extra > 0 else dst} posts {abs(extra)} "
                f"more messages to or from rank {dst if extra > 0 else src} than it receives "
                "or sends"
            )


def _input(a: Action) -> Action:
    """The receive a compute action reads (if the rank posted one)."""
    kind = "recv_act" if a.kind == "forward" else "recv_grad"
    return Action(kind if a.kind != "backward_weight" else "none", a.microbatch, a.chunk)


def _post(a: Action, rank: int, p: int, style: str, slot: int, sent: dict, received: dict):
    """Post message ``a``: a send joins what goes to its peer, in order; a receive takes
    the next place in what comes from its peer (returned, to wait for)."""
    other, chunk = peer(a, p, rank, style)
    if a.kind.startswith("send"):
        sent.setdefault((rank, other), []).append(
            (Action(_MATCH[a.kind], a.microbatch, chunk), slot)
        )
        return None
    received.setdefault((other, rank), []).append(a)
    return other, len(received[other, rank]) - 1, a


def _arrival(waited: tuple, rank: int, sent: dict) -> int | None:
    """When the receive ``waited`` gets its message (None: not sent yet); refuses a
    message that is not the one the receive names."""
    other, index, a = waited
    messages = sent.get((other, rank), [])
    if index >= len(messages):
        return None
    got, slot = messages[index]
    if got != a:
        raise RuntimeError(
            f"the lists do not match: rank {rank}'s receive number {index} from rank "
            f"{other} is for {_what(a)}, but rank {other}'s message number {index} to rank "
            f"{rank} is {_what(got)}; run as is, the ranks would swap the two tensors "
            "without an error"
        )
    return slot


def _what(a: Action) -> str:
    kind = "the activation" if a.kind == "recv_act" else "the gradient"
    return f"{kind} of micro-batch {a.microbatch} (chunk {a.chunk})"


_MATCH = {
    "send_act": "recv_act",
    "recv_act": "send_act",
    "send_grad": "recv_grad",
    "recv_grad": "send_grad",
}


def _duration(durations, rank: int, a: Action):
    if callable(durations):
        return durations(rank, a)
    return (durations or {}).get(a.kind, 1)


def span(timeline: list[list[tuple[Action, int]]], durations=None):
    """The simulated step, from the first computation's start to the last one's end."""
    return max(t + _duration(durations, r, a) for r, rank in enumerate(timeline) for a, t in rank)


def measured_bubble(timeline: list[list[tuple[Action, int]]], durations=None):
    """Idle share of the pipeline's span in a simulated timeline (every action one slot,
    or as many as ``durations`` gives, as :func:`simulate` took them)."""
    busy = sum(_duration(durations, r, a) for r, rank in enumerate(timeline) for a, _ in rank)
    return 1 - busy / (span(timeline, durations) * len(timeline))


#: Slots per compute action when the backward is split: the papers' assumption
#: ``T_F = T_B = T_W`` (Qi et al. 2024, section 2), a full backward being B + W.
SPLIT = {"forward": 1, "backward": 2, "backward_input": 1, "backward_weight": 1}
