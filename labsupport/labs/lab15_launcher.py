"""Lab 15, frameworks: DeepSpeed's own launcher, run from a cell as lab 6 runs torchrun.

:func:`deepspeed_nodes` starts one ``deepspeed`` launcher per "node" of a hostfile, on
this machine, as a cluster without ssh would (``--no_ssh`` and each node's
``--node_rank``); every process it starts runs this module (``--module``), which is
:func:`launcher_worker`. On a machine without GPUs DeepSpeed's CPU accelerator counts
one "GPU" per NUMA node (or ``LOCAL_SIZE``), so ``--num_gpus`` says how many processes a
node runs (``deepspeed/accelerator/cpu_accelerator.py``). :func:`side_by_side` parses
the same launch written for ``deepspeed`` and for ``torchrun`` with each one's own
argument parser (``deepspeed/launcher/runner.py``, ``torch/distributed/run.py``).
Exercise 3's checker holds a learner's rank layout against DeepSpeed's own hostfile
functions and ``launch.py``'s numbering of the ranks.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile

import torch
import torch.distributed as dist

from labsupport.labs.cells import exercise
from labsupport.launch import loopback
from labsupport.launch.nodes import free_port, node_environment, run_nodes
from labsupport.launch.runtime import device
from labsupport.parallel.deepspeed_setup import cpu_accelerator, use_deepspeed_accelerator


def launcher_worker(argv=None) -> dict:
    """What every process the DeepSpeed launcher starts runs here: parse the
    ``--local_rank`` the launcher appends, let DeepSpeed initialise ``torch.distributed``
    from the environment, sum the ranks, print this rank's view of the world."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--local_rank", type=int, default=-1)  # --local_rank=N
    args = parser.parse_args(argv)
    use_deepspeed_accelerator()
    import deepspeed

    deepspeed.init_distributed()  # env:// from RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT
    total = torch.tensor([float(dist.get_rank())], device=device())
    dist.all_reduce(total)
    env = os.environ
    info = {
        "rank": dist.get_rank(),
        "local_rank": int(env["LOCAL_RANK"]),
        "--local_rank": args.local_rank,
        "node_rank": int(env["CROSS_RANK"]),
        "world_size": dist.get_world_size(),
        "LOCAL_SIZE": int(env["LOCAL_SIZE"]),
        "CROSS_SIZE": int(env["CROSS_SIZE"]),
        "backend": dist.get_backend(),
        "sum_of_ranks": int(total.item()),
    }
    sys.stdout.write(f"[rank {info['rank']}] -> {info!r}\n")
    sys.stdout.flush()
    dist.destroy_process_group()
    return info


def hostfile_text(hosts: dict) -> str:
    """A DeepSpeed (MPI-style) hostfile: one ``host slots=N`` line per node."""
    return "".join(f"{host} slots={slots}\n" for host, slots in hosts.items())


def deepspeed_command(hostfile: str, node_rank: int, port: int, num_nodes: int, num_gpus: int):
    """The ``deepspeed`` command one "node" runs: ``python -m deepspeed.launcher.runner``
    is what the ``deepspeed`` script calls."""
    runner = [sys.executable, "-m", "deepspeed.launcher.runner"]
    where = [f"--hostfile={hostfile}", f"--num_nodes={num_nodes}", f"--num_gpus={num_gpus}"]
    this_node = ["--no_ssh", f"--node_rank={node_rank}"]
    meet = ["--master_addr=127.0.0.1", f"--master_port={port}", "--log_level=warning"]
    return [*runner, *where, *this_node, *meet, "--module", __name__]


def torchrun_command(node_rank: int, port: int, num_nodes: int, num_gpus: int):
    """The same launch for ``torchrun`` (``python -m torch.distributed.run``), with its
    static rendezvous: no hostfile, since a scheduler or a person starts torchrun on every
    node; each node says its ``--node-rank`` and where rank 0 listens."""
    runner = [sys.executable, "-m", "torch.distributed.run"]
    where = [f"--nnodes={num_nodes}", f"--nproc-per-node={num_gpus}"]
    meet = [f"--node-rank={node_rank}", "--master-addr=127.0.0.1", f"--master-port={port}"]
    return [*runner, *where, *meet, "-m", __name__]


