"""The parameter server: synchronous mode is single-process SGD on every worker's batch;
asynchronous mode applies every gradient once and records how stale it was."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from labsupport import LaunchError, launch
from labsupport.parallel import parameter_server as ps

STEPS, PER_WORKER = 4, 8
# float32: the server averages W gradients (W <= 3) in a fixed order and one process
# averages the same samples in one mean; relative differences ~ 1e-7 per step, 4 steps.
TOL = {"rtol": 1e-5, "atol": 1e-6}


def make_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 2))


def batch(worker: int, step: int):
    g = torch.Generator().manual_seed(1000 * step + worker)
    return torch.randn(PER_WORKER, 6, generator=g), torch.randn(PER_WORKER, 2, generator=g)


def single_process_sgd(workers: int, lr: float = 0.1) -> torch.Tensor:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    for step in range(STEPS):
        parts = [batch(w, step) for w in range(workers)]
        x = torch.cat([p[0] for p in parts])
        y = torch.cat([p[1] for p in parts])
        opt.zero_grad()
        F.mse_loss(model(x), y).backward()
        opt.step()
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach()


def run(world, servers, mode, **kw):
    return launch(
        ps.train,
        world,
        args=(make_model, batch, F.mse_loss, STEPS),
        kwargs={"servers": servers, "mode": mode, **kw},
        timeout=120,
    )


def gathered(results) -> torch.Tensor:
    shards = sorted((r["shard"], r["parameters"]) for r in results if r["role"] == "server")
    return torch.cat([p for _, p in shards])


@pytest.mark.parametrize(("world", "servers"), [(2, 1), (4, 1), (4, 2), (5, 2)])
def test_sync_mode_is_sgd_on_the_whole_batch(world, servers):
    results = run(world, servers, "sync")
    torch.testing.assert_close(gathered(results), single_process_sgd(world - servers), **TOL)
    updates = [u for r in results if r["role"] == "server" for u in r["updates"]]
    assert len(updates) == servers * STEPS * (world - servers)
    assert {u["staleness"] for u in updates} == {0}


def test_async_mode_applies_every_gradient_and_records_staleness():
    results = run(4, 1, "async", straggler=(0, 3.0))
    (server,) = [r for r in results if r["role"] == "server"]
    updates = server["updates"]
    assert len(updates) == 3 * STEPS
    assert [u["version"] for u in updates] == list(range(3 * STEPS))
    assert sorted(u["worker"] for u in updates) == sorted(list(range(3)) * STEPS)
    # a gradient is at most as stale as the updates applied since it was computed
    assert all(0 <= u["staleness"] <= u["version"] for u in updates)
    assert updates[0]["staleness"] == 0


def test_bounded_staleness_keeps_fast_workers_close_to_the_slowest():
    results = run(4, 1, "async", staleness_bound=1, straggler=(2, 4.0))
    (server,) = [r for r in results if r["role"] == "server"]
    seen = [0, 0, 0]
    for u in server["updates"]:
        seen[u["worker"]] += 1
        assert max(seen) - min(seen) <= 2, seen  # bound 1, plus the push in flight


def test_bound_zero_keeps_workers_in_step_but_sums_their_gradients():
    # staleness_bound=0 holds every worker until all have pushed, but the server still
    # applies each gradient on its own: one round is SGD with W times the learning rate
    results = run(4, 1, "async", staleness_bound=0)
    (server,) = [r for r in results if r["role"] == "server"]
    assert sorted(u["staleness"] for u in server["updates"]) == sorted([0, 1, 2] * STEPS)
    torch.testing.assert_close(gathered(results), single_process_sgd(3, lr=3 * 0.1), **TOL)


def pulls_once(client, model, batch, loss_fn, steps):
    nn.utils.vector_to_parameters(client.pull(), model.parameters())
    for step in range(steps):
        inputs, targets = batch(client.worker, step)
        model.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        client.push(nn.utils.parameters_to_vector(p.grad for p in model.parameters()), loss)


def test_a_worker_that_pulls_once_trains_on_old_parameters_and_its_pushes_say_so():
    results = run(4, 1, "sync", worker_loop=pulls_once)
    (server,) = [r for r in results if r["role"] == "server"]
    assert [u["staleness"] for u in server["updates"]] == [k for k in range(STEPS) for _ in "abc"]
    assert not torch.allclose(gathered(results), single_process_sgd(3))


def pulls_once_more(client, model, batch, loss_fn, steps):
    ps.work(client, model, batch, loss_fn, steps)
    client.pull()  # for the final parameters: the servers send none


def test_a_pull_after_the_last_push_is_a_clear_error():
    with pytest.raises(LaunchError, match="pull after the last of the 4 pushes"):
        run(2, 1, "sync", worker_loop=pulls_once_more)


def test_too_few_ranks_is_a_clear_error():
    with pytest.raises(LaunchError, match="world_size >= servers \\+ 1"):
        run(2, 2, "sync")
