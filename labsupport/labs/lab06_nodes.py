"""Lab 6's Slurm job, on this machine: a batch script that runs a lab function on two
nodes under torchrun, and stand-ins for the Slurm commands it calls.

The nodes themselves (one ``torchrun`` per node, meeting through a c10d rendezvous on
127.0.0.1) are :mod:`labsupport.launch.nodes`'s; :func:`sbatch_here` runs the script as
Slurm would, every node this machine, and returns the ``[rank N] -> value`` lines its
ranks printed, sorted by rank.
"""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

from labsupport.launch.nodes import free_port, node_environment, run_nodes

#: A Slurm batch script that runs a lab function on two nodes under torchrun. Submit it
#: with ``sbatch``; :func:`sbatch_here` runs it on this machine. Options as documented in
#: https://slurm.schedmd.com/sbatch.html and https://pytorch.org/docs/stable/elastic/run.html
SBATCH_TWO_NODES = """\
#!/bin/bash
#SBATCH --job-name=two-nodes
#SBATCH --nodes=2
# one task per node: torchrun, which starts the ranks
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
# the node's cores for torchrun's 8 workers: set to your nodes'
#SBATCH --cpus-per-task=64
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
#: fails; ``scontrol show hostnames`` prints the job's nodes, one a line. A third stands
#: in for ``torchrun``: the same torchrun, with its stores on 127.0.0.1, since every node
#: is this machine (:mod:`labsupport.launch.local_torchrun`).
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
    "torchrun": """\
#!/bin/bash
exec python -m labsupport.launch.local_torchrun "$@"
""",
}


def sbatch_here(
    script: str = SBATCH_TWO_NODES, nodes: int = 2, gpus_per_node: int = 2, timeout: float = 120
) -> list[str]:
    """Run a batch script as Slurm would run it on ``nodes`` nodes, here all this machine.

    The job gets the variables sbatch sets (``SLURM_JOB_ID``, ``SLURM_JOB_NODELIST``,
    ``SLURM_JOB_NUM_NODES``, ``SLURM_GPUS_ON_NODE``), ``srun``, ``scontrol`` and
    ``torchrun`` are :data:`SLURM_STAND_INS`, and ``RDZV_PORT`` is a free port. Returns
    the ``[rank N] -> value`` lines, sorted by rank, like
    :func:`labsupport.launch.nodes.torchrun_nodes`.
    """
    with tempfile.TemporaryDirectory() as folder:
        for name, text in {**SLURM_STAND_INS, "job.sbatch": script}.items():
            (Path(folder) / name).write_text(text)
            (Path(folder) / name).chmod(0o755)
        env = node_environment()
        env.update(
            PATH=os.pathsep.join([folder, os.path.dirname(sys.executable), env.get("PATH", "")]),
            SLURM_JOB_ID="1",
            SLURM_JOB_NODELIST=",".join(["127.0.0.1"] * nodes),
            SLURM_JOB_NUM_NODES=str(nodes),
            SLURM_GPUS_ON_NODE=str(gpus_per_node),
            RDZV_PORT=str(free_port()),
        )
        return run_nodes([["bash", str(Path(folder) / "job.sbatch")]], env, timeout)
