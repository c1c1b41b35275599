"""How long it takes to start 4 ranks, initialise them and run one all-reduce.

Compares, on the same job and the same machine, in one run:

* ``labsupport.launch`` cold (first launch in a fresh process: the forkserver starts
  and imports torch) and warm (later launches: ranks are forked from it);
* ``torch.multiprocessing.spawn`` (a fresh interpreter per rank);
* ``torchrun`` (its agent, then a fresh interpreter per rank).

Each is timed from the call to the results, the way a notebook cell waits for it:
``launch()`` and ``spawn()`` inside an already running Python that has imported torch,
``torchrun`` as the whole command.

Then what a training cell pays: a warm launch whose ranks create an optimizer and take
one step (forward, backward, all-reduce of the gradients, ``Adam.step``), timed in turns
with the empty warm launch. The targets, checked at the end (the exit code says whether
they held): a warm launch takes at most a fifth of torchrun's time, and the launch with
an optimizer step at most twice the empty one.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import textwrap
import time
from functools import partial

import torch
import torch.distributed as dist

WORLD = 4
REPEATS = {"warm": 10, "cold": 3, "spawn": 3, "torchrun": 3}


def job() -> float:
    """The benchmarked work on every rank: one all-reduce (init is done by the launcher)."""
    t = torch.ones(1)
    dist.all_reduce(t)
    return t.item()


def optimizer_step() -> float:
    """A training cell's first step on every rank: an optimizer, forward, backward, the
    gradients all-reduced, one step (the first ``torch.optim`` object a process creates
    imports ``torch._dynamo``, unless the forkserver already has)."""
    model = torch.nn.Linear(64, 64)
    adam = torch.optim.Adam(model.parameters(), lr=1e-3)
    model(torch.randn(8, 64)).square().mean().backward()
    for p in model.parameters():
        dist.all_reduce(p.grad)
    adam.step()
    return job()


def _spawned(rank: int, world: int, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    job()
    dist.destroy_process_group()


def run_python(code: str) -> float:
    """Run ``code`` in a fresh interpreter; it prints one number, a time in seconds."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        check=True,
        cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
    )
    return float(out.stdout.strip().splitlines()[-1])


def time_cold_launch() -> float:
    return run_python(
        f"""
        import time
        from labsupport import launch
        from bench.launch import job
        start = time.perf_counter()
        assert launch(job, world_size={WORLD}) == [{WORLD}.0] * {WORLD}
        print(time.perf_counter() - start)
        """
    )


def time_warm_launch(fn=job) -> float:
    from labsupport import launch

    start = time.perf_counter()
    assert launch(fn, world_size=WORLD) == [float(WORLD)] * WORLD
    return time.perf_counter() - start


def time_in_turns(runs: dict, repeats: int) -> dict:
    """Time each of ``runs`` ``repeats`` times, in turns, so that load slows all alike."""
    times = {name: [] for name in runs}
    for _ in range(repeats):
        for name, run in runs.items():
            times[name].append(run())
    return times


def time_spawn() -> float:
    return run_python(
        f"""
        import time
        import torch.multiprocessing as mp
        from bench.launch import _spawned
        from labsupport.launch.nodes import free_port
        start = time.perf_counter()
        mp.spawn(_spawned, args=({WORLD}, free_port()), nprocs={WORLD})
        print(time.perf_counter() - start)
        """
    )


def time_torchrun() -> float:
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    start = time.perf_counter()
    subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={WORLD}", "-m", "labsupport.run", "bench.launch:job",
        ],
        check=True, capture_output=True, cwd=root,
    )  # fmt: skip
    return time.perf_counter() - start


def main() -> int:
    times = {
        "labsupport.launch, cold": [time_cold_launch() for _ in range(REPEATS["cold"])],
        "labsupport.launch, warm": None,
        "torch.multiprocessing.spawn": [time_spawn() for _ in range(REPEATS["spawn"])],
        "torchrun": [time_torchrun() for _ in range(REPEATS["torchrun"])],
    }
    time_warm_launch()  # start the forkserver: what follows is warm
    step = "launch + create an optimizer + one step"
    warm_runs = {
        "labsupport.launch, warm": time_warm_launch,
        step: partial(time_warm_launch, optimizer_step),
    }
    times.update(time_in_turns(warm_runs, REPEATS["warm"]))
    medians = {name: statistics.median(ts) for name, ts in times.items()}
    warm = medians["labsupport.launch, warm"]
    print(f"\n{WORLD} ranks, init + one all_reduce, from the call to the results (median)")
    print(f"{'launcher':40s} {'median':>9s} {'min':>9s} {'runs':>5s} {'x warm launch':>14s}")
    for name, ts in times.items():
        print(
            f"{name:40s} {medians[name]:8.3f}s {min(ts):8.3f}s {len(ts):5d} "
            f"{medians[name] / warm:13.1f}x"
        )
    ratio, cost = medians["torchrun"] / warm, medians[step] / warm
    fast, cheap = ratio >= 5, cost <= 2
    print(f"\ntarget: a warm launch takes at most 1/5 of torchrun's time -> torchrun / warm = "
          f"{ratio:.1f} ({'met' if fast else 'MISSED'})")  # fmt: skip
    print(f"target: {step} within 2x of the empty launch -> {cost:.1f}x "
          f"({'met' if cheap else 'MISSED'})")  # fmt: skip
    return 0 if fast and cheap else 1


if __name__ == "__main__":
    sys.exit(main())
