"""Run a function on N ranks, each a process with ``torch.distributed`` initialised.

``launch(fn, world_size=4)`` does, inside a notebook, what ``torchrun`` does on a node
(``torch/distributed/run.py`` and its ``LocalElasticAgent``):

* it hosts the rendezvous ``TCPStore`` itself and gives every rank the torchrun
  environment, with ``TORCHELASTIC_USE_AGENT_STORE=True`` so that the ranks connect to
  that store as torchrun's workers connect to their agent's;
* it starts one process per rank and watches all of them: the first rank that fails
  brings the others down, and its traceback is raised here as :class:`LaunchError`;
* it streams every rank's output into the calling cell, and leaves a rank-ordered
  record behind, so a stored notebook output does not depend on timing.

Unlike torchrun, it does not start a fresh interpreter per rank. A *forkserver*
(``multiprocessing``'s "forkserver" start method) imports ``torch`` once, with what a
rank's first optimizer needs (:mod:`~labsupport.launch.preload`), and each rank is a fork
of that server: the Jupyter kernel itself, which runs threads, is never forked, and a
launch costs a tenth of a second instead of seconds.

A launch that fails, times out or is interrupted also stops what its ranks started in
sessions of their own (:mod:`~labsupport.launch.leftovers`).

Everything a launch listens on is on the loopback interface
(:mod:`~labsupport.launch.loopback`): the store, and the ranks' gloo and NCCL sockets.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import itertools
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import signal
import sys
import time
import types

import cloudpickle

from labsupport.launch import leftovers, loopback, runtime
from labsupport.launch.errors import (
    LaunchError,
    RankFailure,
    code_files,
    innermost_frames,
    raise_failure,
    restore_sources,
)
from labsupport.launch.ranks import STREAM_GRACE_S, LiveView, NullView, RankProcess

#: How long the other ranks get, after the first failure, to report their own errors.
FAILURE_GRACE_S = 1.0
#: How long hung ranks get, on timeout, to print where they are stuck.
STACK_DUMP_S = 0.5

_launch_ids = itertools.count(1)
_started = False  # whether this process has started the forkserver yet


class LaunchInterrupted(KeyboardInterrupt):
    """The launch was interrupted (Ctrl-C, or Kernel > Interrupt); every rank was stopped."""

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: one line, not the launcher's frames."""
        return [f"\x1b[31mKeyboardInterrupt\x1b[39m: {self}"]


#: What the forkserver imports before it forks any rank.
PRELOAD = ["labsupport.launch.preload"]


