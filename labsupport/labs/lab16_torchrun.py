"""Lab 16, fault tolerance: torchrun restarting a job by itself.

:func:`torchrun_job` runs one ``torchrun`` that may restart the job
(``--max-restarts``), elastic between one and two nodes (``--nnodes=1:2``);
:func:`train_elastic` is the job: the notebook's training loop (which
:func:`save_loop` writes to a file, pickled by value as :func:`labsupport.launch` sends
it to its ranks), going on from its newest complete checkpoint, and whose rank 2 dies in
the first attempt. torchrun restarts the workers; only the training script can bring
back where they were.
"""

from __future__ import annotations

import os
import re

import cloudpickle
import torch
import torch.distributed as dist

from labsupport.labs.lab16_fault_tolerance import latest_checkpoint
from labsupport.launch import loopback
from labsupport.launch.launcher import rank_environment
from labsupport.launch.nodes import free_port, log_message, stream_nodes, torchrun_command


def save_loop(train, path: str) -> str:
    """Write the training loop ``train`` (a function, the notebook's) to the file
    ``path``, pickled by value, for :func:`train_elastic`; returns ``path``."""
    with open(path, "wb") as f:
        cloudpickle.dump(train, f)
    return path


def train_elastic(root: str, loop: str, kill_rank: int = 2, kill_step: int = 10) -> dict | None:
    """The training loop in the file ``loop`` (:func:`save_loop`) as a job restarted by
    torchrun: go on from the newest complete checkpoint under ``root`` if there is one,
    and in the job's first attempt only (``TORCHELASTIC_RESTART_COUNT`` 0), let rank
    ``kill_rank`` die at ``kill_step``."""
    # torch takes no more threads than the machine has cores, whatever OMP_NUM_THREADS
    # asks; launch()'s ranks set the number themselves, and so does this job, so that
    # both do every sum in the same order
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", torch.get_num_threads())))
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    kill = (kill_rank, kill_step) if attempt == 0 else None
    with open(loop, "rb") as f:
        train = cloudpickle.load(f)
    result = train(root, kill=kill, resume_from=latest_checkpoint(root))
    if dist.get_rank() != 0:
        return None  # labsupport.run prints rank 0's result only
    return {"attempt": attempt, "resumed_at": result["start"], "losses": result["losses"]}


def torchrun_job(target: str, nproc: int = 4, max_restarts: int = 1, args=(), timeout=300):
    """Run ``target`` (``module:function``) under one ``torchrun`` that may restart the
    job ``max_restarts`` times, elastic between one and two nodes (``--nnodes=1:2``; only
    this one comes). Each worker gets the number of threads a :func:`labsupport.launch`
    rank gets, so that the two compute alike. torchrun's lines show live as they come
    (:func:`~labsupport.launch.nodes.stream_nodes`; an interrupt stops torchrun and its
    workers). Returns the ``[rank N] -> value`` lines and torchrun's own lines about the
    job (failures, restarts), and its exit code."""
    threads = rank_environment(0, nproc, 0, "", None)["OMP_NUM_THREADS"]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("TORCHELASTIC", "MASTER_"))}
    env.update(OMP_NUM_THREADS=threads, PYTHONUNBUFFERED="1", LOGLEVEL="INFO")
    # torch 2.13's agent keeps one store for the workers across restarts, and a restarted
    # worker can read a dead one's address from it (pytorch/pytorch#135712, #167288)
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    elastic = ["--nnodes=1:2", f"--nproc-per-node={nproc}", f"--max-restarts={max_restarts}"]
    meet = ["--rdzv-backend=c10d", f"--rdzv-endpoint={loopback.LOOPBACK}:{free_port()}"]
    quick = ["--rdzv-conf=last_call_timeout=1", "--monitor-interval=0.2"]
    # torchrun with its stores on 127.0.0.1 (labsupport.launch.local_torchrun)
    command = torchrun_command(*elastic, *meet, *quick, "-m", "labsupport.run", target, *args)
    [output], [returncode], timed_out = stream_nodes([command], env, timeout)
    if timed_out:
        raise RuntimeError(f"torchrun did not finish within {timeout} s:\n{output}")
    lines = output.splitlines()
    results = sorted(line for line in lines if line.startswith("[rank "))
    about_the_job = r"attempts left|restart_count=|failed \(exitcode"
    agent = [_message(line) for line in lines if re.search(about_the_job, line)]
    return {"results": results, "agent": agent, "returncode": returncode, "output": output}


def _message(line: str) -> str:
    """A torchrun log line without its level, time, process ids, source location and
    the path of the Python binary."""
    return re.sub(r" \(pid: \d+\) of binary: .*$", "", log_message(line)).strip()
