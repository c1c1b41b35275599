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
one step (forward, backward, all-reduce of the gradients, ``Adam.step``).

The floor: starting 4 processes as bare as a process starts, ``os.fork`` without ``exec``
from this Python that has imported torch, each child leaving at once, waited for. Every
launcher runs in turns with it and with a warm launch, round after round (the slow ones
in fewer rounds, each round with its own warm launch and fork); each ratio is the median
over the rounds of the pair's. The targets, checked at the end (the exit code says
whether they held): a warm launch takes at most a fifth of torchrun's time, and the
launch with an optimizer step at most twice the empty one.
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

from bench import report

WORLD = 4
ROUNDS = {"warm": 10, "slow": 3}  # rounds of the warm launches, of the slow launchers


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


def time_bare_fork(processes: int = WORLD) -> float:
    """Seconds to fork ``processes`` children that exit at once (no ``exec``), and reap
    them: the least a launcher of that many ranks pays."""
    start = time.perf_counter()
    children = []
    for _ in range(processes):
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        children.append(pid)
    for pid in children:
        os.waitpid(pid, 0)
    return time.perf_counter() - start


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


WARM, STEP = "labsupport.launch, warm", "launch + create an optimizer + one step"
FORK = f"bare fork of {WORLD} processes"


def summarise(warm: dict, slow: dict) -> list[dict]:
    """The bench's lines: each launcher against the warm launch run beside it, and
    against the bare fork run beside it."""
    lines = [report.line(FORK, statistics.median(warm[FORK]), "s")]
    for times in (warm, slow):
        for name, ts in times.items():
            if name == FORK or (times is slow and name == WARM):
                continue
            vs = None if name == WARM else (WARM, report.paired(ts, times[WARM]))
            floor = f"{FORK} (os.fork, no exec, from this Python with torch imported)"
            lines.append(
                report.line(
                    name, statistics.median(ts), "s", report.paired(ts, times[FORK]), floor, vs
                )
            )
    return lines


def main() -> int:
    time_warm_launch()  # start the forkserver: what follows is warm
    warm = report.in_turns(
        {
            FORK: time_bare_fork,
            WARM: time_warm_launch,
            STEP: partial(time_warm_launch, optimizer_step),
        },
        ROUNDS["warm"],
    )
    slow = report.in_turns(
        {
            FORK: time_bare_fork,
            WARM: time_warm_launch,
            "labsupport.launch, cold": time_cold_launch,
            "torch.multiprocessing.spawn": time_spawn,
            "torchrun": time_torchrun,
        },
        ROUNDS["slow"],
    )
    print(
        f"\n{WORLD} ranks, init + one all_reduce, from the call to the results; "
        f"{ROUNDS['warm']} rounds of the warm launches in turns with a bare fork, "
        f"{ROUNDS['slow']} of the slow ones, each beside a warm launch and a bare fork"
    )
    lines = summarise(warm, slow)
    report.print_lines(lines, "x warm launch")
    fast = report.paired(slow["torchrun"], slow[WARM])
    cost = report.paired(warm[STEP], warm[WARM])
    targets = [
        report.target("a warm launch takes at most 1/5 of torchrun's time, torchrun / warm",
                      str(fast), fast.median >= 5),
        report.target(f"{STEP} within 2x of the empty launch", str(cost), cost.median <= 2),
    ]  # fmt: skip
    return report.record("launch", {"world": WORLD, "rounds": ROUNDS}, lines, targets)


if __name__ == "__main__":
    sys.exit(main())
