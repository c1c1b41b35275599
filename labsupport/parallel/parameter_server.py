"""A parameter server: server ranks hold the parameters, worker ranks compute gradients.

The architecture of DistBelief's Downpour SGD (Dean et al. 2012) and of Li et al.'s
parameter server (OSDI 2014), which data parallelism grew from. Ranks ``0 .. servers-1``
are servers; each holds one shard of the flattened parameters (``tensor_split``). The
other ranks are workers: each pulls the parameters, computes the gradient of its own
batch, and pushes it back, shard by shard, over point-to-point messages.

* ``mode="sync"``: a server waits for every worker's gradient, averages them (in worker
  order), takes one SGD step and sends the new parameters to every worker: step for step
  the same as one process doing SGD on all the workers' batches together.
* ``mode="async"``: a server applies each gradient as it arrives and answers that worker
  at once. Each update records its *staleness*, the server's version now minus the
  version the gradient was computed on. ``staleness_bound=s`` makes it stale-synchronous
  (Ho et al. 2013): a worker more than ``s`` pushes ahead of the slowest waits, so the
  server's record shows it at most ``s + 1`` ahead (the push in flight). Each gradient is
  still applied on its own, with the full ``lr``: ``staleness_bound=0`` keeps the
  workers in step, but it sums a round's gradients (staleness 0 to W-1) where
  ``mode="sync"`` averages them.

A worker talks to the servers through a :class:`Client`. A server sends every worker the
parameters once at the start, then answers each push with the parameters the worker is
to go on with (its shard and version): at once asynchronously, once every worker has
pushed synchronously, never after a worker's last push. :meth:`Client.push` sends the
gradient and waits for that answer; :meth:`Client.pull` hands over the parameters last
received, with their version, which the next push reports. A push is two messages: a
small header (worker, version pulled, loss) on a gloo group, which a server can receive
*from any sender* (gloo supports it, NCCL does not), then the gradient shard on the
default group, from that sender, on :func:`labsupport.launch.device`. Every byte sent
goes through :mod:`labsupport.comm.p2p` and is counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labsupport.comm.flat import even_spans
from labsupport.comm.p2p import Group, isend
from labsupport.launch.runtime import device

MODES = ("sync", "async")


def train(
    make_model: Callable[[], nn.Module],
    batch: Callable[[int, int], tuple],
    loss_fn: Callable,
    steps: int,
    servers: int = 1,
    mode: str = "sync",
    lr: float = 0.1,
    staleness_bound: int | None = None,
    straggler: tuple[int, float] | None = None,
    worker_loop: Callable | None = None,
) -> dict:
    """Run on every rank: parameter-server SGD for ``steps`` pushes per worker.

    ``make_model()`` builds the same model on every rank (seed it); ``batch(worker, step)``
    gives worker ``worker`` (0-based) its ``(inputs, targets)`` for ``step``;
    ``loss_fn(outputs, targets)``. ``straggler=(worker, factor)`` makes one worker take
    ``factor`` times as long per step (it sleeps the difference). ``worker_loop(client,
    model, batch, loss_fn, steps)`` replaces the workers' loop, :func:`work` (lab 9's
    exercise); ``batch`` then gives tensors on the model's device.

    Returns, on servers, ``{"role": "server", "shard": (start, stop), "updates": [...],
    "parameters": final shard}`` with one record per update (``worker``, ``staleness``,
    ``version``, ``loss``, ``time`` since the start); on workers, ``{"role": "worker",
    "losses": [...], "parameters": the last parameters pulled}``.
    """
    world = dist.get_world_size()
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    if not 1 <= servers < world:
        raise ValueError(
            f"{servers} server(s) and {world} ranks leave {world - servers} workers; "
            "use at least one server and one worker (world_size >= servers + 1)"
        )
    control = dist.new_group(backend="gloo")  # every rank takes part in creating it
    model = make_model().to(device())
    flat = parameters_to_vector(model.parameters()).detach()
    bounds = [(s.start, s.stop) for s in even_spans(flat.numel(), servers)]
    start = time.perf_counter()
    if dist.get_rank() < servers:
        return _serve(
            flat, bounds, world - servers, servers, steps, mode, lr, staleness_bound, control, start
        )
    client = Client(bounds, steps, control)

    def on_device(worker: int, step: int) -> tuple:
        return tuple(t.to(device()) for t in batch(worker, step))

    if worker_loop is None:
        work(client, model, on_device, loss_fn, steps, straggler)
    else:
        worker_loop(client, model, on_device, loss_fn, steps)
    return {"role": "worker", "losses": client.losses, "parameters": client.flat.cpu()}


def _serve(flat, bounds, workers, servers, steps, mode, lr, bound, control, start):
    me = dist.get_rank()
    lo, hi = bounds[me]
    shard = flat[lo:hi].clone()
    g = Group()
    version, updates = 0, []
    for w in range(workers):  # the initial parameters
        isend(g, torch.cat([shard, _scalar(version)]), servers + w).wait()
    header, grad = torch.zeros(3), torch.empty_like(shard)
    clock = [0] * workers  # pushes received from each worker
    deferred: list[int] = []  # workers waiting for the slowest (stale-synchronous)
    pending: dict[int, torch.Tensor] = {}
    for _ in range(steps * workers):
        sender = dist.recv(header, group=control)  # from any worker
        dist.recv(grad, src=sender)
        worker, seen, loss = int(header[0]), int(header[1]), float(header[2])
        clock[worker] += 1
        record = {
            "worker": worker,
            "version": version,
            "loss": loss,
            "time": time.perf_counter() - start,
        }
        if mode == "sync":
            pending[worker] = grad.clone()
            record["staleness"] = version - seen
            updates.append(record)
            if len(pending) == workers:  # everyone has pushed: one averaged step
                shard -= lr * sum(pending[w] for w in range(workers)) / workers
                version += 1
                pending.clear()
                for w in range(workers):
                    if clock[w] < steps:  # the last step's parameters have no one to go to
                        isend(g, torch.cat([shard, _scalar(version)]), servers + w).wait()
            continue
        record["staleness"] = version - seen
        shard -= lr * grad
        version += 1
        updates.append(record)
        deferred.append(worker)
        for w in [w for w in deferred if bound is None or clock[w] - min(clock) <= bound]:
            deferred.remove(w)
            if clock[w] < steps:  # a worker that pushed its last gradient waits no more
                isend(g, torch.cat([shard, _scalar(version)]), servers + w).wait()
    return {"role": "server", "shard": (lo, hi), "updates": updates, "parameters": shard.cpu()}


class Client:
    """A worker's side of the protocol, every server at once, shard by shard: ``worker``
    is this worker's number (0-based), ``losses`` the loss sent with each push."""

    def __init__(self, bounds: list[tuple[int, int]], steps: int, control):
        self.bounds, self.steps = bounds, steps
        self.worker = dist.get_rank() - len(bounds)
        self.g, self.gc = Group(), Group(control)
        self.flat = torch.empty(bounds[-1][1], device=device())  # the parameters received
        self.received = [0] * len(bounds)  # their versions, shard by shard
        self.pulled = [0] * len(bounds)  # the versions pull() last handed over
        self.losses: list[float] = []
        self._incoming = [torch.empty(hi - lo + 1, device=device()) for lo, hi in bounds]
        self._receive()  # the initial parameters, which every server sends at the start

    def _receive(self) -> None:
        for s, (buf, (lo, hi)) in enumerate(zip(self._incoming, self.bounds, strict=True)):
            dist.recv(buf, src=s)
            self.flat[lo:hi] = buf[:-1]
            self.received[s] = int(buf[-1])

    def pull(self) -> torch.Tensor:
        """The parameters the servers last sent, as one flat vector
        (``vector_to_parameters`` loads it into a model); the next push reports their
        version, from which the server counts the gradient's staleness."""
        if len(self.losses) == self.steps:
            raise RuntimeError(
                f"pull after the last of the {self.steps} pushes: the servers send no "
                "parameters after a worker's last push. Pull before each step's gradient."
            )
        self.pulled = list(self.received)
        return self.flat.clone()

    def push(self, grad: torch.Tensor, loss: float) -> None:
        """Send every server its shard of ``grad``, flat as ``parameters_to_vector`` gives
        it, with the version pulled and the batch's ``loss``; then, unless it was the
        last push, wait for the servers' answer, the parameters to go on with."""
        if grad.numel() != self.flat.numel():
            raise ValueError(
                f"push a flat vector of all {self.flat.numel()} gradients, not "
                f"{grad.numel()}: parameters_to_vector(p.grad for p in model.parameters())"
            )
        if len(self.losses) == self.steps:
            raise RuntimeError(f"push {self.steps + 1} of a run of {self.steps} steps")
        self.losses.append(float(loss))
        grad = grad.detach().to(device())
        for s, (lo, hi) in enumerate(self.bounds):
            isend(self.gc, torch.tensor([self.worker, self.pulled[s], float(loss)]), s).wait()
            isend(self.g, grad[lo:hi].contiguous(), s).wait()
        if len(self.losses) < self.steps:
            self._receive()


def work(client: Client, model: nn.Module, batch, loss_fn, steps: int, straggler=None) -> None:
    """A worker's loop (Downpour SGD's): pull the parameters, compute the gradient of its
    own batch, push it; ``steps`` times."""
    for step in range(steps):
        vector_to_parameters(client.pull(), model.parameters())
        begin = time.perf_counter()
        inputs, targets = batch(client.worker, step)
        model.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        if straggler is not None and straggler[0] == client.worker:
            time.sleep((straggler[1] - 1) * (time.perf_counter() - begin))
        client.push(parameters_to_vector(p.grad for p in model.parameters()), loss.item())


def _scalar(value: float) -> torch.Tensor:
    return torch.tensor([float(value)], device=device())
