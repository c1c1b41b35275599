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
(``multiprocessing``'s "forkserver" start method) imports ``torch`` once, and each rank
is a fork of that server: the Jupyter kernel itself, which runs threads, is never
forked, and a launch costs milliseconds instead of seconds.
"""

from __future__ import annotations

import contextlib
import html
import inspect
import itertools
import linecache
import multiprocessing
import multiprocessing.connection
import multiprocessing.forkserver
import os
import pickle
import re
import signal
import sys
import time
import types
from dataclasses import dataclass, field

import cloudpickle

from labsupport import runtime

#: How long the other ranks get, after the first failure, to report their own errors.
FAILURE_GRACE_S = 1.0
#: How long hung ranks get, on timeout, to print where they are stuck.
STACK_DUMP_S = 0.5
#: How long the output pipes of an exited rank may stay open before they are closed.
STREAM_GRACE_S = 2.0

_launch_ids = itertools.count(1)
_KNOCK_ON_HINTS = (
    "connection closed by peer",
    "connection reset by peer",
    "broken pipe",
    "socket timeout",
    "distnetworkerror",
    "distbackenderror",
    "communicator was aborted",
    "timed out",
)


class LaunchError(RuntimeError):
    """A launch failed. ``failures`` maps rank to :class:`RankFailure`; ``root_rank``
    is the rank whose failure came first (the root cause), or ``None``."""

    def __init__(self, message: str, failures: dict | None = None, root_rank=None):
        super().__init__(message)
        self.failures = failures or {}
        self.root_rank = root_rank

    def _render_traceback_(self) -> list[str]:
        """What IPython shows: the ranks' tracebacks, not the launcher's own frames."""
        return [f"\x1b[31m{type(self).__name__}\x1b[39m: {self}"]


class LaunchTimeout(LaunchError):
    """The launch ran past its ``timeout``; ``failures`` names the ranks still running."""


@dataclass
class RankFailure:
    """Why one rank did not return: ``kind`` is ``"exception"``, ``"signal"``, ``"exit"``,
    ``"timeout"`` or ``"stopped"`` (stopped by the launcher after another rank failed)."""

    rank: int
    kind: str
    summary: str
    traceback: str = ""
    time: float = field(default_factory=time.time)

    @property
    def knock_on(self) -> bool:
        """Whether this looks like a consequence of another rank's failure."""
        if self.kind == "stopped":
            return True
        text = f"{self.summary}\n{self.traceback}".lower()
        return self.kind == "exception" and any(h in text for h in _KNOCK_ON_HINTS)


# --------------------------------------------------------------------------- ranks


class _Rank:
    """The launcher's view of one rank process: its pipes, its output, its outcome."""

    def __init__(self, rank: int, process, result_conn, out_conn, err_conn):
        self.rank = rank
        self.process = process
        self.result_conn = result_conn
        self.streams = {out_conn: "stdout", err_conn: "stderr"}
        self.partial = {"stdout": b"", "stderr": b""}
        self.lines = {"stdout": [], "stderr": []}
        self.message = None  # ("ok", bytes) or ("error", dict)
        self.failure: RankFailure | None = None
        self.exited = False
        self.exited_at = 0.0

    @property
    def done(self) -> bool:
        return self.exited and not self.streams and self.result_conn is None

    def drain(self, view, grace: float = STREAM_GRACE_S) -> None:
        """Read what is left on the output pipes of an exited rank, for up to ``grace``
        seconds: a process the rank started in a session of its own may hold them open."""
        end = time.monotonic() + grace
        while self.streams and time.monotonic() < end:
            for conn in multiprocessing.connection.wait(list(self.streams), timeout=0.05):
                for stream, text in self.read_stream(conn):
                    view.line(self.rank, stream, text)
        for conn in list(self.streams):
            conn.close()
        self.streams.clear()

    def waitables(self) -> list:
        items = list(self.streams)
        if self.result_conn is not None:
            items.append(self.result_conn)
        if not self.exited:
            items.append(self.process.sentinel)
        return items

    def read_stream(self, conn) -> list[tuple[str, str]]:
        """Read what is available on one output pipe; return the complete lines."""
        name = self.streams[conn]
        try:
            chunk = os.read(conn.fileno(), 1 << 16)
        except OSError:
            chunk = b""
        if not chunk:
            del self.streams[conn]
            conn.close()
            chunk, rest = self.partial[name], b""
            if chunk and not chunk.endswith(b"\n"):
                chunk += b"\n"
        else:
            chunk = self.partial[name] + chunk
            chunk, sep, rest = chunk.rpartition(b"\n")
            if sep:
                chunk += sep
            else:
                chunk, rest = b"", chunk
        self.partial[name] = rest
        lines = chunk.decode("utf-8", "backslashreplace").splitlines()
        self.lines[name].extend(lines)
        return [(name, line) for line in lines]

    def read_result(self) -> None:
        # EOF: it died before reporting, and its exit code will tell why.
        with contextlib.suppress(EOFError, OSError):
            self.message = pickle.loads(self.result_conn.recv_bytes())
        self.result_conn.close()
        self.result_conn = None

    def reap(self) -> None:
        """The process has exited: drain its pipes and record its outcome."""
        self.process.join()
        self.exited, self.exited_at = True, time.monotonic()
        if self.result_conn is not None and self.result_conn.poll():
            self.read_result()
        if self.message is not None and self.message[0] == "error":
            info = self.message[1]
            self.failure = RankFailure(
                self.rank,
                "exception",
                f"{info['type']}: {info['message']}",
                info["traceback"],
                info["time"],
            )
        elif self.message is None and self.failure is None:
            code = self.process.exitcode
            if code is not None and code < 0:
                name = signal.Signals(-code).name
                self.failure = RankFailure(self.rank, "signal", f"killed by signal {name}")
            else:
                self.failure = RankFailure(
                    self.rank, "exit", f"exited with code {code} before returning{_main_hint()}"
                )

    def kill(self) -> None:
        """SIGKILL the rank's whole session (the rank and anything it started)."""
        if self.exited:
            return
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.process.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            self.process.kill()

    def close(self) -> None:
        for conn in list(self.streams):
            conn.close()
        self.streams.clear()
        if self.result_conn is not None:
            self.result_conn.close()
            self.result_conn = None
        self.process.join(timeout=10)
        with contextlib.suppress(ValueError):
            self.process.close()


# --------------------------------------------------------------------------- output


class _LiveView:
    """Rank output, live while the launch runs and rank-ordered when it ends.

    In a terminal, each line is printed as it arrives, prefixed with its rank. In a
    Jupyter kernel, the lines appear live in a display area (created when the first
    line arrives); when the launch ends that area is emptied and the output is printed
    again grouped by rank, so the record that stays in the notebook is the same on
    every run (nbval compares it).
    """

    REFRESH_S = 0.25

    def __init__(self):
        self.jupyter = _in_jupyter()
        self.handle = None
        self.buffer: list[str] = []
        self.shown = 0
        self.last = 0.0

    @staticmethod
    def _bundle(lines: list[str]) -> dict:
        text = "\n".join(lines)
        return {"text/plain": text, "text/html": f"<pre>{html.escape(text)}</pre>" if text else ""}

    def line(self, rank: int, stream: str, text: str) -> None:
        shown = f"[rank {rank}] {text}"
        if not self.jupyter:
            print(shown, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)
            return
        if self.handle is None:
            from IPython.display import display

            self.handle = display(self._bundle([]), raw=True, display_id=True)
        self.buffer.append(shown)
        self.poll()

    def poll(self) -> None:
        """Show new lines, at most every ``REFRESH_S`` seconds."""
        stale = self.handle is not None and len(self.buffer) > self.shown
        if stale and time.monotonic() - self.last > self.REFRESH_S:
            self.handle.update(self._bundle(self.buffer[-200:]), raw=True)
            self.last, self.shown = time.monotonic(), len(self.buffer)

    def finish(self, ranks: list[_Rank]) -> None:
        if self.handle is None:
            return
        self.handle.update(self._bundle([]), raw=True)
        for stream, file in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = "".join(f"[rank {r.rank}] {line}\n" for r in ranks for line in r.lines[stream])
            if text:
                file.write(text)
                file.flush()


def _main_hint() -> str:
    """A rank that dies while starting, in a script: the usual multiprocessing cause."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is None and getattr(main, "__file__", None):
        return (
            ' (if this is a script, call launch() under `if __name__ == "__main__":`'
            " - each rank re-imports the main script, as with multiprocessing's spawn)"
        )
    return ""


class _NullView:
    """Where the output of ranks that are being stopped goes: kept, not shown."""

    def line(self, rank: int, stream: str, text: str) -> None:
        pass


def _in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and hasattr(shell, "kernel")


# --------------------------------------------------------------------------- launch


def _context():
    """The forkserver context; its server imports torch (via the worker) once."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["labsupport.worker"])
    return ctx


def warm_up() -> None:
    """Start the forkserver now, so that the first launch is as quick as the next."""
    _context()
    multiprocessing.forkserver.ensure_running()


def _code_files(fn) -> dict[str, str]:
    """Function name -> source file, for ``fn`` and the functions of ``__main__``.

    cloudpickle ships functions defined in a notebook by value and renames their file
    to ``"<dynamic-code>"``; this map lets the launcher put the cell back into the
    ranks' tracebacks.
    """
    main = sys.modules.get("__main__")
    found = [fn, *(vars(main).values() if main else ())]
    codes = [f.__code__ for f in found if inspect.isfunction(f)]
    files: dict[str, str] = {}
    while codes:
        code = codes.pop()
        files.setdefault(code.co_name, code.co_filename)
        codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return files


_FRAME = re.compile(r'^(\s*)File "(.+)", line (\d+)(,?) in (\S+)$')


def _restore_sources(text: str, files: dict[str, str]) -> str:
    """Name the cell (or file) and quote the source line of each frame.

    Handles Python tracebacks, whose ``<dynamic-code>`` frames lost their file to
    cloudpickle, and faulthandler stacks, which never quote the source.
    """
    out = []
    for line in text.splitlines():
        match = _FRAME.match(line)
        if match is None:
            out.append(line)
            continue
        indent, filename, lineno, comma, name = match.groups()
        quote = not comma  # a faulthandler frame; Python tracebacks quote already
        if filename == "<dynamic-code>":
            filename, quote = files.get(name), True
            if filename is None:
                out.append(line)
                continue
        out.append(f"{indent}{_where(filename)}, line {lineno}, in {name}")
        source = linecache.getline(filename, int(lineno)).strip() if quote else ""
        if source:
            out.append(f"{indent}  {source}")
    return "\n".join(out)


def _where(filename: str) -> str:
    """IPython's name for a cell ("Cell In[5]"), or the file's, relative to sys.path."""
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    named = shell.compile.format_code_name(filename) if shell is not None else None
    return " ".join(named) if named else f'File "{_short_path(filename)}"'


def _short_path(filename: str) -> str:
    """``.../site-packages/torch/x.py`` -> ``torch/x.py``: what is importable, not where."""
    package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    paths = [*sys.path, package_root]
    roots = sorted((p for p in paths if p and os.path.isabs(p)), key=len, reverse=True)
    for root in roots:
        if filename.startswith(root.rstrip("/") + "/"):
            return filename[len(root.rstrip("/")) + 1 :]
    return filename


def _pickle_job(fn, args, kwargs) -> bytes:
    try:
        return cloudpickle.dumps((fn, tuple(args), dict(kwargs)))
    except Exception as exc:
        raise LaunchError(
            f"cannot send the function and its arguments to the ranks: {exc}. "
            "Each rank receives a pickled copy of fn, args and kwargs; pass values that "
            "pickle (tensors, numbers, strings, lists, dicts) and create other objects "
            "(files, locks, sockets, process groups) inside fn."
        ) from exc


def rank_environment(rank: int, world_size: int, port: int, run_id: str, extra) -> dict:
    """The environment torchrun gives a worker, for a single node."""
    env = dict(os.environ)
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
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        TORCHELASTIC_RUN_ID=run_id,
        TORCHELASTIC_RESTART_COUNT="0",
        TORCHELASTIC_MAX_RESTARTS="0",
        TORCHELASTIC_USE_AGENT_STORE="True",
        OMP_NUM_THREADS=str(_threads_per_rank(world_size)),
    )
    return env


