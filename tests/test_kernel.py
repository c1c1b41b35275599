"""labsupport.launch inside a real Jupyter kernel: notebook functions, output, interrupts."""

from __future__ import annotations

import queue
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import psutil
import pytest
from nbformat.v4 import new_code_cell, new_notebook

from tools import execute


@pytest.fixture(scope="module")
def kernel(tmp_path_factory):
    manager = execute.ipc_kernel_manager(tmp_path_factory.mktemp("kernel"))
    manager.start_kernel()
    client = manager.client()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=120)
        yield manager, client
    finally:
        client.stop_channels()
        manager.shutdown_kernel(now=True)


def run_cell(client, code: str, timeout: float = 120) -> tuple[list[dict], dict]:
    """Execute ``code``; return the cell's iopub messages (in order) and the reply."""
    msg_id = client.execute(code)
    messages = []
    deadline = time.monotonic() + timeout
    while True:
        msg = client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        if msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            break
        messages.append(msg)
    while True:  # a reply to an earlier request that timed out may come first
        reply = client.get_shell_msg(timeout=timeout)
        if reply["parent_header"].get("msg_id") == msg_id:
            return messages, reply["content"]


def streams(messages, name="stdout") -> str:
    return "".join(
        m["content"]["text"]
        for m in messages
        if m["msg_type"] == "stream" and m["content"]["name"] == name
    )


def test_a_function_defined_in_the_notebook_runs_on_every_rank(kernel):
    _, client = kernel
    messages, reply = run_cell(
        client,
        "import torch, torch.distributed as dist\n"
        "from labsupport import launch\n"
        "GREETING = 'hello'\n"
        "def greet(n):\n"
        "    for i in range(n):\n"
        "        print(GREETING, 'from rank', dist.get_rank(), 'line', i)\n"
        "    return dist.get_rank() ** 2\n"
        "results = launch(greet, world_size=4, args=(3,))\n"
        "print(results)\n",
    )
    assert reply["status"] == "ok", reply
    expected = "".join(
        f"[rank {r}] hello from rank {r} line {i}\n" for r in range(4) for i in range(3)
    )
    # The record that stays in the notebook is grouped by rank, whatever the timing.
    header = "(output of the 4 ranks, in rank order)\n"
    assert streams(messages) == header + expected + "[0, 1, 4, 9]\n"


def test_output_is_live_while_the_ranks_run(kernel):
    _, client = kernel
    messages, reply = run_cell(
        client,
        "import time\n"
        "def slow():\n"
        "    print('before the pause')\n"
        "    time.sleep(1.0)\n"
        "    print('after the pause')\n"
        "launch(slow, world_size=2)\n",
    )
    assert reply["status"] == "ok", reply
    # While it ran, output went live into a display area of the cell...
    shown = live_area(messages)
    assert any("before the pause" in (text or "") and "after" not in (text or "") for text in shown)
    # ... which says what is happening before the first line arrives ...
    assert shown[0] is None and shown[1].startswith("starting 2 ranks ...")
    # ... and holds no data at the end (it shows nothing, not even an empty box): a
    # stored notebook keeps the rank-ordered record.
    assert shown[-1] is None
    assert streams(messages) == "(output of the 2 ranks, in rank order)\n" + "".join(
        f"[rank {r}] {what} the pause\n" for r in range(2) for what in ("before", "after")
    )


def live_area(messages) -> list:
    """The texts the cell's live display area showed, in order (None: no data at all)."""
    displays = [m for m in messages if m["msg_type"] in ("display_data", "update_display_data")]
    assert displays and displays[0]["msg_type"] == "display_data"
    assert all(m["msg_type"] == "update_display_data" for m in displays[1:])
    assert len({m["content"]["transient"]["display_id"] for m in displays}) == 1
    return [m["content"]["data"].get("text/plain") for m in displays]


def test_a_rank_says_what_it_is_busy_with_live_and_the_record_keeps_nothing_of_it(kernel):
    _, client = kernel
    messages, reply = run_cell(
        client,
        "from labsupport.launch.progress import status\n"
        "def busy():\n"
        "    if dist.get_rank() == 0:\n"
        "        status('building something, first time only')\n"
        "    time.sleep(1.0)\n"
        "    print('built')\n"
        "launch(busy, world_size=2)\n",
    )
    assert reply["status"] == "ok", reply
    shown = live_area(messages)
    assert any("[rank 0] building something, first time only" in (t or "") for t in shown)
    assert shown[-1] is None
    assert streams(messages) == "(output of the 2 ranks, in rank order)\n" + "".join(
        f"[rank {r}] built\n" for r in range(2)
    )


