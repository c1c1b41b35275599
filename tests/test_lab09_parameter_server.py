"""Lab 9, the parameter server: the bytes through the server counted against the protocol's
formula, the records read back, the simulated timelines, the drawings, and the exercises'
checkers against the notebook's solutions and common mistakes, one of which waits for a
message no server sends and must come back as a timeout. (The server itself is tested in
tests/test_parallel_ps.py.)"""

from __future__ import annotations

import matplotlib
import matplotlib.pyplot as plt
import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from matplotlib.text import Text
from notebook_solutions import solution
from test_lab07_collectives import checks
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from labsupport import launch
from labsupport.labs import lab09_exercises as exercises
from labsupport.labs import lab09_parameter_server as lab
from labsupport.parallel import parameter_server as ps
from labsupport.viz import parameter_server as draw

matplotlib.use("Agg")
LAB = "09-parameter-server.ipynb"


@pytest.fixture(autouse=True)
def close_figures():
    yield
    plt.close("all")


def texts(fig) -> list[str]:
    return [t.get_text() for t in fig.findobj(Text) if t.get_text()]


@pytest.mark.parametrize(("world", "servers"), [(3, 1), (4, 2)])
def test_counted_bytes_equal_the_protocol_formula(world, servers):
    steps = 2
    results = launch(
        lab.counted_train,
        world,
        args=(lab.make_model, lab.batch, F.mse_loss, steps),
        kwargs={"mode": "sync", "servers": servers},
        timeout=120,
    )
    numel = sum(p.numel() for p in lab.make_model().parameters())
    rows = lab.traffic_rows(results, steps, numel)
    assert [row["role"] for row in rows] == ["server"] * servers + ["worker"] * (world - servers)
    assert all(row["exact"] for row in rows)
    # the server's share: every worker's gradient shard in, the shard and its version out
    workers, shard = world - servers, lab.shard_sizes(numel, servers)[0]
    assert rows[0]["received/step"] == workers * (12 + 4 * shard)


def test_shard_sizes_split_as_tensor_split():
    assert lab.shard_sizes(5508, 1) == [5508]
    assert lab.shard_sizes(10, 3) == [4, 3, 3]
    assert sum(lab.shard_sizes(5508, 7)) == 5508


def test_ring_traffic_is_chapter_8s_formula():
    for r in launch(lab.ring_traffic, 3, args=(5508,), timeout=60):
        assert r["sent"] == r["formula"] == 2 * 2 * 5508 * 4 // 3


def test_single_process_sgd_is_what_the_synchronous_server_does():
    results = launch(
        lab.counted_train, 3, args=(lab.make_model, lab.batch, F.mse_loss, 2), timeout=60
    )
    difference = (lab.gathered(results) - lab.single_process_sgd(2, 2, lr=0.1)).abs().max()
    assert difference <= 2 * 0.1 * (2 * lab.BATCH) * 2**-24  # the lab's tolerance


def test_while_all_run_stops_when_the_first_worker_is_done():
    updates = [
        {"worker": w, "time": t, "version": v}
        for v, (w, t) in enumerate([(0, 1.0), (1, 1.5), (0, 2.0), (1, 3.0), (1, 4.0)])
    ]
    rates = lab.while_all_run(updates)
    assert rates["seconds"] == 2.0  # worker 0 pushed its last at 2.0
    assert rates["pushes"] == 3 and rates["pushes_per_s"] == 1.5
    assert rates["updates"] == 3  # asynchronous: one update per gradient


def test_while_all_run_counts_only_the_rounds_a_synchronous_server_finished():
    # two workers, two rounds: by the time worker 0 pushes its last gradient (2.0),
    # round 0 is complete and round 1 still waits for worker 1
    updates = [
        {"worker": w, "time": t, "version": v}
        for w, t, v in [(0, 1.0, 0), (1, 1.5, 0), (0, 2.0, 1), (1, 3.0, 1)]
    ]
    rates = lab.while_all_run(updates)
    assert rates["pushes"] == 3 and rates["updates"] == 1


def test_simulate_sync_waits_for_the_slowest_and_async_does_not():
    sync = draw.simulate([1.0, 1.0, 4.0], "sync", until=8.0)
    assert [u["time"] for u in sync["updates"]] == [4.0] * 3 + [8.0] * 3
    assert {u["staleness"] for u in sync["updates"]} == {0}
    asynchronous = draw.simulate([1.0, 1.0, 4.0], "async", until=8.0)
    order = [u["worker"] for u in asynchronous["updates"]]
    assert order.count(0) == order.count(1) == 8 and order.count(2) == 2
    # the records follow the same rule as the real server (exercise 2's model)
    staleness = [u["staleness"] for u in asynchronous["updates"]]
    assert staleness == exercises.simulate_staleness(order, 3)
    assert max(staleness) >= 7  # the straggler's gradients: 8 updates of the others


