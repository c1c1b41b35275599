"""Lab 9's exercises: a worker's pull/push loop, run on real ranks against the course's
parameter server; then the bytes a server receives, and the staleness an asynchronous
server records, as formulas.

The learner's loop only ever runs on the ranks, under a timeout: a loop that waits for a
message no server sends is reported as such rather than hanging the notebook.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.nn.functional as F
from torch.nn.utils import parameters_to_vector

from labsupport.labs.cells import exercise, expect_close, launch_answer, number
from labsupport.labs.lab09_parameter_server import (
    BATCH,
    LR,
    batch,
    gathered,
    make_model,
    servers_of,
    single_process_sgd,
)
from labsupport.launch.launcher import launch
from labsupport.parallel import parameter_server as ps

# --------------------------------------------------------------------------- the worker

#: Pushes per worker in the checker's runs, on 1 server and 3 workers.
STEPS, WORKERS = 4, 3


def worker_loop_case(fn) -> dict:
    """On every rank: synchronous training with the library's worker loop, then with the
    learner's ``fn``, then asynchronous training with ``fn``; each rank's results."""
    runs = {}
    for label, mode, loop in (
        ("library", "sync", None),
        ("sync", "sync", fn),
        ("async", "async", fn),
    ):
        runs[label] = ps.train(
            make_model, batch, F.mse_loss, STEPS, mode=mode, lr=LR, worker_loop=loop
        )
    return runs


def _sync_hint(updates: list[dict], got: torch.Tensor) -> str:
    """The usual mistake behind a synchronous run whose parameters are wrong."""
    stale = next((u for u in updates if u["staleness"]), None)
    if stale is not None:
        seen = stale["version"] - stale["staleness"]
        return (
            f"worker {stale['worker']}'s gradient was computed on version {seen} of the "
            f"parameters while the server was at {stale['version']}: pull before each step "
            "and load what client.pull() returns into the model (vector_to_parameters)"
        )
    initial = parameters_to_vector(make_model().parameters()).detach()
    if torch.allclose(got, (1 - LR) ** STEPS * initial, rtol=1e-4, atol=1e-6):
        return (
            f"the parameters shrank by a factor 1 - lr = {1 - LR:g} at every step: you pushed "
            "the weights; push their gradient, each parameter's .grad"
        )
    return (
        "every gradient was computed on the version pulled, but not as one process computes "
        "it: load what client.pull() returns into the model, zero the gradients before each "
        "backward (model.zero_grad()), and push the gradient of this step's batch"
    )


@exercise
def check_worker_loop(fn, timeout: float = 120) -> str:
    """Exercise 1: ``fn(client, model, batch, loss_fn, steps)``, a worker's loop against
    :mod:`labsupport.parallel.parameter_server`'s server, run on 1 server and 3 workers:
    synchronously, the server ends with one process's parameters; asynchronously, each
    push records its staleness."""
    hint = (
        "A server sends parameters only at the start and in answer to a push (client.push "
        "waits for that answer; client.pull() only hands it over), and it stops after "
        f"every worker's {STEPS} pushes. Does each worker pull then push, steps times, and "
        "wait for no message of its own (dist.recv)?"
    )
    runs = launch_answer(worker_loop_case, 1 + WORKERS, hint, timeout, args=(fn,))
    by_run = {label: [r[label] for r in runs] for label in runs[0]}
    want = single_process_sgd(WORKERS, STEPS)
    library = gathered(by_run["library"])
    tolerance = STEPS * LR * (WORKERS * BATCH) * 2**-24  # as lab 9's section 1
    expect_close(library, want, "the library's parameters", 0, rtol=0, atol=tolerance)
    got = gathered(by_run["sync"])
    (server,) = servers_of(by_run["sync"])
    what = f"the server's parameter vector after {STEPS} synchronous steps"
    hint = _sync_hint(server["updates"], got)
    expect_close(got, want, what, 0, hint, rtol=0, atol=tolerance)
    (server,) = servers_of(by_run["async"])
    last = {}
    for k, u in enumerate(server["updates"]):
        seen, w = u["version"] - u["staleness"], u["worker"]
        if w in last and seen <= last[w]:
            raise AssertionError(
                f"asynchronously, worker {w}'s push {k} was computed on version {seen}, no newer "
                f"than its previous push, applied at version {last[w]}: pull before each step"
            )
        last[w] = u["version"]
    counts = dict(sorted(Counter(u["staleness"] for u in server["updates"]).items()))
    return (
        f"synchronously, the server ends with one process's parameters after {STEPS} steps "
        f"of {WORKERS} workers, as with the library's loop; asynchronously, the "
        f"{len(server['updates'])} pushes had staleness {counts} ({{staleness: pushes}})"
    )


# --------------------------------------------------------------------------- formulas


@exercise
def check_server_bytes(fn) -> str:
    """Exercise 2: ``fn(num_params, workers, servers)`` must give the gradient bytes one
    server receives in a synchronous step (float32, ``servers`` divides ``num_params``)."""
    for numel, workers, servers in [
        (6000, 3, 1),
        (6000, 3, 2),
        (124_439_808, 64, 8),
        (10**9, 1024, 16),
    ]:
        got = number(fn(numel, workers, servers))
        want = workers * 4 * numel // servers
        if got == want:
            continue
        where = (
            f"{numel:,} parameters, {workers} workers, {servers} servers: got {got:,.15g} bytes, "
        )
        if got == 4 * numel // servers:
            hint = "one worker's push: every worker pushes to every server"
        elif got == workers * 4 * numel:
            hint = "the whole gradient: a server holds only its shard of the parameters"
        elif got == want // 4:
            hint = "that counts parameters: each float32 takes 4 bytes"
        else:
            hint = f"{'more' if got > want else 'fewer'} than the server receives"
        raise AssertionError(where + hint)
    return "the bytes a server receives per step, for 1 to 16 servers and up to 1,024 workers"


@exercise
def check_staleness(fn) -> str:
    """Exercise 3: ``fn(order, workers)`` must give the staleness of each push, when the
    pushes reach an asynchronous server in ``order`` (a list of worker numbers)."""
    traces = [
        ("every worker in turn", lambda: [0, 1, 2] * 3),
        ("one straggler", lambda: [1, 2, 1, 2, 0, 1, 2, 1, 2, 0]),
        ("a real run", _real_order),  # launched only once the made-up orders pass
    ]
    for label, make in traces:
        order = make()
        answer = fn(list(order), 3)
        if not isinstance(answer, list | tuple):
            raise AssertionError(f"your function returned {answer!r}: it should return a list")
        got = [number(s) for s in answer]
        want = simulate_staleness(order, 3)
        if got == want:
            continue
        first = next(
            (i for i, (a, b) in enumerate(zip(got, want, strict=False)) if a != b), len(got)
        )
        where = f"{label}, order {order}: push {first} should have staleness {want[first]}, "
        where += f"got {got[first]}" if first < len(got) else f"got {len(got)} values"
        if len(got) == len(want) and all(a == b + 1 for a, b in zip(got, want, strict=True)):
            where += "; a worker pulled the parameters *after* its own update was applied"
        raise AssertionError(where)
    return (
        "the staleness of every push, on made-up orders and on the order of a real asynchronous run"
    )


def simulate_staleness(order: list[int], workers: int) -> list[int]:
    """What an asynchronous server records: updates applied since the worker pulled."""
    pulled, out = [0] * workers, []
    for version, w in enumerate(order):
        out.append(version - pulled[w])
        pulled[w] = version + 1
    return out


def _real_order() -> list[int]:
    results = launch(ps.train, 4, args=(make_model, batch, F.mse_loss, 4), kwargs={"mode": "async"})
    (server,) = servers_of(results)
    want = [u["staleness"] for u in server["updates"]]
    order = [u["worker"] for u in server["updates"]]
    assert simulate_staleness(order, 3) == want, "the server's records disagree with the model"
    return order
