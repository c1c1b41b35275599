"""Several "nodes" on one machine: a launcher started once per node, as on a cluster.

On a cluster, a scheduler or a person starts one launcher per node (``torchrun``, the
DeepSpeed launcher) and the launchers meet at the first node's address. Here every node
is a process of this machine, and they meet on 127.0.0.1. :func:`torchrun_nodes` runs a
``module:function`` under ``torchrun`` as ``nnodes`` nodes; :func:`run_nodes` runs any
commands as nodes and collects what their ranks returned; :func:`stream_nodes`, under
both, shows the nodes' output live as it comes (in a notebook, in a display area that is
emptied at the end, as a launch's is) and stops every node, and all it started, when
one fails, at the timeout, or on an interrupt; :func:`node_environment` is the
environment a node starts with. The ranks run ``python -m labsupport.run
module:function``, which prints each rank's return value as a ``[rank N] -> value`` line.

Everything the nodes listen on is on the loopback interface: torchrun runs as
:mod:`~labsupport.launch.local_torchrun`, and :func:`node_environment` points gloo and
NCCL at the loopback interface.
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import sys
import tempfile
import time

import psutil

from labsupport.launch import loopback
from labsupport.launch.launcher import LaunchInterrupted
from labsupport.launch.ranks import LiveView

#: How often the nodes' output is read for new lines, and their exit checked (seconds).
POLL_S = 0.05


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind((loopback.LOOPBACK, 0))
        return s.getsockname()[1]


def node_environment() -> dict:
    """This process's environment, less what a launcher of its own would set, with one
    thread per process (torchrun's default for several processes per node), unbuffered
    output, and gloo's and NCCL's sockets on the loopback interface."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **loopback.environment())
    return env


def torchrun_command(*options: str) -> list[str]:
    """The command that runs ``torchrun OPTIONS`` on one node of this machine: torchrun
    with its stores on loopback (:mod:`~labsupport.launch.local_torchrun`)."""
    return [sys.executable, "-m", "labsupport.launch.local_torchrun", *options]


def torchrun_nodes(
    target: str, nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 120, args=()
) -> list[str]:
    """Run ``target`` (``module:function``) as ``nnodes`` torchrun "nodes" on this machine.

    Each node is its own ``torchrun`` process, meeting the others through c10d rendezvous
    on 127.0.0.1, exactly as separate machines would meet at the first node's address.
    With c10d rendezvous torchrun numbers the nodes itself once all have joined, sorting
    them by host name and then process id (it ignores ``--node-rank``, which only the
    static rendezvous uses). Returns the ``[rank N] -> value`` lines the ranks printed,
    sorted by rank. Raises ``RuntimeError`` with each node's output if a node fails.
    """
    endpoint = f"{loopback.LOOPBACK}:{free_port()}"
    command = torchrun_command(
        f"--nnodes={nnodes}",
        f"--nproc-per-node={nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={endpoint}",
        "--rdzv-id=labsupport-nodes",
        "--max-restarts=0",
        "-m",
        "labsupport.run",
        target,
        *args,
    )
    return run_nodes([command] * nnodes, node_environment(), timeout)


def run_nodes(commands: list[list[str]], env: dict, timeout: float, what="a torchrun node"):
    """Run ``commands`` at once, one per node (:func:`stream_nodes`); return the
    ``[rank N]`` lines of their output, sorted by rank. Raises ``RuntimeError`` naming
    ``what`` failed, with every node's output, if one fails or they do not all finish
    within ``timeout`` seconds."""
    outputs, codes, timed_out = stream_nodes(commands, env, timeout)
    if timed_out or any(code != 0 for code in codes):
        how = f"did not finish within {timeout} s" if timed_out else "failed"
        report = "\n".join(
            f"--- node {i} (exit code {code}) ---\n{out}"
            for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
        )
        raise RuntimeError(f"{what} {how}:\n{report}")
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("[rank ")]
    return sorted(lines, key=lambda line: int(re.match(r"\[rank (\d+)\]", line).group(1)))


