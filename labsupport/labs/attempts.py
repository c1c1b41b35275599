"""Start an exercise afresh: :func:`reset` stops what earlier attempts left behind.

A launch stops its ranks however it ends, and what they started; a kernel can still hold
on to things between attempts that no launch owns:

* a default process group created in the kernel itself, by a rank's function run in a
  cell instead of through ``launch``: ``init_process_group`` then refuses to run a second
  time, and the store it hosts keeps its port;
* processes the kernel started in a cell (``subprocess``, ``!torchrun ...`` interrupted)
  or that ranks started and left running (:mod:`labsupport.launch.leftovers`);
* the launcher's forkserver, which keeps the modules it imported before an edit to them;
* the lock file of an interrupted build of DeepSpeed's C++ extension, which makes the next
  build wait for it forever (torch's ``FileBaton`` in ``torch/utils/file_baton.py``).

:func:`reset` stops or removes each, checks that nothing the kernel started still runs or
listens, and says what it did. Restarting the kernel does the same, less the build lock,
and forgets every variable too.
"""

from __future__ import annotations

import multiprocessing.forkserver
import multiprocessing.resource_tracker
import os
from dataclasses import dataclass, field

import psutil
import torch.distributed as dist

from labsupport.launch import launcher, leftovers


@dataclass
class Reset:
    """What :func:`reset` found and stopped."""

    process_group: bool = False
    processes: list[str] = field(default_factory=list)
    build_locks: list[str] = field(default_factory=list)

    def lines(self) -> list[str]:
        said = []
        if self.process_group:
            said.append("destroyed the process group this kernel had initialised")
        if self.processes:
            said.append(f"stopped {len(self.processes)} processes: {', '.join(self.processes)}")
        said += [f"removed the stale build lock {path}" for path in self.build_locks]
        return said or ["nothing was left from earlier attempts"]


def _kept() -> set[int]:
    """multiprocessing's resource tracker: the kernel's, kept running (killing it makes
    the next user print that it died and start another)."""
    pid = multiprocessing.resource_tracker._resource_tracker._pid
    return {pid} if pid is not None else set()


def kernel_leftovers() -> list[psutil.Process]:
    """Everything this kernel started that runs now: its descendants (the forkserver
    among them) and what its launches' ranks started and left outside its tree."""
    found = {p.pid: p for p in psutil.Process().children(recursive=True)}
    for proc in leftovers.started_by(f"labsupport-{os.getpid()}-", prefix=True):
        found.setdefault(proc.pid, proc)
    kept = _kept()
    return [p for pid, p in sorted(found.items()) if pid not in kept]


def _stale_build_locks() -> list[str]:
    """The lock files of torch's extension builds that no process of ours holds: after
    the kernel's processes are stopped, a lock of an extension the course builds is
    stale (torch writes no process id into it to tell)."""
    from torch.utils.cpp_extension import _get_build_directory

    lock = os.path.join(_get_build_directory("deepspeed_shm_comm", verbose=False), "lock")
    return [lock] if os.path.exists(lock) else []


def reset() -> Reset:
    """Stop what earlier attempts left in this kernel (see the module's docstring), print
    what was done, and check that nothing this kernel started still runs or listens."""
    done = Reset()
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
        done.process_group = True
    server = multiprocessing.forkserver._forkserver._forkserver_pid
    found = [p for p in kernel_leftovers() if p.pid != server]
    done.processes = leftovers.stop(found)
    if launcher.stop_forkserver():
        done.processes.insert(0, f"the launcher's forkserver (pid {server})")
    for lock in _stale_build_locks():
        os.remove(lock)
        done.build_locks.append(lock)
    still = kernel_leftovers()
    if still:
        raise RuntimeError(
            f"these processes did not stop: {[leftovers.describe(p) for p in still]}; "
            "restart the kernel (Kernel > Restart Kernel)"
        )
    for line in done.lines():
        print(f"Reset: {line}.")
    print("Nothing this kernel started is running now; the next launch starts afresh.")
    return done
