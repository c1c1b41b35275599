"""Progress of a loop on every rank, and what a rank is busy with, shown live by the launcher.

Inside a function that :func:`labsupport.launch` runs, ``for step in progress(range(n),
"train"):`` reports each step to the launcher, which draws one bar per rank while the
ranks work (in a notebook, in the launch's live area); of the bar, only the finished one
stays in the cell's record, which is the same on every run. :func:`status` says what a
rank is doing during a long wait with no loop to count (a build, a download): live only,
never in the record. Anywhere else (under ``torchrun``, or in plain Python) ``progress``
prints a line at each quarter of the loop and ``status`` prints its text, on local rank 0
only, so that the ranks of a node do not print over each other.
"""

from __future__ import annotations

import os
import time

#: Lines that start with this are progress reports, not output (the ASCII record separator).
MARK = "\x1eprogress "
#: Lines that start with this say what a rank is doing now: shown live, never recorded.
STATUS = "\x1estatus "
#: Reports are sent at most this often (seconds), and always for the last step.
INTERVAL_S = 0.1


def _live() -> bool:
    return os.environ.get("LABSUPPORT_LIVE") == "1"


def _announce() -> bool:
    return os.environ.get("LOCAL_RANK", "0") == "0"


def progress(iterable, desc: str = "", total: int | None = None):
    """Yield the items of ``iterable`` and report how many have been done."""
    total = len(iterable) if total is None else total
    live, announce = _live(), _announce()
    last, quarter = 0.0, 0
    for done, item in enumerate(iterable, 1):
        yield item
        if live:
            now = time.monotonic()
            if now - last >= INTERVAL_S or done == total:
                print(f"{MARK}{done} {total} {desc}", flush=True)
                last = now
        elif announce and total and done * 4 >= (quarter + 1) * total:
            quarter = done * 4 // total
            print(f"{desc or 'progress'}: {done}/{total}", flush=True)


def status(text: str) -> None:
    """Say what this rank is doing now, until its next report: in the launch's live area
    (a notebook's output keeps none of it), or a printed line outside a launch."""
    text = " ".join(text.split())  # one line
    if _live():
        print(f"{STATUS}{text}", flush=True)
    elif _announce():
        print(text, flush=True)


def parse(line: str):
    """``(done, total, desc)`` of a progress report, or ``None`` for an ordinary line."""
    if not line.startswith(MARK):
        return None
    done, total, desc = (line[len(MARK) :].split(" ", 2) + [""])[:3]
    return int(done), int(total), desc


def parse_status(line: str) -> str | None:
    """The text of a :func:`status` line, or ``None`` for any other line."""
    return line[len(STATUS) :] if line.startswith(STATUS) else None


def bar(done: int, total: int, desc: str, width: int = 24) -> str:
    """``train |#########---------------| 37/100`` as text."""
    filled = width * done // max(total, 1)
    return f"{desc} |{'#' * filled}{'-' * (width - filled)}| {done}/{total}".strip()
