"""How a failed launch is reported: which rank failed first, its traceback, the rest.

When one rank fails, the others fail too, a moment later, with errors that only say a
peer went away ("Connection closed by peer"). The launcher collects every rank's
failure and :func:`raise_failure` names the *root cause*: the earliest failure that
does not look like such a knock-on error, with its traceback; the others get one line
each. This is what torchrun's ``ChildFailedError`` does with its "root cause (first
observed failure)" (``torch/distributed/elastic/multiprocessing/errors``).
"""

from __future__ import annotations

import inspect
import linecache
import os
import re
import sys
import time
import types
from dataclasses import dataclass, field

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


def main_hint() -> str:
    """A rank that dies while starting, in a script: the usual multiprocessing cause."""
    main = sys.modules.get("__main__")
    if getattr(main, "__spec__", None) is None and getattr(main, "__file__", None):
        return (
            ' (if this is a script, call launch() under `if __name__ == "__main__":`'
            " - each rank re-imports the main script, as with multiprocessing's spawn)"
        )
    return ""


# --------------------------------------------------------------------------- tracebacks


def code_files(fn) -> dict[str, str]:
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


def restore_sources(text: str, files: dict[str, str]) -> str:
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
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    paths = [*sys.path, package_root]
    roots = sorted((p for p in paths if p and os.path.isabs(p)), key=len, reverse=True)
    for root in roots:
        if filename.startswith(root.rstrip("/") + "/"):
            return filename[len(root.rstrip("/")) + 1 :]
    return filename


def innermost_frames(dump: str) -> str:
    """The last faulthandler stack in ``dump``, cut where the rank called ``fn``."""
    start = dump.rfind("Stack (most recent call first):")
    if start < 0:
        return ""
    kept = []
    for line in dump[start:].splitlines():
        if "labsupport/launch/worker.py" in line:
            break
        kept.append(line)
    return "\n".join(kept)


def shorten(text: str, width: int = 160) -> str:
    """First sentence of an error, without the C++ source location gloo/NCCL prefix."""
    line = text.splitlines()[0] if text else ""
    line = re.sub(r"\[[^\]\s]+\.(?:cc|cpp|h|hpp):\d+\] ", "", line)
    line = re.sub(r"(\.)\s.*$", r"\1", line)
    return line if len(line) <= width else line[: width - 3] + "..."


# --------------------------------------------------------------------------- the report


def raise_failure(failures: dict[int, RankFailure], timeout: float):
    """Raise :class:`LaunchTimeout` if ranks hung, else :class:`LaunchError` naming the
    root cause with its traceback and one line for each other rank."""
    __tracebackhide__ = True
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
    if root.knock_on:  # every failure only says a peer went away: none is to blame
        parts = [
            "the ranks lost contact with each other, and no rank failed on its own "
            f"(first seen on rank {root.rank}: {shorten(root.summary)})",
            "Run the launch again: on an overloaded machine a connection can fail while "
            "the ranks set up their process group. If it fails again, look for a rank "
            "killed by the system (out of memory), and set "
            "env={'TORCH_DISTRIBUTED_DEBUG': 'DETAIL'} for details.",
        ]
        raise LaunchError("\n".join(parts), failures, None)
    parts = [f"rank {root.rank} failed (root cause): {root.summary}"]
    if root.traceback:
        parts.append(root.traceback.rstrip())
    others = [f for f in failures.values() if f is not root]
    if others:
        parts.append("Other ranks, as a consequence:")
        parts.extend(
            f"  rank {f.rank}: {shorten(f.summary)}" for f in sorted(others, key=lambda f: f.rank)
        )
    raise LaunchError("\n".join(parts), failures, root.rank)