def test_chapter_figures_show_their_data():
    fig = draw.sync_async_figure()
    assert {"server", "worker 0", "worker 2"} <= set(texts(fig))
    traffic = draw.server_traffic_figure()
    assert len(traffic.axes[0].lines) == 3
    one_server = traffic.axes[0].lines[0].get_ydata()
    assert one_server[-1] == pytest.approx(1024 * 4 * draw.GPT2_SMALL_PARAMS / 1e9)


def test_lab_drawings_show_every_run():
    updates = [
        {"worker": w, "time": 0.1 * i, "staleness": i % 3, "loss": 1.0 / (i + 1), "version": i}
        for i, w in enumerate([0, 1, 2] * 3)
    ]
    runs = {"a": updates, "b": updates}
    assert len(draw.draw_pushes(runs, workers=3).axes) == 2
    left, right = draw.draw_losses(runs).axes
    assert len(left.lines) == len(right.lines) == 2
    bars = draw.draw_staleness(runs).axes[0].patches
    assert len(bars) == 2 * 3  # two runs, staleness 0, 1 and 2


# --------------------------------------------------------------------------- exercises


def loop(client, model, batch, loss_fn, steps, pull_every_step=True, push="grad", zero=True):
    """The worked solution's loop, with a switch for each mistake below."""
    for step in range(steps):
        if step == 0 or pull_every_step:
            vector_to_parameters(client.pull(), model.parameters())
        inputs, targets = batch(client.worker, step)
        if zero:
            model.zero_grad()
        loss = loss_fn(model(inputs), targets)
        loss.backward()
        grads = (p.grad if push == "grad" else p.detach() for p in model.parameters())
        client.push(parameters_to_vector(grads), loss.item())


def pushes_the_weights(client, model, batch, loss_fn, steps):
    loop(client, model, batch, loss_fn, steps, push="weights")


def pulls_only_once(client, model, batch, loss_fn, steps):
    """Trains on the first parameters for ever: its pushes report version 0."""
    loop(client, model, batch, loss_fn, steps, pull_every_step=False)


def never_zeroes_the_gradients(client, model, batch, loss_fn, steps):
    """Each push carries the sum of the gradients of every step so far."""
    loop(client, model, batch, loss_fn, steps, zero=False)


def receives_the_parameters_itself(client, model, batch, loss_fn, steps):
    """Waits for parameters of its own before it pushes: the server sent the first ones at
    the start (the client has them) and sends more only in answer to a push. Every rank
    waits: the workers for the server, the server for their pushes."""
    incoming = torch.empty(sum(p.numel() for p in model.parameters()) + 1)
    dist.recv(incoming, src=0)
    ps.work(client, model, batch, loss_fn, steps)


def test_check_worker_loop(capsys):
    mistakes = [
        (
            pushes_the_weights,
            r"rank 0: the server's parameter vector after 4 synchronous steps differs at .*: "
            r"expected .*shrank by a factor 1 - lr = 0.7 .*you pushed the weights",
        ),
        (
            pulls_only_once,
            r"worker \d's gradient was computed on version 0 of the parameters while the "
            r"server was at 1: pull before each step",
        ),
        (never_zeroes_the_gradients, r"zero the gradients before each backward"),
    ]
    verified = "synchronously, the server ends with one process's parameters after 4 steps"
    checks(capsys, exercises.check_worker_loop, LAB, "worker_loop", verified, mistakes)
    with pytest.raises(AssertionError, match="did not all finish within 20 s") as info:
        exercises.check_worker_loop(receives_the_parameters_itself, timeout=20)
    assert "wait for no message of its own (dist.recv)" in str(info.value)


def test_check_server_bytes(capsys):
    mistakes = [
        (lambda n, w, s: 4 * n // s, "one worker's push"),
        (lambda n, w, s: w * 4 * n, "the whole gradient"),
        (lambda n, w, s: w * n // s, "counts parameters"),
        (lambda n, w, s: 2 * (w - 1) * 4 * n // w, "than the server receives"),
        (lambda n, w, s: None, "should return a number"),
    ]
    verified = "the bytes a server receives per step"
    checks(capsys, exercises.check_server_bytes, LAB, "server_bytes", verified, mistakes)


def pulls_after_its_own_update(order, workers):
    """Counts its own update too: off by one."""
    return [s + 1 for s in solution(LAB, "staleness_of")(order, workers)]


def counts_from_the_start(order, workers):
    """Every update so far, not those since the worker pulled."""
    return list(range(len(order)))


def test_check_staleness(capsys):
    mistakes = [
        (pulls_after_its_own_update, "after\\* its own update"),
        (counts_from_the_start, "every worker in turn, .*push 3 should have staleness 2, got 3"),
        (lambda order, workers: None, "should return a list"),
    ]
    verified = "the staleness of every push"
    checks(capsys, exercises.check_staleness, LAB, "staleness_of", verified, mistakes)
