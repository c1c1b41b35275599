"""The worked solutions of the labs' exercises, read from the notebooks themselves.

A lab shows each worked solution in a markdown cell, collapsed in a ``<details>``
block, so that Run All does not execute it. The unit tests run each checker against
that very code: a solution in the notebook that a checker rejects fails the tests.
"""

from __future__ import annotations

import re
from pathlib import Path

import nbformat

LABS = Path(__file__).resolve().parents[1] / "labs"
_CODE = re.compile(r"```python\n(.*?)```", re.DOTALL)


def solution_sources(lab: str) -> list[str]:
    """The Python code blocks inside ``<details>`` of the lab's markdown cells."""
    nb = nbformat.read(LABS / lab, as_version=4)
    found = []
    for cell in nb.cells:
        if cell.cell_type == "markdown" and "<details>" in cell.source:
            found.extend(_CODE.findall(cell.source))
    return found


def solution(lab: str, name: str):
    """The function (or class) ``name`` that the lab's worked solutions define (they
    carry their own imports)."""
    for source in solution_sources(lab):
        namespace: dict = {}
        if re.search(rf"^(def|class) {re.escape(name)}\b", source, re.MULTILINE):
            exec(compile(source, f"<{lab} solution of {name}>", "exec"), namespace)
            return namespace[name]
    raise LookupError(f"{lab} has no worked solution defining {name}()")


def stub(name: str):
    """The stub a lab gives the learner: a function whose body raises NotImplementedError."""

    def fn(*args, **kwargs):
        raise NotImplementedError

    fn.__name__ = fn.__qualname__ = name
    fn.__code__ = fn.__code__.replace(co_name=name, co_qualname=name)
    return fn


def notebook_function(lab: str, name: str):
    """The function ``name`` that one of the lab's code cells defines (a training loop
    the lab runs in view), the cell run after the lab's first code cell, its imports."""
    nb = nbformat.read(LABS / lab, as_version=4)
    cells = [cell.source for cell in nb.cells if cell.cell_type == "code"]
    for source in cells:
        if re.search(rf"^def {re.escape(name)}\(", source, re.MULTILINE):
            namespace: dict = {}
            for code in (cells[0], source):
                exec(compile(code, f"<{lab}: the cell of {name}>", "exec"), namespace)
            return namespace[name]
    raise LookupError(f"{lab} has no code cell defining {name}()")
