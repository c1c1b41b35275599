"""``python -m labsupport.run`` under real torchrun: one node, and two "nodes" on localhost."""

from __future__ import annotations

import ast
import subprocess
import sys

import pytest

from labsupport import run
from labsupport.labs import lab06_launching


def test_two_torchrun_nodes_meet_through_c10d_rendezvous():
    lines = lab06_launching.torchrun_nodes(
        "labsupport.labs.lab06_launching:all_reduce_ranks", 2, 2, timeout=180
    )
    infos = [ast.literal_eval(line.split(" -> ", 1)[1]) for line in lines]
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [(i["node_rank"], i["local_rank"]) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {i["sum_of_ranks"] for i in infos} == {0 + 1 + 2 + 3}
    for i in infos:
        assert i["rank"] == lab06_launching.global_rank(i["node_rank"], i["local_rank"], 2)


def test_a_failing_torchrun_node_is_reported_with_its_output():
    with pytest.raises(RuntimeError, match="a torchrun node failed") as info:
        lab06_launching.torchrun_nodes(
            "labsupport.labs.lab06_launching:failing_step", 1, 3, timeout=180, args=("bad_rank=1",)
        )
    assert "simulated failure: rank 1 ran out of memory" in str(info.value)


def test_single_node_torchrun_passes_keyword_arguments():
    out = subprocess.run(
        [
            sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
            "-m", "labsupport.run", "labsupport.labs.lab06_launching:failing_step", "bad_rank=5",
        ],
        capture_output=True, text=True, timeout=180, check=True,
    ).stdout  # fmt: skip
    # No rank is 5, so none fails: the all-reduce sums ranks 0 and 1.
    assert sorted(line for line in out.splitlines() if line.startswith("[rank")) == [
        "[rank 0] -> 1.0",
        "[rank 1] -> 1.0",
    ]


def test_outside_torchrun_it_says_how_to_start_it(monkeypatch):
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(SystemExit, match="torchrun --nproc-per-node N -m labsupport.run"):
        run.main(["labsupport.labs.lab06_launching:world_info"])


def test_targets_and_arguments_are_parsed():
    assert run.resolve("labsupport.labs.lab06_launching:world_info") is lab06_launching.world_info
    with pytest.raises(SystemExit, match="module:function"):
        run.resolve("labsupport.labs.lab06_launching")
    assert run.parse_kwargs(["n=3", "name='x'", "word=hello", "xs=[1, 2]"]) == {
        "n": 3,
        "name": "x",
        "word": "hello",
        "xs": [1, 2],
    }
    with pytest.raises(SystemExit, match="name=value"):
        run.parse_kwargs(["3"])