def test_emulated_nodes_stream_their_lines_live_and_leave_nothing_behind(kernel):
    _, client = kernel
    node = (
        "import time; print('joined the rendezvous', flush=True); time.sleep(1.5); "
        "print('[rank 0] -> 1', flush=True)"
    )
    messages, reply = run_cell(
        client,
        "import sys\n"
        "from labsupport.launch.nodes import node_environment, run_nodes\n"
        f"lines = run_nodes([[sys.executable, '-c', {node!r}]] * 2, node_environment(), 60)\n"
        "print(lines)\n",
    )
    assert reply["status"] == "ok", reply
    shown = live_area(messages)
    early = [t for t in shown if t and "[node 1] joined the rendezvous" in t and "->" not in t]
    assert early, f"no node line was shown before the nodes ended: {shown}"
    assert shown[1].startswith("starting 2 nodes ...") and shown[-1] is None
    assert streams(messages) == "['[rank 0] -> 1', '[rank 0] -> 1']\n"


def test_a_failing_rank_shows_the_notebook_cell_in_its_traceback(kernel):
    _, client = kernel
    messages, reply = run_cell(
        client,
        "def broken():\n"
        "    if dist.get_rank() == 2:\n"
        "        raise KeyError('missing shard')\n"
        "    dist.barrier()\n"
        "launch(broken, world_size=3)\n",
    )
    assert reply["status"] == "error"
    assert reply["ename"] == "LaunchError"
    assert reply["evalue"].startswith("rank 2 failed (root cause): KeyError: 'missing shard'")
    assert "Cell In[" in reply["evalue"] and "raise KeyError('missing shard')" in reply["evalue"]


def test_interrupting_the_kernel_stops_every_rank(kernel):
    manager, client = kernel
    kernel_process = psutil.Process(manager.provisioner.process.pid)
    msg_id = client.execute(
        "import time\ndef stuck():\n    time.sleep(600)\nlaunch(stuck, world_size=3, timeout=300)\n"
    )
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:  # wait until the ranks are up
        ranks = [
            p for p in kernel_process.children(recursive=True) if p.ppid() != kernel_process.pid
        ]
        if len(ranks) >= 3:
            break
        time.sleep(0.1)
    assert len(ranks) >= 3, "the ranks never started"
    started = time.monotonic()
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=60)
    while reply["parent_header"]["msg_id"] != msg_id:  # an earlier cell's late reply
        reply = client.get_shell_msg(timeout=60)
    assert reply["content"]["ename"] == "LaunchInterrupted"  # a KeyboardInterrupt
    assert reply["content"]["evalue"] == "launch interrupted; all 3 ranks were stopped."
    # IPython shows one line, not the launcher's and the selector's frames
    assert len(reply["content"]["traceback"]) == 1
    assert time.monotonic() - started < 10
    gone, alive = psutil.wait_procs(ranks, timeout=5)
    assert alive == []
    with pytest.raises(queue.Empty):  # drain
        while True:
            client.get_iopub_msg(timeout=0.5)


def empty_boxes(outputs) -> list:
    """The outputs that show an empty box: a stream, or a display with a text, where the
    text is blank. A display with no data at all shows nothing: JupyterLab gives it no
    room, and Jupyter Book leaves it out of the page."""
    found = []
    for output in outputs:
        shown = {"text": output["text"]} if output["output_type"] == "stream" else output["data"]
        if shown and all(not "".join(value).strip() for value in shown.values()):
            found.append(output)
    return found