def _threads_per_rank(world_size: int) -> int:
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
    (``backend="auto"``: nccl with one GPU per rank when enough GPUs are visible, gloo
    on CPU otherwise) and the environment torchrun would give it. ``fn`` may be
    defined in the notebook: it travels to the ranks pickled by value (cloudpickle).
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

    from torch.distributed import TCPStore  # the kernel hosts the rendezvous store

    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    run_id = f"labsupport-{os.getpid()}-{next(_launch_ids)}"
    files = _code_files(fn)
    view = _LiveView()
    ranks: list[_Rank] = []
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
        _supervise(ranks, time.monotonic() + timeout, view)
        for r in ranks:
            if r.failure is not None:
                r.failure.traceback = _restore_sources(r.failure.traceback, files)
    finally:
        for r in ranks:
            r.kill()
        for r in ranks:
            r.close()
        del store
        view.finish(ranks)
    return _outcome(ranks, timeout)


def _start_rank(ctx, rank: int, job: dict) -> _Rank:
    result_r, result_w = ctx.Pipe(duplex=False)
    out_r, out_w = ctx.Pipe(duplex=False)
    err_r, err_w = ctx.Pipe(duplex=False)
    from labsupport.worker import rank_main

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
    return _Rank(rank, process, result_r, out_r, err_r)


