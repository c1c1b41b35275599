"""What the labs' cells share: the source of the code they run, tables, exercise checkers.

* :func:`show_source`: labs show the very code they run, rather than a copy in a cell
  that could drift from it;
* :func:`format_table`: rows of dicts (one per rank, usually) as fixed-width text;
* :func:`exercise`: turns a checker into one that says "not attempted yet" for the stub
  a lab gives the learner, and "correct" (without giving the answer away) or a short
  verdict that says what is wrong, for an attempt;
* :func:`number`, :func:`launch_answer` and :func:`expect_close`, for checkers: the
  learner's value as a number, the learner's function run on real ranks (a hang reported
  as a wrong answer), and a tensor compared with the expected one, a mismatch reported
  with its rank, its name and its first differing element.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import os
import re
import sys
import sysconfig
import traceback
import types
from pathlib import Path

from labsupport.launch import launch
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


def _stub_name(exc: BaseException, fn) -> str:
    """The function whose body is still the stub: the innermost of the learner's frames
    (outside the library) that ``exc`` passed through, here or on a rank, a method as
    ``Class.method``; ``fn``'s name if there is none."""
    if isinstance(exc, LaunchError):  # frames as launch.errors.restore_sources names them
        text = exc.failures[exc.root_rank].traceback
        frames = re.findall(r'(File "[^"]+"|Cell In\[\d+\]), line \d+, in (\w+)', text)
        frames = [(_rank_file(where), name) for where, name in frames]
    else:
        frames, tb = [], exc.__traceback__
        while tb is not None:
            code = tb.tb_frame.f_code
            frames.append((code.co_filename, code.co_qualname))
            tb = tb.tb_next
    learners = [name for path, name in frames if not _in_library(path)]
    if not learners:
        return getattr(fn, "__name__", "your function")
    return _as_method(learners[-1], fn)


def _rank_file(where: str) -> str:
    """A path from a rank's traceback, made absolute again: ``Cell In[5]`` is a cell
    (the learner's), and a relative path is relative to the ``sys.path`` entry it was
    imported from (launch.errors._short_path), found again by its top-level module."""
    if where.startswith("Cell"):
        return "<cell>"
    path = where[len('File "') : -1]
    if os.path.isabs(path) or path.startswith("<"):
        return path
    spec = importlib.util.find_spec(path.split("/")[0].removesuffix(".py"))
    origin = spec.origin if spec is not None and spec.origin else ""
    return os.path.join(os.path.dirname(origin), path.partition("/")[2]) if "/" in path else origin


def _as_method(name: str, fn) -> str:
    """``name``, from a rank's traceback (which names functions only), as ``Class.name``
    when it is no function beside ``fn`` but a method of a class defined beside it: the
    first such class, which in a lab is the first stub the checker calls."""
    module = getattr(fn, "__module__", None)
    namespace = getattr(fn, "__globals__", None) or vars(sys.modules.get(module, sys))
    if "." in name or isinstance(namespace.get(name), types.FunctionType):
        return name
    for value in list(namespace.values()):
        if isinstance(value, type) and value.__module__ == module and name in vars(value):
            return f"{value.__qualname__}.{name}"
    return name


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


# Where library code lives: labsupport, the standard library, installed packages.
_LIBRARY = tuple(
    os.path.realpath(path) + os.sep
    for path in {
        str(Path(__file__).resolve().parents[1]),
        *(sysconfig.get_paths()[key] for key in ("stdlib", "platstdlib", "purelib", "platlib")),
    }
)


def _in_library(filename: str) -> bool:
    """Whether code from ``filename`` is the library's, Python's or a package's."""
    if filename.startswith("<"):  # "<frozen ...>" is Python's own; "<ipython-...>" a cell
        return filename.startswith("<frozen")
    return os.path.realpath(filename).startswith(_LIBRARY)


def _learners_traceback(exc: BaseException, fn, check):
    """The part of ``exc``'s traceback from the first frame of the learner's code on, or
    ``None`` when the exception never passed through it. The learner's code is ``fn``
    itself, and any code outside the library and the checker's own module (a notebook's
    cells, the learner's modules)."""
    own = getattr(getattr(fn, "__func__", fn), "__code__", None)
    checkers = os.path.realpath(inspect.getsourcefile(check) or "")

    def learners(code) -> bool:
        if code is own:
            return True
        return os.path.realpath(code.co_filename) != checkers and not _in_library(code.co_filename)

    tb = exc.__traceback__
    while tb is not None and not learners(tb.tb_frame.f_code):
        tb = tb.tb_next
    return tb


def _show_learners_traceback(exc: BaseException, tb, heading: str) -> list[str]:
    """IPython's rendering of ``exc`` with only the learner's frames, under ``heading``."""
    from IPython import get_ipython

    shell = get_ipython()
    if shell is None:
        return [heading, *traceback.format_exception(type(exc), exc, tb)]
    return [heading, *shell.InteractiveTB.structured_traceback(type(exc), exc, tb)]


