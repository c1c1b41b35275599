"""The launcher's view of the ranks: one process each, its pipes, its output, its outcome.

:class:`RankProcess` reads a rank's result pipe and output pipes and records how it
ended; :class:`LiveView` shows the ranks' output while they run (live in a notebook,
printed in a terminal) and leaves a rank-ordered record behind when they end, so that a
notebook's stored output does not depend on timing.
"""

from __future__ import annotations

import contextlib
import html
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time

from labsupport.launch.errors import RankFailure, main_hint

#: How long the output pipes of an exited rank may stay open before they are closed.
STREAM_GRACE_S = 2.0


class RankProcess:
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
                    self.rank, "exit", f"exited with code {code} before returning{main_hint()}"
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


class LiveView:
    """Rank output, live while the launch runs and rank-ordered when it ends.

    In a terminal, each line is printed as it arrives, prefixed with its rank. In a
    Jupyter kernel, the lines appear live in a display area (created when the first
    line arrives); when the launch ends that area is emptied and the output is printed
    again grouped by rank, so the record that stays in the notebook is the same on
    every run (nbval compares it).
    """

    REFRESH_S = 0.25

    def __init__(self):
        self.jupyter = in_jupyter()
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

    def finish(self, ranks: list[RankProcess]) -> None:
        if self.handle is None:
            return
        self.handle.update(self._bundle([]), raw=True)
        for stream, file in (("stdout", sys.stdout), ("stderr", sys.stderr)):
            text = "".join(f"[rank {r.rank}] {line}\n" for r in ranks for line in r.lines[stream])
            if text:
                file.write(text)
                file.flush()


class NullView:
    """Where the output of ranks that are being stopped goes: kept, not shown."""

    def line(self, rank: int, stream: str, text: str) -> None:
        pass


def in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and hasattr(shell, "kernel")