def _supervise(ranks: list[_Rank], deadline: float, view: _LiveView) -> None:
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
                stack = _innermost_frames("\n".join(r.lines["stderr"]))
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


def _innermost_frames(dump: str) -> str:
    """The last faulthandler stack in ``dump``, cut where the rank called ``fn``."""
    start = dump.rfind("Stack (most recent call first):")
    if start < 0:
        return ""
    kept = []
    for line in dump[start:].splitlines():
        if "labsupport/worker.py" in line:
            break
        kept.append(line)
    return "\n".join(kept)


def _dump_stacks(running: list[_Rank], view: _LiveView) -> None:
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


def _stop_survivors(ranks: list[_Rank], kind: str, summary: str) -> None:
    """Kill every rank still running; those that had not reported get ``kind``."""
    for r in ranks:
        r.kill()
    for r in ranks:
        if r.exited:
            continue
        r.reap()
        r.drain(_NullView())
        if r.message is None:
            r.failure = RankFailure(r.rank, kind, summary, "\n".join(r.lines["stderr"][-40:]))


def _shorten(text: str, width: int = 160) -> str:
    """First sentence of an error, without the C++ source location gloo/NCCL prefix."""
    line = text.splitlines()[0] if text else ""
    line = re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ", "", line)
    line = re.sub(r"(\.)\s.*$", r"\1", line)
    return line if len(line) <= width else line[: width - 3] + "..."