def side_by_side(node_rank: int = 0, port: int = 29500, num_nodes: int = 2, num_gpus: int = 2):
    """One launch as ``deepspeed`` and as ``torchrun`` write it, each command parsed by
    that launcher's own argument parser: a row per setting, the flag and the value each
    parser read."""
    from torch.distributed.run import get_args_parser

    with cpu_accelerator():
        from deepspeed.launcher import runner
    ds_cmd = deepspeed_command("hostfile", node_rank, port, num_nodes, num_gpus)
    tr_cmd = torchrun_command(node_rank, port, num_nodes, num_gpus)
    ds = runner.parse_args(ds_cmd[3:])  # what follows `python -m deepspeed.launcher.runner`
    tr = get_args_parser().parse_args(tr_cmd[3:])
    rows = [
        ("hosts and their slots", "--hostfile", ds.hostfile, "(none)", "-"),
        ("nodes", "--num_nodes", ds.num_nodes, "--nnodes", tr.nnodes),
        ("processes per node", "--num_gpus", ds.num_gpus, "--nproc-per-node", tr.nproc_per_node),
        ("this node's rank", "--node_rank", ds.node_rank, "--node-rank", tr.node_rank),
        ("rank 0's address", "--master_addr", ds.master_addr, "--master-addr", tr.master_addr),
        ("and port", "--master_port", ds.master_port, "--master-port", tr.master_port),
        ("run a module", "--module", ds.module, "-m", tr.module),
        ("what to run", "", ds.user_script, "", tr.training_script),
    ]
    keys = ("setting", "deepspeed", "parsed", "torchrun", "parsed ")
    return [dict(zip(keys, row, strict=True)) for row in rows]


#: What a process finds in its environment under each launcher (``deepspeed/launcher/
#: launch.py``; ``torch/distributed/elastic/agent/server/local_elastic_agent.py``).
ENVIRONMENT = [
    ("global rank", "RANK", "RANK"),
    ("rank on this node", "LOCAL_RANK, and the argument --local_rank=N", "LOCAL_RANK"),
    ("processes in the job", "WORLD_SIZE", "WORLD_SIZE"),
    ("where rank 0 listens", "MASTER_ADDR, MASTER_PORT", "MASTER_ADDR, MASTER_PORT"),
    ("node rank", "CROSS_RANK", "GROUP_RANK"),
    ("nodes", "CROSS_SIZE", "GROUP_WORLD_SIZE"),
    ("processes on this node", "LOCAL_SIZE", "LOCAL_WORLD_SIZE"),
    (
        "threads per process",
        "not set (unless --bind_cores_to_rank)",
        "OMP_NUM_THREADS=1 if unset and --nproc-per-node > 1",
    ),
]


def deepspeed_nodes(hosts: dict, num_nodes: int, num_gpus: int, timeout: float = 180) -> list:
    """Run :func:`launcher_worker` with the DeepSpeed launcher as ``num_nodes`` "nodes"
    of the hostfile ``hosts`` on this machine, ``num_gpus`` processes each (-1: as many
    as the host's slots).

    Each node is its own launcher, started as on a cluster without ssh (``--no_ssh``
    and its ``--node_rank``), all meeting at ``--master_addr:--master_port``, where rank
    0 hosts the store, on loopback (see the end of this module). Returns the
    ``[rank N] -> value`` lines, sorted by rank; raises ``RuntimeError`` with every
    node's output if one fails.
    """
    port = free_port()
    env = node_environment()  # one thread per process, as torchrun would set
    env["DS_ACCELERATOR"] = "cpu"
    with tempfile.TemporaryDirectory() as folder:
        hostfile = os.path.join(folder, "hostfile")
        with open(hostfile, "w") as f:
            f.write(hostfile_text(hosts))
        commands = [
            deepspeed_command(hostfile, n, port, num_nodes, num_gpus) for n in range(num_nodes)
        ]
        return run_nodes(commands, env, timeout, what="a DeepSpeed launcher")


