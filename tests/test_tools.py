"""tools: re-executing a lab stores its outputs without timestamps. (tools.figures is
tested in tests/test_viz.py, against the committed figures.)"""

from __future__ import annotations

import nbformat
from nbformat.v4 import new_code_cell, new_notebook

from tools import execute


def test_execute_stores_outputs_without_timestamps(tmp_path):
    path = tmp_path / "lab.ipynb"
    nb = new_notebook(cells=[new_code_cell("print(6 * 7)")])
    nb.cells[0].metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00Z"}
    nbformat.write(nb, path)
    execute.execute(path, timeout=120)
    cell = nbformat.read(path, as_version=4).cells[0]
    assert cell.outputs[0]["text"] == "42\n"
    assert cell.execution_count == 1
    assert "execution" not in cell.metadata
