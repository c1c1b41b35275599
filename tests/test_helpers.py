"""The smaller pieces of labsupport: backends, lab functions, checkers, figures, helpers."""

from __future__ import annotations

from pathlib import Path

import nbformat
import numpy as np
import pytest
import torch.distributed as dist
from matplotlib.image import imread
from nbformat.v4 import new_code_cell, new_notebook

from labsupport import execute, figures, launch, launcher, launching, notebook, plotting, runtime


def test_auto_backend_is_gloo_without_a_gpu_per_rank(monkeypatch):
    monkeypatch.setattr(runtime, "gpus_visible", lambda: 2)
    assert runtime.resolve_backend("auto", 2) == "nccl"
    assert runtime.resolve_backend("auto", 3) == "gloo"
    assert runtime.resolve_backend("gloo", 1) == "gloo"
    with pytest.raises(ValueError, match="3 ranks on this node but 2 GPU"):
        runtime.resolve_backend("nccl", 3)


def test_global_rank_fills_node_zero_first():
    assert [launching.global_rank(n, k, 4) for n in range(2) for k in range(4)] == list(range(8))
    assert launching.global_rank(2, 5, 8) == 21


def test_world_info_and_ring_pass_on_three_ranks():
    infos = launch(launching.world_info, 3, timeout=60)
    assert [(i["rank"], i["local_rank"], i["node_rank"]) for i in infos] == [
        (0, 0, 0),
        (1, 1, 0),
        (2, 2, 0),
    ]
    assert {i["backend"] for i in infos} == {"gloo"}
    ring = launch(launching.ring_pass, 3, timeout=60)
    assert [r["received"] for r in ring] == [2, 0, 1]


def test_ping_pong_times_a_round_trip_on_rank_zero_only():
    small, other, idle = launch(launching.ping_pong, 3, kwargs={"rounds": 5}, timeout=60)
    assert 0 < small < 1 and other is None and idle is None
    with pytest.raises(launcher.LaunchError, match="at least 2 ranks"):
        launch(launching.ping_pong, 1, timeout=60)


def test_the_exercise_checkers_accept_solutions_and_reject_mistakes(capsys):
    launching.check_global_rank(lambda node, local, n: node * n + local)
    with pytest.raises(AssertionError, match="torchrun gives rank"):
        launching.check_global_rank(lambda node, local, n: local * n + node)

    def ring_sum():  # rank 0 collects the total passed around the ring
        import torch

        rank, world = dist.get_rank(), dist.get_world_size()
        total = torch.zeros(1)
        if rank == 0:
            dist.send(total, dst=1)
            dist.recv(total, src=world - 1)
        else:
            dist.recv(total, src=rank - 1)
            total += rank
            dist.send(total, dst=(rank + 1) % world)
        return int(total.item())

    launching.check_ring_sum(ring_sum, world_sizes=(2, 3))
    assert "Correct" in capsys.readouterr().out
    with pytest.raises(AssertionError, match="world_size=3: rank 0 returned 0, expected 3"):
        launching.check_ring_sum(lambda: 0, world_sizes=(3,))


def test_format_table_aligns_columns():
    table = notebook.format_table([{"rank": 0, "device": "cpu"}, {"rank": 10, "device": "cuda:1"}])
    assert table.splitlines() == [
        "rank  device",
        "----  ------",
        "0     cpu",
        "10    cuda:1",
    ]


def test_show_source_shows_the_real_function():
    code = notebook.show_source(launching.world_info)
    assert code.data.startswith("def world_info() -> dict:")
    assert "dist.get_rank()" in code.data


def test_each_rank_has_one_colour_everywhere():
    assert plotting.rank_color(0) != plotting.rank_color(1)
    assert plotting.rank_color(len(plotting.RANK_COLORS)) == plotting.rank_color(0)
    infos = [{"rank": r, "local_rank": r % 2, "node_rank": r // 2} for r in range(4)]
    ax = plotting.draw_ranks(infos)
    labels = [t.get_text() for t in ax.texts]
    assert "node 0" in labels and "node 1" in labels
    assert "rank 3\nlocal 1\nnode 1" in labels


@pytest.mark.parametrize("name", sorted(figures.FIGURES))
def test_committed_figures_are_what_the_code_draws(tmp_path, name):
    figures.save(figures.FIGURES[name](), tmp_path / name)
    committed = imread(Path(__file__).resolve().parents[1] / "chapters" / "figures" / name)
    drawn = imread(tmp_path / name)
    assert committed.shape == drawn.shape, "run `make figures` and commit the result"
    assert np.abs(committed - drawn).max() < 1e-6, "run `make figures` and commit the result"


def test_errors_are_summarised_without_cxx_locations():
    long = (
        "RuntimeError: [/__w/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
        "Connection closed by peer [127.0.0.1]:4242. This is typically caused by a crash."
    )
    assert launcher._shorten(long) == "RuntimeError: Connection closed by peer [127.0.0.1]:4242."
    failure = launcher.RankFailure(0, "exception", long)
    assert failure.knock_on
    assert not launcher.RankFailure(1, "exception", "ValueError: bad shard").knock_on
    assert not launcher.RankFailure(1, "signal", "killed by signal SIGKILL").knock_on


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