# --------------------------------------------------------------------------- exercise 3


def deepspeed_rank_layout(hostfile: str, num_nodes: int = -1, num_gpus: int = -1) -> list:
    """Where DeepSpeed's launcher puts each global rank: ``[(host, LOCAL_RANK), ...]``.

    ``deepspeed/launcher/runner.py``'s own functions trim the hostfile's resources; then
    this follows ``launch.py``'s ``main``, which every node runs: it numbers the global
    ranks host after host and sets ``local_rank = dist_rank % num_local_procs``. On hosts
    that all run as many processes, that is the process's index on its host; on a host
    whose first global rank is not a multiple of its process count, it is a rotation of it
    (hosts of 3 and 2 slots: ranks 3 and 4 get local ranks 1 and 0).
    """
    with cpu_accelerator():
        from deepspeed.launcher import runner

    pool = runner._parse_hostfile(hostfile.splitlines())
    active = runner.parse_inclusion_exclusion(pool, "", "")
    active = runner.apply_num_nodes_and_gpus(active, num_nodes, num_gpus)
    layout = []
    for host, slots in active.items():
        num_local_procs = len(slots)
        for _ in range(num_local_procs):
            dist_rank = len(layout)  # launch.py's global_rank_mapping: host after host
            layout.append((host, dist_rank % num_local_procs))
    return layout


#: Hostfiles the checker tries, with ``--num_nodes`` and ``--num_gpus`` (-1: not given).
RANK_LAYOUT_CASES = [
    ("worker-0 slots=4\nworker-1 slots=4\n", -1, -1),
    ("worker-0 slots=4\nworker-1 slots=4\n", -1, 2),
    ("a slots=8\nb slots=8\nc slots=8\n", 2, -1),
    ("# two nodes\n\nnode0 slots=2\nnode1 slots=2\n", -1, -1),
    ("n1 slots=8\nn2 slots=4\nn3 slots=6\n", 3, 1),
    ("gpu-07 slots=3\n", -1, -1),
    ("a slots=3\nb slots=2\n", -1, -1),  # b's ranks 3 and 4: LOCAL_RANK 1 and 0
    ("p slots=2\nq slots=3\nr slots=4\n", -1, -1),
]


@exercise
def check_rank_layout(fn) -> str:
    """Exercise 3: ``fn(hostfile_text, num_nodes, num_gpus)``, against DeepSpeed."""
    for text, nodes, gpus in RANK_LAYOUT_CASES:
        got = [tuple(x) for x in fn(text, nodes, gpus)]
        want = deepspeed_rank_layout(text, nodes, gpus)
        assert len(got) == len(want), (
            f"--num_nodes={nodes} --num_gpus={gpus} with the hostfile {text!r}: "
            f"{len(got)} processes, not as many as DeepSpeed starts (which hosts does it "
            "keep, and how many slots of each?)"
        )
        assert [h for h, _ in got] == [h for h, _ in want], (
            f"--num_nodes={nodes} --num_gpus={gpus} with the hostfile {text!r}: the right "
            "number of processes, but not every rank on the host DeepSpeed gives it (in "
            "which order are the ranks numbered?)"
        )
        assert got == want, (
            f"--num_nodes={nodes} --num_gpus={gpus} with the hostfile {text!r}: every rank "
            f"on its host, but local ranks {[r for _, r in got]}, where DeepSpeed's launch.py "
            f"gives {[r for _, r in want]} (global rank % processes on that host)"
        )
    return "which host and local rank DeepSpeed's launcher gives every rank"


if __name__ == "__main__":
    # DeepSpeed's launcher starts no store: rank 0 hosts it, in init_distributed's env://
    # rendezvous, on every interface. Rank 0 opens it on loopback first, as the master
    # address is 127.0.0.1, and torch's store shares it (labsupport.launch.loopback).
    server = loopback.host_env_store()
    launcher_worker()