def _outcome(ranks: list[_Rank], timeout: float) -> list:
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
    if any(f.kind == "timeout" for f in failures.values()):
        hung = sorted(rank for rank, f in failures.items() if f.kind == "timeout")
        parts = [
            f"launch timed out after {timeout:g} s; rank(s) still running: "
            f"{', '.join(map(str, hung))}.",
            "Where each was (Python stack at the timeout):",
        ]
        for rank in hung:
            stack = failures[rank].traceback.strip() or "(no stack printed)"
            parts.append(f"--- rank {rank} ---\n{stack}")
        parts.append(
            "A rank that waits forever usually waits in a collective or recv that "
            "another rank never enters; check that every rank makes the same calls."
        )
        raise LaunchTimeout("\n".join(parts), failures, None)
    root = min(failures.values(), key=lambda f: (f.knock_on, f.time))
    parts = [f"rank {root.rank} failed (root cause): {root.summary}"]
    if root.traceback:
        parts.append(root.traceback.rstrip())
    others = [f for f in failures.values() if f is not root]
    if others:
        parts.append("Other ranks, as a consequence:")
        parts.extend(
            f"  rank {f.rank}: {_shorten(f.summary)}" for f in sorted(others, key=lambda f: f.rank)
        )
    raise LaunchError("\n".join(parts), failures, root.rank)
