"""Lab 9, the parameter server: the task the workers train on, the runs' records read
back, and bytes through the server counted (the exercises' checkers are in
:mod:`labsupport.labs.lab09_exercises`).

The server and the workers are :func:`labsupport.parallel.parameter_server.train`
(synchronous, asynchronous, stale-synchronous, a straggler); the drawings are in
:mod:`labsupport.viz.parameter_server`.
"""

from __future__ import annotations

from collections import Counter

import torch
import torch.distributed as dist
from torch import nn

from labsupport.comm.allreduce import all_reduce, bytes_sent
from labsupport.comm.flat import even_spans
from labsupport.comm.p2p import count_traffic
from labsupport.launch.runtime import device
from labsupport.models import mse_loss, train_one_process
from labsupport.parallel import parameter_server as ps

#: The model: 16 inputs, two hidden layers of 64, 4 outputs (5,508 parameters).
D_IN, HIDDEN, D_OUT = 16, 64, 4
#: Samples per worker and step, and the learning rate of every run.
BATCH, LR = 2048, 0.3
#: The noise on the targets: no model can push the mean-squared error below NOISE**2.
NOISE = 0.1


def make_model() -> nn.Module:
    """The model every rank builds: the same weights everywhere (seed 0)."""
    torch.manual_seed(0)
    layers = [nn.Linear(D_IN, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, HIDDEN), nn.Tanh()]
    return nn.Sequential(*layers, nn.Linear(HIDDEN, D_OUT))


def batch(worker: int, step: int):
    """Worker ``worker``'s ``(inputs, targets)`` for ``step``: fresh samples each time, the
    targets a fixed smooth function of the inputs plus noise (a "teacher")."""
    teacher = torch.randn(D_IN, D_OUT, generator=torch.Generator().manual_seed(7)) / 4
    g = torch.Generator().manual_seed(100_003 * worker + step)
    x = torch.randn(BATCH, D_IN, generator=g)
    return x, torch.sin(x @ teacher) + NOISE * torch.randn(BATCH, D_OUT, generator=g)


def single_process_sgd(workers: int, steps: int, lr: float = LR) -> torch.Tensor:
    """One process, plain SGD on every worker's batch of each step at once; the final
    parameters as one vector (what synchronous mode must reproduce)."""
    model = make_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=lr)

    def whole(step: int) -> tuple:  # every worker's batch of the step, together
        parts = [batch(w, step) for w in range(workers)]
        return torch.cat([x for x, _ in parts]), torch.cat([y for _, y in parts])

    train_one_process(model, optimizer, map(whole, range(steps)), mse_loss)
    return nn.utils.parameters_to_vector(model.parameters()).detach()


# --------------------------------------------------------------------------- records


def servers_of(results: list) -> list[dict]:
    """The servers' results, in shard order."""
    return sorted((r for r in results if r["role"] == "server"), key=lambda r: r["shard"])


def gathered(results: list) -> torch.Tensor:
    """The final parameters, the servers' shards put back together."""
    return torch.cat([r["parameters"] for r in servers_of(results)])


def while_all_run(updates: list[dict]) -> dict:
    """Rates while every worker is still pushing: up to the moment the first worker
    pushes its last gradient (after that, fewer workers run and any rate drops).

    Returns ``seconds`` (that moment), ``pushes`` and ``updates`` (gradients received and
    parameter updates made by then), and both per second. An update is made when the last
    gradient recorded at its version arrives: one per gradient asynchronously, one per
    round of W gradients synchronously (a round still open at that moment is not counted).
    """
    workers = {u["worker"] for u in updates}
    end = min(max(u["time"] for u in updates if u["worker"] == w) for w in workers)
    done = [u for u in updates if u["time"] <= end]
    per_version = Counter(u["version"] for u in updates)
    made = sum(n == per_version[v] for v, n in Counter(u["version"] for u in done).items())
    return {
        "seconds": end,
        "pushes": len(done),
        "updates": made,
        "pushes_per_s": len(done) / end,
        "updates_per_s": made / end,
    }


# --------------------------------------------------------------------------- bytes


def counted_train(*args, **kwargs) -> dict:
    """:func:`~labsupport.parallel.parameter_server.train` on every rank, with every byte
    the rank sends counted (:func:`labsupport.comm.p2p.count_traffic`); returns its
    result plus ``rank`` and ``sent``, a list of ``(destination rank, bytes)``."""
    with count_traffic() as traffic:
        result = ps.train(*args, **kwargs)
    return result | {"rank": dist.get_rank(), "sent": traffic.messages}


def shard_sizes(numel: int, servers: int) -> list[int]:
    """Parameters per server: ``numel`` split as ``tensor_split`` splits it, as
    :func:`labsupport.parallel.parameter_server.train` shards the flat parameters."""
    return [part.stop - part.start for part in even_spans(numel, servers)]


def traffic_formula(numel: int, workers: int, servers: int, rank: int) -> tuple[int, int]:
    """Bytes rank ``rank`` sends and receives per synchronous step, by the protocol.

    A push is a 12-byte header (worker, version, loss) and the gradient shard; a pull
    is the parameter shard and its version (one float32 more). A server of ``n``
    parameters receives ``workers`` pushes and sends ``workers`` pulls.
    """
    sizes = shard_sizes(numel, servers)
    if rank < servers:
        return workers * 4 * (sizes[rank] + 1), workers * (12 + 4 * sizes[rank])
    return 12 * servers + 4 * numel, 4 * (numel + servers)


def traffic_rows(results: list[dict], steps: int, numel: int) -> list[dict]:
    """Per rank: bytes sent and received per step, counted, next to the formula."""
    servers = sum(r["role"] == "server" for r in results)
    received = [0] * len(results)
    for r in results:
        for dst, size in r["sent"]:
            received[dst] += size
    rows = []
    for r in results:
        sent = sum(size for _, size in r["sent"])
        want = traffic_formula(numel, len(results) - servers, servers, r["rank"])
        rows.append(
            {
                "rank": r["rank"],
                "role": r["role"],
                "sent/step": sent // steps,
                "formula": want[0],
                "received/step": received[r["rank"]] // steps,
                "formula ": want[1],
                "exact": sent == steps * want[0] and received[r["rank"]] == steps * want[1],
            }
        )
    return rows


def ring_traffic(numel: int) -> dict:
    """Bytes this rank sends in a ring all-reduce of ``numel`` float32 (run on every
    rank), counted, and by chapter 8's formula."""
    rank, world = dist.get_rank(), dist.get_world_size()
    with count_traffic() as traffic:
        all_reduce(torch.ones(numel, device=device()), algorithm="ring")
    return {
        "rank": rank,
        "sent": traffic.bytes_sent,
        "formula": bytes_sent("ring", numel, 4, world, rank),
    }
