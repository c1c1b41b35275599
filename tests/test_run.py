"""``python -m labsupport.run`` under real torchrun: one node, and two "nodes" on localhost
(:mod:`labsupport.launch.nodes`), all listening on loopback only, as the DeepSpeed
launcher's nodes do."""

from __future__ import annotations

import ast
import contextlib
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest
import torch.distributed as dist

from labsupport import run
from labsupport.labs import lab06_launching, lab15_launcher
from labsupport.launch import loopback, nodes
from labsupport.launch.launcher import LaunchInterrupted


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


@contextlib.contextmanager
def interrupted_once(ready, timeout: float = 180):
    """Send this process SIGINT, as Ctrl-C or Kernel > Interrupt would, once ``ready()``
    holds; yield the processes below this one at that moment that were not there before
    (an earlier test's launch leaves its forkserver running, as it should)."""
    # A shell starts background jobs with SIGINT ignored (see test_launch's interrupt test);
    # Jupyter's kernel, like an interactive Python, raises KeyboardInterrupt.
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    below: list[psutil.Process] = []
    there_before = set(psutil.Process().children(recursive=True))

    def interrupt():
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = [p for p in psutil.Process().children(recursive=True) if p not in there_before]
            if ready(found):
                below.extend(found)
                os.kill(os.getpid(), signal.SIGINT)
                return
            time.sleep(0.1)

    thread = threading.Thread(target=interrupt, daemon=True)
    thread.start()
    try:
        yield below
    finally:
        thread.join()
        signal.signal(signal.SIGINT, previous)


def running(command_part: str, found: list) -> list[psutil.Process]:
    alive = []
    for proc in found:
        with contextlib.suppress(psutil.NoSuchProcess):
            if proc.status() != psutil.STATUS_ZOMBIE and command_part in " ".join(proc.cmdline()):
                alive.append(proc)
    return alive


def assert_all_gone(procs: list[psutil.Process]) -> None:
    deadline = time.monotonic() + 5
    while running("", procs) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert running("", procs) == []


def test_interrupting_torchrun_nodes_stops_every_node_and_worker_in_one_line(monkeypatch):
    path = os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])
    monkeypatch.setenv("PYTHONPATH", path)  # the workers import this module

    def agents_and_workers_up(found) -> bool:  # 2 agents and 4 workers name the target
        return len(running("labsupport.run test_run:", found)) >= 6

    target = "test_run:hold_and_say_where_the_store_is"
    with (
        interrupted_once(agents_and_workers_up) as below,
        pytest.raises(LaunchInterrupted) as info,
    ):
        nodes.torchrun_nodes(target, 2, 2, 180, args=("seconds=600",))
    stopped = "the 2 nodes and every process they started were stopped"
    assert str(info.value) == f"interrupted; {stopped}."
    assert info.value._render_traceback_() == [f"\x1b[31mKeyboardInterrupt\x1b[39m: {info.value}"]
    assert len(below) >= 6, below
    assert_all_gone(below)


def test_interrupting_deepspeed_launcher_nodes_stops_every_process_they_started():
    def workers_up(found) -> bool:  # DeepSpeed's launch.py gives each --local_rank=N
        return len(running("--local_rank", found)) >= 2

    with (
        interrupted_once(workers_up) as below,
        pytest.raises(LaunchInterrupted, match="the 2 nodes and every process"),
    ):
        lab15_launcher.deepspeed_nodes({"node0": 1, "node1": 1}, 2, 1, timeout=300)
    assert_all_gone(below)


def test_node_output_is_read_whole_from_files_as_it_grows():
    """Lines split across writes, a long output, a last line without its newline."""
    script = (
        "import sys\n"
        "for i in range(3000):\n"
        "    sys.stdout.write(f'line {i} ' + 'x' * 40 + '\\n')\n"
        "sys.stdout.write('[rank 0] -> ')\n"
        "sys.stdout.flush()\n"
        "sys.stdout.write('done')\n"
    )
    outputs, codes, timed_out = nodes.stream_nodes(
        [[sys.executable, "-c", script]], nodes.node_environment(), 60
    )
    assert codes == [0] and not timed_out
    lines = outputs[0].split("\n")
    assert lines[:3000] == [f"line {i} " + "x" * 40 for i in range(3000)]
    assert lines[3000:] == ["[rank 0] -> done"]


def test_torch_log_lines_are_shown_as_their_text():
    line = "I1206 09:29:01.525000 26879 /x/torch/distributed/elastic/agent/server/api.py:553] "
    assert nodes.log_message(line + "[default] Starting worker group") == (
        "[default] Starting worker group"
    )
    assert nodes.log_message("[rank 0] -> 1") == "[rank 0] -> 1"


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