def _as_verdict(exc: Exception, fn, check) -> None:
    """Make IPython show ``exc``, raised while ``check`` checked the learner's ``fn``, as
    a verdict (IPython's ``_render_traceback_`` hook, which the launcher's errors use
    too): what is wrong and what to do, without the frames of the checker and the lab
    module; a traceback only where the learner's own code raised."""
    learners = _learners_traceback(exc, fn, check)
    name, check = getattr(fn, "__name__", "your function"), check.__name__
    again = f"Change {name}() above, run its cell, then this one again."
    if learners is not None:
        heading = f"{check}() ran your {name}(), which raised:"
        render = functools.partial(_show_learners_traceback, exc, learners, heading)
    elif isinstance(exc, AssertionError):
        render = functools.partial(list, [f"\x1b[31mNot right yet\x1b[39m: {exc}", again])
    else:  # the checker could not use what the learner's function gave it
        summary = "".join(traceback.format_exception_only(type(exc), exc)).strip()
        verdict = f"{check}() could not use what {name}() gave it: {summary}"
        render = functools.partial(list, [f"\x1b[31mNot right yet\x1b[39m: {verdict}", again])
    with contextlib.suppress(AttributeError):  # no instance attributes: shown as it is
        exc._render_traceback_ = render


def exercise(check):
    """Decorate ``check(fn, ...)``, a checker that asserts on ``fn`` and returns a short
    description of what it checked.

    The decorated checker prints ``Correct: <description>`` when every assertion holds,
    and ``Not attempted yet`` when ``fn`` is the stub a lab gives the learner, whose body
    raises ``NotImplementedError``; it returns a :class:`Checked`, true when ``fn``
    passed. A wrong answer raises, so that Run All stops there and a test sees an
    ``AssertionError`` whose message says what is wrong; a notebook shows that message
    and what to do next, without the frames of the checker and the lab module. An error
    from the learner's own code shows its traceback from the learner's first frame on.
    """

    @functools.wraps(check)
    def checker(fn, *args, **kwargs) -> Checked:
        try:
            checked = check(fn, *args, **kwargs)
        except (NotImplementedError, LaunchError) as exc:
            if not _not_attempted(exc):
                raise  # a rank's error: the launcher shows the rank's own traceback
            print(f"Not attempted yet: write {_stub_name(exc, fn)}(), then run this cell.")
            return Checked(False)
        except Exception as exc:
            _as_verdict(exc, fn, check)
            raise
        print(f"Correct: {checked}")
        return Checked(True)

    return checker


def number(value, what: str = "a number") -> float:
    """``value``, what the learner's function returned, as a float; otherwise an
    ``AssertionError`` (a checker's verdict) saying that it should return ``what``."""
    try:
        return float(value)
    except (TypeError, ValueError):
        raise AssertionError(f"your function returned {value!r}: it should return {what}") from None


def launch_answer(fn, world_size: int, hint: str, timeout: float, args=(), kwargs=None) -> list:
    """``fn`` (the learner's function, or a case that calls it) on ``world_size`` ranks
    under :func:`labsupport.launch`: each rank's result. A rank that raised is re-raised
    (its traceback says why); ranks that do not all finish within ``timeout`` seconds (a
    rank waiting for a message or a collective that no rank sends) are a wrong answer,
    an ``AssertionError`` that says so, then ``hint`` (what to look at), then the
    launcher's account of each rank."""
    try:
        return launch(fn, world_size, args=args, kwargs=kwargs, timeout=timeout)
    except LaunchError as exc:
        if exc.root_rank is not None:
            raise  # a rank failed on its own: its traceback says why
        raise AssertionError(
            f"on {world_size} ranks, the ranks did not all finish within {timeout:g} s. "
            f"{hint}\n{exc}"
        ) from None


def expect_close(
    got, want, what: str, rank: int | None = None, hint: str = "", rtol=1e-5, atol=1e-6
) -> None:
    """An ``AssertionError`` (a checker's verdict) unless tensor ``got`` has ``want``'s
    shape and values within ``rtol``/``atol`` (``torch.testing.assert_close``'s rule);
    the verdict names ``what`` (and ``rank``), the first differing element, expected
    against got, and ``hint``, the usual mistake behind such a difference."""
    import torch

    where = f"rank {rank}: {what}" if rank is not None else what
    got = torch.as_tensor(got)
    want = torch.as_tensor(want)
    tail = f" ({hint})" if hint else ""
    if got.shape != want.shape:
        raise AssertionError(
            f"{where} has shape {tuple(got.shape)}, expected {tuple(want.shape)}{tail}"
        )
    got, want = got.detach().double().cpu(), want.detach().double().cpu()
    bad = ~torch.isclose(got, want, rtol=rtol, atol=atol)
    if bad.any():
        index = tuple(int(i) for i in bad.nonzero()[0])
        raise AssertionError(
            f"{where} differs at {list(index)} (and {int(bad.sum()) - 1} more of "
            f"{bad.numel()} elements): expected {want[index].item():.6g}, "
            f"got {got[index].item():.6g}{tail}"
        )
