"""tools: re-executing a lab stores its outputs without timestamps; ``make gpu-check``'s
rank checks and its all-reduce floor line run on the CPU, and it refuses to pretend where
there is no GPU. (tools.figures is tested in tests/test_viz.py, against the committed
figures.)"""

from __future__ import annotations

import nbformat
import psutil
import pytest
import torch
from nbformat.v4 import new_code_cell, new_notebook

from tools import execute, gpu_check


def test_execute_stores_outputs_without_timestamps(tmp_path):
    path = tmp_path / "lab.ipynb"
    nb = new_notebook(cells=[new_code_cell("print(6 * 7)")])
    nb.cells[0].metadata["execution"] = {"iopub.status.idle": "2026-01-01T00:00:00Z"}
    nbformat.write(nb, path)
    before = set(psutil.Process().children(recursive=True))
    execute.execute(path, timeout=120)
    assert set(psutil.Process().children(recursive=True)) <= before, "a kernel was left running"
    cell = nbformat.read(path, as_version=4).cells[0]
    assert cell.outputs[0]["text"] == "42\n"
    assert cell.execution_count == 1
    assert "execution" not in cell.metadata


def test_gpu_check_runs_every_rank_check_on_the_cpu(capsys):
    assert gpu_check.main(["--cpu"]) == 0
    out = capsys.readouterr().out
    assert "FAIL" not in out
    assert out.count("PASS") == 10 and "10 of 10 checks passed" in out
    assert "all-reduce 4 MiB on 2 ranks: bus bandwidth" in out and "of the floor" in out


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU to check")
def test_gpu_check_says_there_is_nothing_to_check_without_a_gpu(capsys):
    assert gpu_check.main([]) == 2
    assert "no CUDA GPU here" in capsys.readouterr().out