def _context():
    """The forkserver context; its server imports torch and the rest of :data:`PRELOAD`
    once."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def warm_up() -> None:
    """Start the forkserver now, so that the first launch is as quick as the next."""
    global _started
    _context()
    multiprocessing.forkserver.ensure_running()
    _started = True


def stop_forkserver() -> bool:
    """Stop the forkserver, and with it any rank still running (each dies with its
    parent), as ``multiprocessing`` does at exit: the next launch starts a new one, which
    imports every module afresh. Whether one was running."""
    global _started
    server = multiprocessing.forkserver._forkserver
    running = server._forkserver_pid is not None
    server._stop()  # closes the pipe the server watches, then waits for it to exit
    _started = False
    return running


class _Pickler(cloudpickle.Pickler):
    """cloudpickle, with every importable module pickled by name.

    cloudpickle does so only for objects whose type is exactly ``ModuleType``. torch's
    config modules (``torch.distributed.config``) are a subclass, and cloudpickle takes
    a submodule along with a function whose code names it: any notebook function that
    uses ``dist`` and an attribute called ``config`` (``model.config``).
    """

    def reducer_override(self, obj):
        if isinstance(obj, types.ModuleType) and sys.modules.get(obj.__name__) is obj:
            return importlib.import_module, (obj.__name__,)
        return super().reducer_override(obj)


def _pickle_job(fn, args, kwargs) -> bytes:
    try:
        buffer = io.BytesIO()
        job = (fn, tuple(args), dict(kwargs))
        _Pickler(buffer, protocol=cloudpickle.DEFAULT_PROTOCOL).dump(job)
        return buffer.getvalue()
    except Exception as exc:
        raise LaunchError(
            f"cannot send the function and its arguments to the ranks: {exc}. "
            "Each rank receives a pickled copy of fn, args and kwargs; pass values that "
            "pickle (tensors, numbers, strings, lists, dicts) and create other objects "
            "(files, locks, sockets, process groups) inside fn."
        ) from exc


def rank_environment(rank: int, world_size: int, port: int, run_id: str, extra) -> dict:
    """The environment torchrun gives a worker, for a single node; gloo's and NCCL's
    sockets on the loopback interface (``extra`` may say otherwise)."""
    env = dict(os.environ)
    env.update(loopback.environment())
    env.update(extra or {})
    env.update(
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_WORLD_SIZE=str(world_size),
        GROUP_RANK="0",
        GROUP_WORLD_SIZE="1",
        ROLE_NAME="default",
        ROLE_RANK=str(rank),
        ROLE_WORLD_SIZE=str(world_size),
        MASTER_ADDR=loopback.LOOPBACK,
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=str(_threads_per_rank(world_size)),
        LABSUPPORT_LIVE="1",  # progress reports go to the launcher's live view
    )
    return env


def _threads_per_rank(world_size: int) -> int:
    """The cores shared out among the ranks (at least one each), or ``LABSUPPORT_THREADS``.

    Ranks that each start as many threads as the machine has cores oversubscribe it
    ``world_size`` times over; the variable lets a test run the same labs with one or
    with several threads per rank.
    """
    if os.environ.get("LABSUPPORT_THREADS"):
        return int(os.environ["LABSUPPORT_THREADS"])
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return max(1, (cores or 1) // world_size)


def _check_arguments(fn, world_size, timeout) -> None:
    if not callable(fn):
        raise TypeError(f"launch() needs a function to run on each rank, got {fn!r}")
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(f"timeout must be a positive number of seconds, got {timeout!r}")


def launch(
    fn,
    world_size: int = 4,
    args: tuple = (),
    kwargs: dict | None = None,
    backend: str = "auto",
    timeout: float = 300,
    env: dict | None = None,
) -> list:
    """Run ``fn(*args, **kwargs)`` on ``world_size`` ranks and return their results.

    Each rank is its own process with the default process group initialised
    (``backend="auto"``: gloo for CPU tensors and NCCL for CUDA tensors when every rank
    can have a GPU of its own, gloo alone otherwise) and the environment torchrun
    would give it. ``fn`` may be defined in the notebook: it travels to the ranks
    pickled by value (cloudpickle).
    ``env`` adds environment variables for the ranks only.

    Returns the ranks' return values, ordered by rank. Raises :class:`LaunchError`
    naming the root-cause rank with its traceback when a rank fails (every other rank
    is stopped first), and :class:`LaunchTimeout` after ``timeout`` seconds.
    """
    __tracebackhide__ = True  # IPython and pytest show the ranks' traceback, not ours
    _check_arguments(fn, world_size, timeout)
    try:
        backend = runtime.resolve_backend(backend, world_size)
    except ValueError as exc:
        raise LaunchError(str(exc)) from None
    payload = _pickle_job(fn, args, kwargs or {})
    ctx = _context()
    global _started

    store = loopback.store_server()  # the kernel hosts the rendezvous store, on 127.0.0.1
    run_id = f"labsupport-{os.getpid()}-{next(_launch_ids)}"
    files = code_files(fn)
    view = LiveView(world_size, first=not _started)
    ranks: list[RankProcess] = []
    try:
        for rank in range(world_size):
            job = {
                "payload": payload,
                "env": rank_environment(rank, world_size, store.port, run_id, env),
                "backend": backend,
                "timeout": timeout,
                "num_threads": _threads_per_rank(world_size),
            }
            ranks.append(_start_rank(ctx, rank, job))
            _started = True
        _supervise(ranks, time.monotonic() + timeout, view)
        for r in ranks:
            if r.failure is not None:
                r.failure.traceback = restore_sources(r.failure.traceback, files)
    except KeyboardInterrupt:
        for r in ranks:
            r.kill()
        stopped = (
            f"all {world_size} ranks were stopped" if world_size > 1 else "the rank was stopped"
        )
        raise LaunchInterrupted(f"launch interrupted; {stopped}.") from None
    finally:
        for r in ranks:
            r.kill()
        if any(r.failure is not None or not r.exited for r in ranks):
            # what the failed or stopped ranks started in sessions of their own
            leftovers.stop(leftovers.started_by(run_id))
        for r in ranks:
            r.close()
        del store
        view.finish(ranks)
    return _outcome(ranks, timeout)


def _start_rank(ctx, rank: int, job: dict) -> RankProcess:
    result_r, result_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    err_r, err_w = ctx.Pipe(duplex=False)
    from labsupport.launch.worker import rank_main

    process = ctx.Process(
        target=rank_main,
        args=(job, result_w, out_w, err_w),
        name=f"rank{rank}",
        daemon=False,
    )
    try:
        process.start()
    finally:
        for conn in (result_w, out_w, err_w):
            conn.close()
    return RankProcess(rank, process, result_r, out_r, err_r)


def _supervise(ranks: list[RankProcess], deadline: float, view: LiveView) -> None:
    """Wait for every rank; stop them all soon after the first failure or at the deadline."""
    first_failure = None
    while not all(r.done for r in ranks):
        now = time.monotonic()
        if first_failure is not None and now > first_failure + FAILURE_GRACE_S:
            _stop_survivors(ranks, "stopped", "stopped by the launcher after another rank failed")
            return
        if now > deadline:
            hung = [r for r in ranks if not r.exited and r.message is None]
            _dump_stacks(hung, view)
            _stop_survivors(ranks, "stopped", "stopped by the launcher at the timeout")
            for r in hung:
                stack = innermost_frames("\n".join(r.lines["stderr"]))
                r.failure = RankFailure(r.rank, "timeout", "still running at the timeout", stack)
            return
        for r in ranks:
            if r.exited and r.streams and now > r.exited_at + STREAM_GRACE_S:
                r.drain(view, grace=0)
        pairs = [(w, r) for r in ranks for w in r.waitables()]
        owners = {id(w): r for w, r in pairs}
        ready = multiprocessing.connection.wait([w for w, _ in pairs], timeout=0.1)
        view.poll()
        for item in ready:
            rank = owners[id(item)]
            if item is rank.result_conn:
                rank.read_result()
            elif item in rank.streams:
                for stream, text in rank.read_stream(item):
                    view.line(rank.rank, stream, text)
        for rank in {owners[id(item)] for item in ready}:
            if not rank.exited and rank.process.sentinel in ready:
                rank.reap()
                if rank.failure is not None and first_failure is None:
                    first_failure = time.monotonic()
        if first_failure is None and any(r.message and r.message[0] == "error" for r in ranks):
            first_failure = time.monotonic()


def _dump_stacks(running: list[RankProcess], view: LiveView) -> None:
    """Ask hung ranks to print their Python stacks (faulthandler on SIGUSR1)."""
    for r in running:
        with contextlib.suppress(ProcessLookupError):
            os.kill(r.process.pid, signal.SIGUSR1)
    end = time.monotonic() + STACK_DUMP_S
    while time.monotonic() < end:
        conns = [c for r in running for c in r.streams]
        for conn in multiprocessing.connection.wait(conns, timeout=0.05):
            for r in running:
                if conn in r.streams:
                    for stream, text in r.read_stream(conn):
                        view.line(r.rank, stream, text)


def _stop_survivors(ranks: list[RankProcess], kind: str, summary: str) -> None:
    """Kill every rank still running; those that had not reported get ``kind``."""
    for r in ranks:
        r.kill()
    for r in ranks:
        if r.exited:
            continue
        r.reap()
        r.drain(NullView())
        if r.message is None:
            r.failure = RankFailure(r.rank, kind, summary, "\n".join(r.lines["stderr"][-40:]))


def _outcome(ranks: list[RankProcess], timeout: float) -> list:
    __tracebackhide__ = True
    failures = {r.rank: r.failure for r in ranks if r.failure is not None}
    if not failures:
        results = []
        for r in ranks:
            try:
                results.append(cloudpickle.loads(r.message[1]))
            except Exception as exc:
                raise LaunchError(
                    f"rank {r.rank} returned a value this process cannot unpickle: {exc}"
                ) from exc
        return results
    raise_failure(failures, timeout)
