"""Small helpers for the labs' cells: show the code a lab runs, print per-rank tables."""

from __future__ import annotations

import inspect


def show_source(obj):
    """Display the source of a ``labsupport`` function or class, highlighted.

    Labs show the very code they run, rather than a copy in a cell that could drift.
    """
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
