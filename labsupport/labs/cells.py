"""What the labs' cells share: the source of the code they run, tables, exercise checkers.

* :func:`show_source`: labs show the very code they run, rather than a copy in a cell
  that could drift from it;
* :func:`format_table`: rows of dicts (one per rank, usually) as fixed-width text;
* :func:`exercise`: turns a checker into one that says "not attempted yet" for the stub
  a lab gives the learner, and "correct" (without giving the answer away) or a message
  that says what is wrong, for an attempt.
"""

from __future__ import annotations

import functools
import inspect

from labsupport.launch.errors import LaunchError


def show_source(obj):
    """Display the source of a ``labsupport`` function or class, highlighted."""
    from IPython.display import Code

    return Code(inspect.getsource(obj), language="python")


def format_table(rows: list[dict], columns: list[str] | None = None) -> str:
    """Rows of dicts as a fixed-width text table (one row per rank, usually)."""
    columns = columns or list(rows[0])
    cells = [[str(row[c]) for c in columns] for row in rows]
    widths = [max(len(c), *(len(r[i]) for r in cells)) for i, c in enumerate(columns)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(columns, widths, strict=True)).rstrip()]
    lines.append("  ".join("-" * w for w in widths))
    lines += ["  ".join(v.ljust(w) for v, w in zip(r, widths, strict=True)).rstrip() for r in cells]
    return "\n".join(lines)


def _not_attempted(exc: BaseException) -> bool:
    """Whether ``exc`` comes from the lab's stub, here or on a rank."""
    if isinstance(exc, NotImplementedError):
        return True
    if isinstance(exc, LaunchError) and exc.root_rank is not None:
        return exc.failures[exc.root_rank].summary.startswith("NotImplementedError")
    return False


class Checked:
    """What a checker found: true when the answer passed. It shows nothing in a notebook
    (the checker has printed its verdict), so a checker cell stores one line."""

    def __init__(self, passed: bool):
        self.passed = passed

    def __bool__(self) -> bool:
        return self.passed

    def __repr__(self) -> str:
        return f"Checked(passed={self.passed})"

    def _ipython_display_(self) -> None:
        pass


def exercise(check):
    """Decorate ``check(fn, ...)``, a checker that asserts on ``fn`` and returns a short
    description of what it checked.

    The decorated checker prints ``Correct: <description>`` when every assertion holds;
    lets an ``AssertionError`` through when one fails (its message says what is wrong);
    and prints ``Not attempted yet`` when ``fn`` is the stub a lab gives the learner,
    whose body raises ``NotImplementedError``. It returns a :class:`Checked`, true when
    ``fn`` passed.
    """

    @functools.wraps(check)
    def checker(fn, *args, **kwargs) -> Checked:
        name = getattr(fn, "__name__", "your function")
        try:
            checked = check(fn, *args, **kwargs)
        except (NotImplementedError, LaunchError) as exc:
            if not _not_attempted(exc):
                raise
            print(f"Not attempted yet: write the body of {name}() above, then run this cell.")
            return Checked(False)
        print(f"Correct: {checked}")
        return Checked(True)

    return checker