def test_a_stored_launch_cell_keeps_the_rank_ordered_record_and_no_empty_box(tmp_path):
    """What nbclient (``tools.execute``, Jupyter Book) stores of a cell with three launches:
    the lines printed around them, each launch's record in rank order, nothing that shows
    as an empty box; and nbval, run on it, finds the same outputs again."""
    source = (
        "import torch.distributed as dist\n"
        "from labsupport import launch\n"
        "def lines(n):\n"
        "    for i in range(n):\n"
        "        print('line', i, 'of rank', dist.get_rank())\n"
        "    return dist.get_rank()\n"
        "print('before')\n"
        "launch(lines, 3, args=(2,))\n"
        "launch(lines, 2, args=(1,))\n"
        "launch(lines, 1, args=(1,))\n"
        "print('after')\n"
    )
    nb = new_notebook(cells=[new_code_cell(source)])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    path = tmp_path / "stored.ipynb"
    nbformat.write(nb, path)
    execute.execute(path, timeout=300)
    outputs = nbformat.read(path, as_version=4).cells[0].outputs
    assert empty_boxes(outputs) == []
    stdout = "".join(o["text"] for o in outputs if o["output_type"] == "stream")
    assert stdout == (
        "before\n(output of the 3 ranks, in rank order)\n"
        + "".join(f"[rank {r}] line {i} of rank {r}\n" for r in range(3) for i in range(2))
        + "(output of the 2 ranks, in rank order)\n"
        + "".join(f"[rank {r}] line 0 of rank {r}\n" for r in range(2))
        + "(output of the 1 rank)\n[rank 0] line 0 of rank 0\n"
        + "after\n"
    )
    nbval = [sys.executable, "-m", "pytest", "--nbval", path.name, "-p", "no:cacheprovider", "-q"]
    out = subprocess.run(nbval, capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stdout + out.stderr


def test_interrupting_emulated_nodes_stops_them_all_and_says_so_in_one_line(kernel):
    """Kernel > Interrupt signals the kernel's whole process group, the torchrun agent
    with it; the workers, in sessions of their own, must be stopped too."""
    manager, client = kernel
    kernel_process = psutil.Process(manager.provisioner.process.pid)
    tests = str(Path(__file__).parent)
    msg_id = client.execute(
        "import os\n"
        "from labsupport.launch.nodes import torchrun_nodes\n"
        f"os.environ['PYTHONPATH'] = {tests!r} + os.pathsep + os.environ.get('PYTHONPATH', '')\n"
        "torchrun_nodes('test_run:hold_and_say_where_the_store_is', 1, 2, 300, "
        "args=('seconds=600',))\n"
    )
    deadline, below = time.monotonic() + 120, []
    while time.monotonic() < deadline:  # the agent and its 2 workers name the target
        below = kernel_process.children(recursive=True)
        named = [p for p in below if "test_run:hold" in " ".join(_cmdline(p))]
        if len(named) >= 3:
            break
        time.sleep(0.1)
    assert len(named) >= 3, "the node and its workers never started"
    manager.interrupt_kernel()
    reply = client.get_shell_msg(timeout=60)
    while reply["parent_header"]["msg_id"] != msg_id:  # an earlier cell's late reply
        reply = client.get_shell_msg(timeout=60)
    assert reply["content"]["ename"] == "LaunchInterrupted"
    assert reply["content"]["evalue"] == (
        "interrupted; the node and every process it started were stopped."
    )
    assert len(reply["content"]["traceback"]) == 1
    gone, alive = psutil.wait_procs(named, timeout=5)
    assert [p for p in alive if p.status() != psutil.STATUS_ZOMBIE] == []
    with pytest.raises(queue.Empty):  # drain
        while True:
            client.get_iopub_msg(timeout=0.5)


def _cmdline(proc: psutil.Process) -> list[str]:
    try:
        return proc.cmdline()
    except psutil.Error:
        return []


def test_reset_stops_what_earlier_attempts_left_and_the_next_launch_runs(kernel):
    _, client = kernel
    _, reply = run_cell(
        client,
        "import socket, subprocess, psutil, torch.distributed as dist\n"
        "from labsupport import launch\n"
        "from labsupport.labs import reset\n"
        "mine = subprocess.Popen(['sleep', '600'])  # started in a cell, never waited for\n"
        "def leaves_a_server():\n"
        "    return subprocess.Popen(['sleep', '601'], start_new_session=True).pid\n"
        "escaped = launch(leaves_a_server, 2)  # left running outside the kernel's tree\n"
        "with socket.socket() as s:\n"
        "    s.bind(('127.0.0.1', 0)); port = s.getsockname()[1]\n"
        "dist.init_process_group('gloo', init_method=f'tcp://127.0.0.1:{port}',\n"
        "                        rank=0, world_size=1)  # a rank's code run in the kernel\n"
        "assert all(psutil.pid_exists(p) for p in escaped)",
    )
    assert reply["status"] == "ok", reply
    messages, reply = run_cell(client, "done = reset()")
    assert reply["status"] == "ok", reply
    said = streams(messages)
    assert "destroyed the process group this kernel had initialised" in said, said
    assert "the launcher's forkserver" in said and "(sleep 600)" in said, said
    assert said.count("(sleep 601)") == 2, said
    assert said.rstrip().endswith("the next launch starts afresh."), said
    messages, reply = run_cell(
        client,
        "import multiprocessing.resource_tracker, time\n"
        "time.sleep(0.2)\n"
        "kept = multiprocessing.resource_tracker._resource_tracker._pid\n"
        "left = [c.pid for c in psutil.Process().children(recursive=True) if c.pid != kept]\n"
        "print(mine.poll() is not None, any(psutil.pid_exists(p) for p in escaped),\n"
        "      dist.is_initialized(), socket.socket().connect_ex(('127.0.0.1', port)) != 0,\n"
        "      left)\n"
        "print(launch(lambda: 1, 2))",
    )
    assert reply["status"] == "ok", reply
    assert streams(messages).splitlines()[-2:] == ["True False False True []", "[1, 1]"]
