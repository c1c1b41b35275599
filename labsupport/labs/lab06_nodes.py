"""Lab 6's nodes, all on this machine: torchrun started once per "node", and a Slurm batch
script run with stand-ins for Slurm's commands.

Each "node" is a process of its own (a ``torchrun`` agent, or what ``srun`` starts), and
the nodes meet through a c10d rendezvous on 127.0.0.1, as separate machines meet at the
first node's address. The ranks run ``python -m labsupport.run module:function``, which
prints each rank's return value as a ``[rank N] -> value`` line; these functions return
those lines, sorted by rank.
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
from pathlib import Path

import psutil


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (for a rendezvous endpoint)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _node_environment() -> dict:
    """This process's environment, less what a launcher of its own would set."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    return env


def torchrun_nodes(
    target: str, nnodes: int = 2, nproc_per_node: int = 2, timeout: float = 120, args=()
) -> list[str]:
    """Run ``target`` (``module:function``) as ``nnodes`` torchrun "nodes" on this machine.

    Each node is its own ``torchrun`` process, meeting the others through c10d rendezvous
    on 127.0.0.1, exactly as separate machines would meet at the first node's address.
    With c10d rendezvous torchrun numbers the nodes itself once all have joined, sorting
    them by host name and then process id (it ignores ``--node-rank``, which only the
    static rendezvous uses). Returns the
    ``[rank N] -> value`` lines the ranks printed, sorted by rank. Raises
    ``RuntimeError`` with each node's output if a node fails.
    """
    endpoint = f"127.0.0.1:{free_port()}"
    commands = [
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
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
        ]
        for _ in range(nnodes)
    ]
    return _run_nodes(commands, _node_environment(), timeout)


#: A Slurm batch script that runs a lab function on two nodes under torchrun. Submit it
#: with ``sbatch``; :func:`sbatch_here` runs it on this machine. Options as documented in
#: https://slurm.schedmd.com/sbatch.html and https://pytorch.org/docs/stable/elastic/run.html
SBATCH_TWO_NODES = """\
#!/bin/bash
#SBATCH --job-name=two-nodes
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1     # one task per node: torchrun, which starts the ranks
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64      # the node's cores for torchrun's 8 workers: set to your nodes'
#SBATCH --time=00:10:00

# The first node of the job hosts the rendezvous, on a port free there.
head_node=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
port=${RDZV_PORT:-29500}

# srun starts its command once per task: one torchrun on each node.
srun torchrun \\
    --nnodes "$SLURM_JOB_NUM_NODES" \\
    --nproc-per-node "$SLURM_GPUS_ON_NODE" \\
    --rdzv-backend c10d \\
    --rdzv-endpoint "$head_node:$port" \\
    --rdzv-id "$SLURM_JOB_ID" \\
    -m labsupport.run labsupport.labs.lab06_launching:all_reduce_ranks
"""

#: Stand-ins for the two Slurm commands the script calls, enough to run it on one
#: machine: ``srun`` starts its command once per node, in parallel, and fails if one
#: fails; ``scontrol show hostnames`` prints the job's nodes, one a line.
SLURM_STAND_INS = {
    "srun": """\
#!/bin/bash
for node in $(seq 0 $((SLURM_JOB_NUM_NODES - 1))); do
    SLURM_NODEID=$node SLURM_PROCID=$node SLURM_LOCALID=0 "$@" &
done
status=0
for job in $(jobs -p); do wait "$job" || status=1; done
exit $status
""",
    "scontrol": """\
#!/bin/bash
tr ',' '\\n' <<< "${3:-$SLURM_JOB_NODELIST}"
""",
}


def sbatch_here(
    script: str = SBATCH_TWO_NODES, nodes: int = 2, gpus_per_node: int = 2, timeout: float = 120
) -> list[str]:
    """Run a batch script as Slurm would run it on ``nodes`` nodes, here all this machine.

    The job gets the variables sbatch sets (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
    ``SLURM_JOB_NUM_NODES``, ``SLURM_GPUS_ON_NODE``), ``srun`` and ``scontrol`` are
    :data:`SLURM_STAND_INS`, and ``RDZV_PORT`` is a free port. Returns the
    ``[rank N] -> value`` lines, sorted by rank, like :func:`torchrun_nodes`.
    """
    with tempfile.TemporaryDirectory() as folder:
        for name, text in {**SLURM_STAND_INS, "job.sbatch": script}.items():
            (Path(folder) / name).write_text(text)
            (Path(folder) / name).chmod(0o755)
        env = _node_environment()
        env.update(
            PATH=os.pathsep.join([folder, os.path.dirname(sys.executable), env.get("PATH", "")]),
            SLURM_JOB_ID="1",
            SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * nodes),
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_GPUS_ON_NODE=str(gpus_per_node),
            RDZV_PORT=str(free_port()),
        )
        return _run_nodes([["bash", str(Path(folder) / "job.sbatch")]], env, timeout)


def _run_nodes(commands: list[list[str]], env: dict, timeout: float) -> list[str]:
    """Run ``commands`` at once; return the ``[rank N]`` lines of their output by rank."""
    with contextlib.ExitStack() as files:  # files, not pipes: no pipe can fill up
        logs = [files.enter_context(tempfile.TemporaryFile(mode="w+")) for _ in commands]
        nodes = [
            subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
            for cmd, log in zip(commands, logs, strict=True)
        ]
        try:
            timed_out = _wait_for_nodes(nodes, time.monotonic() + timeout)
        finally:
            _kill_trees(nodes)
        outputs = []
        for log in logs:
            log.seek(0)
            outputs.append(log.read())
    codes = [node.returncode for node in nodes]
    if timed_out or any(code != 0 for code in codes):
        what = f"did not finish within {timeout} s" if timed_out else "failed"
        report = "\n".join(
            f"--- node {i} (exit code {code}) ---\n{out}"
            for i, (code, out) in enumerate(zip(codes, outputs, strict=True))
        )
        raise RuntimeError(f"a torchrun node {what}:\n{report}")
    lines = [line for out in outputs for line in out.splitlines() if line.startswith("[rank ")]
    return sorted(lines, key=lambda line: int(re.match(r"\[rank (\d+)\]", line).group(1)))


def _wait_for_nodes(nodes: list[subprocess.Popen], deadline: float) -> bool:
    """Wait until every node exited, one failed, or the deadline; True if it passed."""
    while any(node.poll() is None for node in nodes):
        if any(node.returncode not in (None, 0) for node in nodes):
            return False  # one node failed: stop the others rather than wait for them
        if time.monotonic() > deadline:
            return True
        time.sleep(0.05)
    return False


def _kill_trees(nodes: list[subprocess.Popen]) -> None:
    """Stop each torchrun agent that is still running, and its workers.

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