def stream_nodes(commands: list[list[str]], env: dict, timeout: float, shown=None):
    """Run ``commands`` at once, one per node, and show their output live.

    Each node writes into a file of its own (not a pipe, which could fill up), read as
    it grows; its lines appear as they come, ``[node N]`` before each (``shown`` may
    rewrite a line for the display; the default shortens torch's log lines to their
    text, :func:`log_message`), in a :class:`~labsupport.launch.ranks.LiveView`:
    printed in a terminal, in a notebook a display area emptied at the end. Every node
    still running, and every process it started, is stopped when one node fails or
    after ``timeout`` seconds. Returns each node's whole output, each node's exit
    code, and whether the timeout passed. An interrupt (Ctrl-C, Kernel > Interrupt)
    stops them all and raises :class:`~labsupport.launch.launcher.LaunchInterrupted`,
    which a notebook shows as one line, as it shows an interrupted launch.
    """
    shown = shown or log_message
    view = LiveView(len(commands), unit="node")
    with contextlib.ExitStack() as files:
        outputs = [_Output(files.enter_context(tempfile.TemporaryFile())) for _ in commands]
        nodes: list[subprocess.Popen] = []

        def show(final: bool = False) -> None:
            for i, output in enumerate(outputs):
                for line in output.new_lines(final):
                    view.line(i, "stdout", shown(line))
            view.poll()

        try:
            for command, output in zip(commands, outputs, strict=True):
                nodes.append(
                    subprocess.Popen(command, env=env, stdout=output.file, stderr=subprocess.STDOUT)
                )
            timed_out = wait_for_nodes(nodes, time.monotonic() + timeout, show)
        except KeyboardInterrupt:
            kill_trees(nodes)
            raise _interrupted(len(commands)) from None
        finally:
            kill_trees(nodes)
            show(final=True)
            view.close()
        texts = [output.text() for output in outputs]
    return texts, [node.returncode for node in nodes], timed_out


def _interrupted(count: int) -> LaunchInterrupted:
    if count == 1:
        return LaunchInterrupted("interrupted; the node and every process it started were stopped.")
    return LaunchInterrupted(
        f"interrupted; the {count} nodes and every process they started were stopped."
    )


class _Output:
    """A node's output file, read as it grows. ``os.pread`` reads at an offset of its
    own: the file offset, which the node and its processes share with this one, stays
    where their writes put it."""

    def __init__(self, file):
        self.file = file
        self.data = bytearray()
        self.shown = 0  # bytes handed out as lines

    def new_lines(self, final: bool = False) -> list[str]:
        """The complete lines written since the last call (all that is left if ``final``)."""
        while chunk := os.pread(self.file.fileno(), 1 << 16, len(self.data)):
            self.data += chunk
        end = len(self.data) if final else self.data.rfind(b"\n") + 1
        if end <= self.shown:
            return []
        text = self.data[self.shown : end].decode("utf-8", "backslashreplace")
        self.shown = end
        return text.removesuffix("\n").split("\n")  # not splitlines: \x1e is no line end

    def text(self) -> str:
        return self.data.decode("utf-8", "backslashreplace")


def log_message(line: str) -> str:
    """A line of torch's log (``I1206 09:29:00.326000 26879 /.../api.py:553] text``) as its
    text; any other line as it is."""
    return re.sub(r"^[IWEF]\d{4} [\d:.]+ \d+ \S+\] ", "", line)


def wait_for_nodes(nodes: list[subprocess.Popen], deadline: float, each=None) -> bool:
    """Wait until every node exited, one failed, or the deadline; True if it passed.
    ``each()`` is called between checks (to show their output)."""
    while any(node.poll() is None for node in nodes):
        if any(node.returncode not in (None, 0) for node in nodes):
            return False  # one node failed: stop the others rather than wait for them
        if time.monotonic() > deadline:
            return True
        if each is not None:
            each()
        time.sleep(POLL_S)
    return False


def kill_trees(nodes: list[subprocess.Popen]) -> None:
    """Stop each node that is still running, and every process it started.

    torchrun starts each worker in a session of its own, so killing an agent does not
    reach them: collect every descendant first, then kill them all.
    """
    for node in nodes:
        if node.poll() is not None:
            continue
        try:
            tree = [psutil.Process(node.pid), *psutil.Process(node.pid).children(recursive=True)]
        except psutil.NoSuchProcess:
            tree = []
        for proc in tree:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        node.wait()
