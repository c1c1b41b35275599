"""``python -m labsupport.run`` under real torchrun: one node, and two "nodes" on localhost
(:mod:`labsupport.launch.nodes`), all listening on loopback only, as the DeepSpeed
launcher's nodes do."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import time

import pytest
import torch.distributed as dist

from labsupport import run
from labsupport.labs import lab06_launching, lab15_launcher
from labsupport.launch import loopback, nodes


def recorded_ports(monkeypatch, module) -> list[int]:
    """The ports ``module.free_port`` hands out from now on (the rendezvous endpoint)."""
    ports, free_port = [], module.free_port
    monkeypatch.setattr(module, "free_port", lambda: ports.append(free_port()) or ports[-1])
    return ports


def test_two_torchrun_nodes_meet_through_c10d_rendezvous_on_loopback(monkeypatch):
    """Two torchrun agents: the c10d rendezvous store, the store the agent of rendezvous
    rank 0 starts for the workers, the workers' gloo sockets, all on 127.0.0.1."""
    ports = recorded_ports(monkeypatch, nodes)
    with loopback.watch_listening() as seen:
        lines = nodes.torchrun_nodes(
            "labsupport.labs.lab06_launching:all_reduce_ranks", 2, 2, timeout=180
        )
    infos = [ast.literal_eval(line.split(" -> ", 1)[1]) for line in lines]
    assert [i["rank"] for i in infos] == [0, 1, 2, 3]
    assert [(i["node_rank"], i["local_rank"]) for i in infos] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert {i["sum_of_ranks"] for i in infos} == {0 + 1 + 2 + 3}
    for i in infos:
        assert i["rank"] == lab06_launching.global_rank(i["node_rank"], i["local_rank"], 2)
    assert ports[0] in {port for _, address, port in seen if address == "127.0.0.1"}
    assert len(seen) >= 2, "the agents' two stores"
    assert loopback.exposed(seen) == set()


def test_a_failing_torchrun_node_is_reported_with_its_output():
    with pytest.raises(RuntimeError, match="a torchrun node failed") as info:
        nodes.torchrun_nodes(
            "labsupport.labs.lab06_launching:failing_step", 1, 3, timeout=180, args=("bad_rank=1",)
        )
    assert "simulated failure: rank 1 ran out of memory" in str(info.value)


def hold_and_say_where_the_store_is(seconds: float = 1.0) -> str:
    """A rank that keeps its process group up a while; returns ``MASTER_ADDR:MASTER_PORT``."""
    time.sleep(seconds)
    dist.barrier()
    return f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"


def test_a_store_rank_0_hosts_under_torchrun_is_on_loopback_too(monkeypatch):
    """When torchrun does not share its store with the workers (lab 16 runs it so), rank
    0 hosts theirs, through ``labsupport.run``'s ``init_process_group``, at the address
    the node announces: 127.0.0.1."""
    monkeypatch.setenv("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # the workers import this module
    with loopback.watch_listening() as seen:
        lines = nodes.torchrun_nodes("test_run:hold_and_say_where_the_store_is", 1, 2, 180)
    masters = {ast.literal_eval(line.split(" -> ", 1)[1]) for line in lines}
    assert len(lines) == 2 and len(masters) == 1
    address, port = masters.pop().rsplit(":", 1)
    assert address == "127.0.0.1"
    assert int(port) in {p for _, a, p in seen if a == "127.0.0.1"}, "rank 0's store not seen"
    assert loopback.exposed(seen) == set()


def test_deepspeed_launcher_nodes_listen_on_the_loopback_interface_only(monkeypatch):
    """Two DeepSpeed launchers (lab 15): rank 0 hosts the store at --master_port."""
    ports = recorded_ports(monkeypatch, lab15_launcher)
    with loopback.watch_listening() as seen:
        lines = lab15_launcher.deepspeed_nodes({"node0": 1, "node1": 1}, 2, 1, timeout=300)
    assert [line.split(" -> ")[0] for line in lines] == ["[rank 0]", "[rank 1]"]
    assert ports[0] in {port for _, address, port in seen if address == "127.0.0.1"}
    assert loopback.exposed(seen) == set()


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
