"""The launcher's view of the ranks: one process each, its pipes, its output, its outcome.

:class:`RankProcess` reads a rank's result pipe and output pipes and records how it
ended; :class:`LiveView` shows the ranks' output while they run (live in a notebook,
printed in a terminal) and leaves a rank-ordered record behind when they end, so that a
notebook's stored output does not depend on timing. The emulated nodes of
:mod:`~labsupport.launch.nodes` show their output in a :class:`LiveView` too.
"""

from __future__ import annotations

import contextlib
import multiprocessing.connection
import os
import pickle
import signal
import sys
import time

from labsupport.launch import progress
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
        self.progress = None  # (done, total, desc): the last progress report
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
        # Split on newlines only: str.splitlines also splits on \x1c-\x1e, and the
        # progress reports start with \x1e.
        text = chunk.decode("utf-8", "backslashreplace")
        lines = [line.removesuffix("\r") for line in text.split("\n")[:-1]] if text else []
        shown = []
        for line in lines:
            report, status = progress.parse(line), progress.parse_status(line)
            if status is not None:  # live only
                shown.append(("status", status))
            elif report is None:
                self.lines[name].append(line)
                shown.append((name, line))
            else:  # live only; the finished bar goes into the record (the same every run)
                self.progress = report
                shown.append(("progress", line))
                if report[0] == report[1]:
                    self.lines[name].append(progress.bar(*report))
        return shown

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
    """Output of ranks (or of nodes), live while they run and rank-ordered when they end.

    In a terminal, each line is printed as it arrives, prefixed with its rank (node). In a
    Jupyter kernel, a display area says what is happening ("starting 4 ranks") and then
    shows each rank's progress bar or status (:mod:`labsupport.launch.progress`) and the
    lines as they arrive, in plain text like the cell's own output. When the launch
    ends, :meth:`finish` empties that area and prints the output again, grouped by rank
    under one line that says so: the record that stays in the notebook is the same on
    every run (nbval compares it). :meth:`close` empties it and prints nothing.

    The area is a display with no data at all, before and after: it shows nothing, on
    the website (Jupyter Book drops it) as in JupyterLab. The Jupyter protocol cannot
    remove one output of a cell (``clear_output`` removes all of them, the output of
    earlier launches in the same cell too), so an empty display is what stays of it.
    """

    REFRESH_S = 0.25

    def __init__(self, count: int, first: bool = False, unit: str = "rank"):
        self.jupyter = in_jupyter()
        self.count, self.unit = count, unit
        self.handle = None
        self.buffer: list[str] = []
        self.bars: dict[int, str] = {}
        self.stale = False
        self.last = 0.0
        if self.jupyter:
            from IPython.display import display

            status = f"starting {self._units()} ..."
            if first:
                status += " (the first launch in this kernel imports torch once: a few seconds)"
            # Created with no data, then filled: nbval compares a cell's first display
            # message, in which a display with no data has nothing to compare, and
            # ignores updates; the stored notebook keeps the last update, no data again.
            self.handle = display({}, raw=True, display_id=True)
            self.handle.update({"text/plain": status}, raw=True)

    def _units(self) -> str:
        return f"{self.count} {self.unit}{'s' if self.count > 1 else ''}"

    def line(self, who: int, stream: str, text: str) -> None:
        """Show ``text`` from rank (or node) ``who``: a line of ``stdout`` or ``stderr``,
        a ``progress`` report, or a ``status``."""
        prefix = f"[{self.unit} {who}]"
        if stream == "progress":
            done, total, desc = progress.parse(text)
            self.bars[who] = progress.bar(done, total, desc)
            if not self.jupyter and done == total:
                print(f"{prefix} {self.bars[who]}", flush=True)
        elif stream == "status":  # in place of the bar, until the next report
            self.bars[who] = text
            if not self.jupyter:
                print(f"{prefix} {text}", flush=True)
        else:
            shown = f"{prefix} {text}"
            if not self.jupyter:
                print(shown, file=sys.stderr if stream == "stderr" else sys.stdout, flush=True)
                return
            self.buffer.append(shown)
        self.stale = True
        self.poll()

    def poll(self) -> None:
        """Redraw the live area, at most every ``REFRESH_S`` seconds."""
        if self.handle is None or time.monotonic() - self.last < self.REFRESH_S:
            return
        if not self.stale:
            return
        lines = [
            f"{self._units()} running",
            *(f"[{self.unit} {who}] {self.bars[who]}" for who in sorted(self.bars)),
            *self.buffer[-200:],
        ]
        self.handle.update({"text/plain": "\n".join(lines)}, raw=True)
        self.last, self.stale = time.monotonic(), False

    def close(self) -> None:
        """Empty the live area: it shows nothing from now on."""
        if self.handle is not None:
            self.handle.update({}, raw=True)
            self.handle = None

    def finish(self, ranks: list[RankProcess]) -> None:
        """Empty the live area and print the record: every rank's lines, rank by rank."""
        if self.handle is None:
            return
        self.close()
        out = [f"[rank {r.rank}] {line}\n" for r in ranks for line in r.lines["stdout"]]
        err = [f"[rank {r.rank}] {line}\n" for r in ranks for line in r.lines["stderr"]]
        if out or err:
            whose = f"{len(ranks)} ranks, in rank order" if len(ranks) > 1 else "1 rank"
            sys.stdout.write(f"(output of the {whose})\n")
        for lines, file in ((out, sys.stdout), (err, sys.stderr)):
            if lines:
                file.write("".join(lines))
                file.flush()


class NullView:
    """Where the output of ranks that are being stopped goes: kept, not shown."""

    def line(self, rank: int, stream: str, text: str) -> None:
        pass


def in_jupyter() -> bool:
    ipython = sys.modules.get("IPython")
    shell = ipython.get_ipython() if ipython else None
    return shell is not None and hasattr(shell, "kernel")
